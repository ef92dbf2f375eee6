"""The post-pass as one Triton kernel (CUDA): cost follows the rows it zeroes.

Why a kernel: the PyTorch post-pass (:func:`te_gqa_fix.postpass.dead_row_masks` plus
``masked_fill_``) is a dozen small launches that each touch every row of the buffer; at
8K tokens that is 26-42% of the attention backward (H200, bf16, 32/8 heads, d 128). The work that must be done is tiny: read
the ``4 x (batch + 1)`` offsets and write zeros into the rows whose true gradient is 0.

How: one launch. The work is cut into units: a block of ``BLOCK_T`` rows of dK/dV or of
dQ, and a share of that side's column tiles. A grid of ``_RESIDENT_PER_SM`` programs per
SM loops over the units, each program taking every ``grid``-th one. A program reads the
offsets once (in one chunk of up to 256, for a batch of few sequences, ``nseq + 1 <=
_COMPARE_MAX_OFFSETS``), checks them, and keeps every sequence's kept interval in
registers (KV: ``pad_kv[j] + [lo_j, hi_j)``, the attended key interval from the valid
offsets and the :class:`~te_gqa_fix.masks.KeySpan`, the formulas of
:func:`te_gqa_fix.postpass._key_bounds`; dQ: ``pad_q[j] + [0, lq_j)`` when ``lk_j >
0``); each unit compares its rows with them. For more sequences (or offsets in several
chunks) each unit reads the offsets again, and each row finds its sequence by a binary
search over the padded offsets. A unit none of whose rows is dead stores nothing;
otherwise it stores zeros (masked stores: live rows are never written) into its share
of the column tiles of dK and dV (same unit) or dQ. Packed
layouts (``[T, 2, H, D]``, ``[T, H, 2, D]``, ``[T, 3, H, D]``...) are addressed through
their row, head and dim strides, never copied. Offsets are int64 in-kernel, so buffers
beyond 2^31 elements are fine.

Impossible offsets (negative, decreasing, a padded segment shorter than its valid length,
a last buffer offset past the buffer) make every unit zero nothing; the first records
which argument in a pinned host word that :mod:`te_gqa_fix.offset_errors` reads at the
next call (issue #13). No host sync (shapes and strides only), launched on the current stream of the tensors'
device, no allocation (offsets that are not contiguous get a tiny device copy): safe
under CUDA-graph capture once compiled (warm it up first, as for any Triton kernel).
Launch parameters are tuned by ``benchmarks/sweep_kernel.py``; see docs/performance.md.

Triton is optional: nothing here imports it at module import time. :func:`available`
imports it on first use. Anything the kernel does not handle (no CUDA, no Triton,
quantized tensor subclasses, dtypes other than fp16/bf16/fp32, offsets that are not
int32/int64, tensors with a zero stride) makes :func:`zero_dead_rows_triton` return
False, and the caller falls back to the PyTorch implementation.
"""

from __future__ import annotations

import ctypes
import logging
import types
from typing import Any, Dict, Optional, Tuple

import torch

from . import c_launch, offset_errors
from ._logging import log_once
from .masks import KeySpan
from .validation import check_metadata

__all__ = ["Launches", "available", "zero_dead_rows_triton"]

# Filled in by _build() on first use: the kernel bodies below refer to these module
# globals, which Triton resolves when it compiles (or interprets) them.
tl: Any = None
_key_bounds_jit: Any = None
_seq_index_jit: Any = None
_search_kept_jit: Any = None
_zero_tiles_jit: Any = None
_scan_offsets_jit: Any = None
_read_offsets_jit: Any = None
_reach_jit: Any = None
_or_bits_jit: Any = None

_kernel: Any = None
_available: Optional[bool] = None
_broken = False
_sm_counts: Dict[int, int] = {}

_HANDLED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OFFSET_DTYPES = (torch.int32, torch.int64)

#: Rows per unit. BLOCK_T 32, 128-column tiles, at most 4 tiles per tensor and unit, 4
#: warps and 4 programs per SM were the best of ``benchmarks/sweep_kernel.py
#: --persistent`` (24 configurations) on an H200 (2026-11-30): the only one within every
#: goal but llama-8K's (results: benchmarks/results/2026-11-30-h200-looping-kernel).
BLOCK_T = 32
#: Elements per row in one store tile (a power of two).
BLOCK_C = 128
#: A side's column tiles are split into shares until there are this many units per SM
#: (for buffers of few row blocks) ...
_PROGRAMS_PER_SM = 8
_NUM_WARPS = 4
#: ... and into at least enough shares that a unit stores at most this many tiles per
#: tensor (0: no cap): smaller units balance the stores over the programs better.
_MAX_TILES = 4
#: Up to this many offsets (nseq + 1) a program finds its kept rows by comparing them with
#: every sequence's interval (``SEARCH`` False: no loads beyond the offset check's); beyond,
#: by a binary search per row. The compare costs BLOCK_T x nseq per unit, the search
#: N_ITER cached loads; on the H200 (2026-11-30) the compare was a little faster at 17
#: and 32 offsets, 28% slower at 65 (32K tokens, llama heads) and 60% at 256; 0 = always
#: search. In the launch plans' key, like the other launch settings; a wrapper keeps the
#: plans it already built (set it before the first launch).
_COMPARE_MAX_OFFSETS = 32
#: Programs per SM in the launch grid, each looping over units ``grid`` apart. Until
#: 2026-11-30 there was one program per unit, each reading the offsets before its first
#: store; the time grew with the number of programs, and looping programs were 18%
#: faster at MQA-32K and 3% at llama 32K/128K (same at 8K, 5% slower at MQA-8K).
_RESIDENT_PER_SM = 4


# --------------------------------------------------------------------------- kernel
# Plain functions, made Triton functions by _build(). Only long-standing ``tl`` APIs.


def _key_bounds(
    lq,
    lk,
    window_left,
    window_right,
    EXACT: tl.constexpr,
    TOP_LEFT: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
):
    """Attended key interval ``[lo, hi)`` per element of ``lq``/``lk`` (int64 vectors).

    The formulas of :func:`te_gqa_fix.postpass._key_bounds`; ``hi = 0`` when ``lq == 0``.
    """
    zero = tl.zeros_like(lk)
    if EXACT:
        # Union over the enabled diagonal alignments; an empty interval adds nothing.
        lo = lk
        hi = zero
        if TOP_LEFT:
            lo_a = zero
            if HAS_WL:
                lo_a = tl.maximum(zero - window_left, zero)
            hi_a = lk
            if HAS_WR:
                hi_a = tl.minimum(lk, lq + window_right)
            nonempty = hi_a > lo_a
            lo = tl.minimum(lo, tl.where(nonempty, lo_a, lk))
            hi = tl.maximum(hi, tl.where(nonempty, hi_a, zero))
        if BOTTOM_RIGHT:
            shift = lk - lq
            lo_b = zero
            if HAS_WL:
                lo_b = tl.maximum(shift - window_left, zero)
            hi_b = lk
            if HAS_WR:
                hi_b = tl.minimum(lk, lq + shift + window_right)
            nonempty_b = hi_b > lo_b
            lo = tl.minimum(lo, tl.where(nonempty_b, lo_b, lk))
            hi = tl.maximum(hi, tl.where(nonempty_b, hi_b, zero))
        hi = tl.where(lq > 0, hi, zero)
    else:
        lo = zero
        hi = tl.where(lq > 0, lk, zero)
    return lo, hi


def _seq_index(pad_ptr, rows, nseq, N_ITER: tl.constexpr):
    """Per row: index ``b`` of the last offset ``pad[b] <= row`` (``-1`` if none).

    Upper-bound binary search over the ``nseq + 1`` offsets; ``N_ITER`` iterations
    (``(nseq + 1).bit_length()``) are always enough. Loop bounds are constexpr because
    Triton's interpreter cannot iterate over a runtime scalar.
    """
    lo = tl.zeros_like(rows)
    hi = tl.zeros_like(rows) + (nseq + 1)
    for _ in range(N_ITER):
        active = lo < hi
        mid = (lo + hi) >> 1
        val = tl.load(pad_ptr + mid, mask=active, other=0).to(tl.int64)
        right = active & (val <= rows)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (val > rows), mid, hi)
    return lo - 1


def _search_kept(
    pad_ptr,
    cu_q_ptr,
    cu_kv_ptr,
    rows,
    in_buf,
    nseq,
    window_left,
    window_right,
    EXACT: tl.constexpr,
    TOP_LEFT: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    KV: tl.constexpr,
    N_ITER: tl.constexpr,
):
    """Per row: kept (the ``SEARCH`` path). Its sequence ``j`` by a binary search over the
    buffer offsets ``pad_ptr``, then ``j``'s offsets: a KV row (``KV``) is kept iff its
    position is in ``[lo_j, hi_j)``, a dQ row iff its position is below ``lq_j`` and
    ``lk_j > 0``."""
    seg = _seq_index_jit(pad_ptr, rows, nseq, N_ITER)
    inside = in_buf & (seg >= 0) & (seg < nseq)
    j = tl.where(inside, seg, 0)
    start = tl.load(pad_ptr + j, mask=inside, other=0).to(tl.int64)
    q0 = tl.load(cu_q_ptr + j, mask=inside, other=0).to(tl.int64)
    q1 = tl.load(cu_q_ptr + j + 1, mask=inside, other=0).to(tl.int64)
    k0 = tl.load(cu_kv_ptr + j, mask=inside, other=0).to(tl.int64)
    k1 = tl.load(cu_kv_ptr + j + 1, mask=inside, other=0).to(tl.int64)
    lq = q1 - q0
    lk = k1 - k0
    pos = rows - start
    if KV:
        lo, hi = _key_bounds_jit(
            lq, lk, window_left, window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR
        )
        kept = inside & (pos >= lo) & (pos < hi)
    else:
        kept = inside & (pos < lq) & (lk > 0)
    return kept


def _zero_tiles(
    ptr,
    rows,
    dead,
    n_heads,
    head_dim,
    stride_t,
    stride_h,
    stride_d,
    split,
    n_split,
    N_TILES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Store zeros at ``ptr[row, h, d]`` for the dead rows, column tiles split, split+n_split...

    Columns are the flattened ``(h, d)`` with ``d`` padded to ``BLOCK_D`` (a power of two),
    so the head and dim of a column are a shift and a mask away. ``N_TILES`` is this
    program's tile count, rounded up: tiles past the last head are fully masked.
    """
    cols = tl.arange(0, BLOCK_C)
    row_off = rows * stride_t
    zero = tl.zeros([BLOCK_T, BLOCK_C], dtype=ptr.dtype.element_ty)
    for i in range(N_TILES):
        tile = split + i * n_split
        flat = tile * BLOCK_C + cols
        h = flat // BLOCK_D
        d = flat % BLOCK_D
        col_ok = (h < n_heads) & (d < head_dim)
        col_off = h.to(tl.int64) * stride_h + d.to(tl.int64) * stride_d
        mask = dead[:, None] & col_ok[None, :]
        tl.store(ptr + (row_off[:, None] + col_off[None, :]), zero, mask=mask)


def _read_offsets(
    cu_q_ptr,
    cu_kv_ptr,
    pad_q_ptr,
    pad_kv_ptr,
    c,
    nseq,
    rows_q,
    rows_kv,
    window_left,
    window_right,
    EXACT: tl.constexpr,
    TOP_LEFT: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    SEARCH: tl.constexpr,
    HAS_Q: tl.constexpr,
    PAD_Q_BIT: tl.constexpr,
    PAD_KV_BIT: tl.constexpr,
    OFF_BLOCK: tl.constexpr,
):
    """Chunk ``c`` of the offsets: ``(err, f_kv, e_kv, f_q, e_q)``, one lane per offset.

    ``err``: error bits (:data:`te_gqa_fix.offset_errors.ARGUMENT_BITS`) of impossible
    offsets: negative or decreasing, a buffer segment shorter than its valid length (both
    arguments named), the last buffer offset past the buffer (dQ only when there is a dQ).
    When no padded offsets were passed the padded pointers are the valid ones and their
    bits name the valid argument.

    Unless ``SEARCH``, sequence ``j``'s kept rows: KV ``[f_kv, e_kv) = pad_kv[j] + [lo_j,
    hi_j)`` (``[lo, hi)`` from :func:`_key_bounds`), dQ ``[f_q, e_q) = pad_q[j] + [0,
    lq_j)`` when ``lk_j > 0``; lanes past the last sequence are empty.
    """
    lanes = tl.arange(0, OFF_BLOCK)
    idx = c * OFF_BLOCK + lanes
    has_off = idx <= nseq
    has_seg = idx < nseq
    cq0 = tl.load(cu_q_ptr + idx, mask=has_off, other=0).to(tl.int64)
    cq1 = tl.load(cu_q_ptr + idx + 1, mask=has_seg, other=0).to(tl.int64)
    ck0 = tl.load(cu_kv_ptr + idx, mask=has_off, other=0).to(tl.int64)
    ck1 = tl.load(cu_kv_ptr + idx + 1, mask=has_seg, other=0).to(tl.int64)
    pq0 = tl.load(pad_q_ptr + idx, mask=has_off, other=0).to(tl.int64)
    pq1 = tl.load(pad_q_ptr + idx + 1, mask=has_seg, other=0).to(tl.int64)
    pk0 = tl.load(pad_kv_ptr + idx, mask=has_off, other=0).to(tl.int64)
    pk1 = tl.load(pad_kv_ptr + idx + 1, mask=has_seg, other=0).to(tl.int64)
    # ---- impossible offsets
    bad_cq = (has_off & (cq0 < 0)) | (has_seg & (cq1 < cq0))
    bad_ck = (has_off & (ck0 < 0)) | (has_seg & (ck1 < ck0))
    bad_pq = (has_off & (pq0 < 0)) | (has_seg & (pq1 < pq0))
    bad_pk = (has_off & (pk0 < 0)) | (has_seg & (pk1 < pk0))
    # A segment shorter than its valid length: the two arguments disagree, name both.
    short_q = has_seg & (pq1 - pq0 < cq1 - cq0)
    short_k = has_seg & (pk1 - pk0 < ck1 - ck0)
    err = tl.where(bad_cq, 1, 0) | tl.where(bad_ck, 2, 0)
    err = err | tl.where(bad_pq, PAD_Q_BIT, 0) | tl.where(bad_pk, PAD_KV_BIT, 0)
    err = err | tl.where(short_q, PAD_Q_BIT | 1, 0) | tl.where(short_k, PAD_KV_BIT | 2, 0)
    # Past the buffer: the last buffer offset of each side (the lane idx == nseq).
    last = idx == nseq
    err = err | tl.where(last & (pk0 > rows_kv), PAD_KV_BIT, 0)
    if HAS_Q:
        err = err | tl.where(last & (pq0 > rows_q), PAD_Q_BIT, 0)
    zero = tl.zeros_like(cq0)
    f_kv = zero
    e_kv = zero
    f_q = zero
    e_q = zero
    if not SEARCH:
        # ---- kept intervals, one per sequence (lanes past the last one: empty)
        lq = tl.where(has_seg, cq1 - cq0, zero)
        lk = tl.where(has_seg, ck1 - ck0, zero)
        lo, hi = _key_bounds_jit(
            lq, lk, window_left, window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR
        )
        f_kv = pk0 + lo
        e_kv = pk0 + hi
        f_q = pq0
        e_q = pq0 + tl.where(lk > 0, lq, zero)
    return err, f_kv, e_kv, f_q, e_q


def _reach(first, end, row0, reach, BLOCK_T: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    """``reach`` updated with the kept intervals ``[first, end)`` for rows ``row0 + [0,
    BLOCK_T)``: row ``row0 + i`` is kept iff ``reach[i] > i``.

    Clamped to the rows they are ``[a_j, b_j)`` within ``[0, BLOCK_T]``, and row ``i`` is
    in one iff the largest ``b_j`` over the ``j`` with ``a_j <= i`` exceeds ``i``: a
    ``[BLOCK_T, lanes]`` compare-select-max, registers only. ``SKIP_EMPTY``: skipped when
    no interval meets the rows (worth a test when the offsets come in several chunks).
    """
    rel = tl.arange(0, BLOCK_T)
    zero = tl.zeros_like(first)
    a = tl.minimum(tl.maximum(first - row0, zero), zero + BLOCK_T).to(tl.int32)
    b = tl.minimum(tl.maximum(end - row0, zero), zero + BLOCK_T).to(tl.int32)
    if SKIP_EMPTY:
        if tl.max(b - a, axis=0) > 0:
            ends = tl.where(a[None, :] <= rel[:, None], b[None, :], 0)
            reach = tl.maximum(reach, tl.max(ends, axis=1))
    else:
        ends = tl.where(a[None, :] <= rel[:, None], b[None, :], 0)
        reach = tl.maximum(reach, tl.max(ends, axis=1))
    return reach


def _or_bits(err):
    """OR over the lanes of 4-bit error words, one bit at a time (old Tritons have no OR
    reduction)."""
    bits = tl.max(err & 1, axis=0) | tl.max(err & 2, axis=0)
    return bits | tl.max(err & 4, axis=0) | tl.max(err & 8, axis=0)


def _scan_offsets(
    cu_q_ptr,
    cu_kv_ptr,
    pad_q_ptr,
    pad_kv_ptr,
    nseq,
    rows_q,
    rows_kv,
    row0,
    is_kv,
    window_left,
    window_right,
    EXACT: tl.constexpr,
    TOP_LEFT: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    SEARCH: tl.constexpr,
    HAS_Q: tl.constexpr,
    PAD_Q_BIT: tl.constexpr,
    PAD_KV_BIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OFF_BLOCK: tl.constexpr,
    OFF_CHUNKS: tl.constexpr,
):
    """Every chunk of the offsets for one row block: ``(error bits, reach)`` for rows
    ``row0 + [0, BLOCK_T)`` (``reach`` as in :func:`_reach`; unused with ``SEARCH``).

    The path for offsets that come in several chunks, or a batch the binary search serves:
    read again for each row block. Every program computes the same error verdict from the
    same ``4 x (nseq + 1)`` offsets, so every program agrees to zero nothing when it is
    non-zero.
    """
    err = tl.zeros([OFF_BLOCK], dtype=tl.int32)
    reach = tl.zeros([BLOCK_T], dtype=tl.int32)
    for c in range(OFF_CHUNKS):
        err_c, f_kv, e_kv, f_q, e_q = _read_offsets_jit(
            cu_q_ptr, cu_kv_ptr, pad_q_ptr, pad_kv_ptr, c, nseq, rows_q, rows_kv, window_left,
            window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR, SEARCH, HAS_Q,
            PAD_Q_BIT, PAD_KV_BIT, OFF_BLOCK,
        )  # fmt: skip
        err = err | err_c
        if not SEARCH:
            first = tl.where(is_kv, f_kv, f_q)
            end = tl.where(is_kv, e_kv, e_q)
            reach = _reach_jit(first, end, row0, reach, BLOCK_T, OFF_CHUNKS > 1)
    return _or_bits_jit(err), reach


def _postpass_kernel(
    dq_ptr,
    dk_ptr,
    dv_ptr,
    cu_q_ptr,
    cu_kv_ptr,
    pad_q_ptr,
    pad_kv_ptr,
    err_ptr,
    nseq,
    rows_q,
    rows_kv,
    nblk_kv,
    nblk_q,
    units_kv,
    n_units,
    split_kv,
    split_q,
    n_iter,
    h_q,
    d_q,
    sq_t,
    sq_h,
    sq_d,
    h_k,
    d_k,
    sk_t,
    sk_h,
    sk_d,
    h_v,
    d_v,
    sv_t,
    sv_h,
    sv_d,
    window_left,
    window_right,
    EXACT: tl.constexpr,
    TOP_LEFT: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr,
    HAS_WR: tl.constexpr,
    SEARCH: tl.constexpr,
    N_ITER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BD_Q: tl.constexpr,
    BD_K: tl.constexpr,
    BD_V: tl.constexpr,
    NT_Q: tl.constexpr,
    NT_K: tl.constexpr,
    NT_V: tl.constexpr,
    HAS_Q: tl.constexpr,
    PAD_Q_BIT: tl.constexpr,
    PAD_KV_BIT: tl.constexpr,
    OFF_BLOCK: tl.constexpr,
    OFF_CHUNKS: tl.constexpr,
    ONCE: tl.constexpr,
):
    # Units: u < units_kv are dK/dV (row block u % nblk_kv, column share u // nblk_kv of
    # split_kv), the rest dQ likewise (nblk_q, split_q). Program pid takes units pid,
    # pid + n_prog, ... (n_iter of them at most).
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    rel = tl.arange(0, BLOCK_T)
    if ONCE:
        # The offsets fit one chunk and no search: read and check them once per program,
        # not once per row block (each read is a round trip to memory before any store).
        err0, f_kv, e_kv, f_q, e_q = _read_offsets_jit(
            cu_q_ptr, cu_kv_ptr, pad_q_ptr, pad_kv_ptr, 0, nseq, rows_q, rows_kv, window_left,
            window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR, SEARCH, HAS_Q,
            PAD_Q_BIT, PAD_KV_BIT, OFF_BLOCK,
        )  # fmt: skip
        bad = _or_bits_jit(err0)
    for it in range(n_iter):
        u = pid + it * n_prog
        if u < n_units:
            is_kv = u < units_kv
            v = tl.where(is_kv, u, u - units_kv)
            nblk = tl.where(is_kv, nblk_kv, nblk_q)
            n_split = tl.where(is_kv, split_kv, split_q)
            split = v // nblk
            blk = v - split * nblk
            row0 = blk.to(tl.int64) * BLOCK_T
            n_rows = tl.where(is_kv, rows_kv, rows_q)
            if ONCE:
                reach = _reach_jit(
                    tl.where(is_kv, f_kv, f_q), tl.where(is_kv, e_kv, e_q), row0,
                    tl.zeros([BLOCK_T], dtype=tl.int32), BLOCK_T, False,
                )  # fmt: skip
            else:
                bad, reach = _scan_offsets_jit(
                    cu_q_ptr, cu_kv_ptr, pad_q_ptr, pad_kv_ptr, nseq, rows_q, rows_kv, row0,
                    is_kv, window_left, window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL,
                    HAS_WR, SEARCH, HAS_Q, PAD_Q_BIT, PAD_KV_BIT, BLOCK_T, OFF_BLOCK, OFF_CHUNKS,
                )  # fmt: skip
            # Impossible offsets: every program zeroes nothing; unit 0 records which
            # argument into the pinned host word err_ptr (te_gqa_fix.offset_errors).
            if (bad != 0) & (u == 0):
                tl.store(err_ptr, tl.load(err_ptr) | bad)
            rows = row0 + rel.to(tl.int64)
            in_buf = rows < n_rows
            if SEARCH:
                # Many sequences: a compare against every sequence would cost BLOCK_T x
                # nseq per row block; a binary search per row costs N_ITER dependent
                # (cached) loads.
                if is_kv:
                    kept = _search_kept_jit(
                        pad_kv_ptr, cu_q_ptr, cu_kv_ptr, rows, in_buf, nseq, window_left,
                        window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR, True,
                        N_ITER,
                    )  # fmt: skip
                else:
                    kept = _search_kept_jit(
                        pad_q_ptr, cu_q_ptr, cu_kv_ptr, rows, in_buf, nseq, window_left,
                        window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR, False,
                        N_ITER,
                    )  # fmt: skip
            else:
                kept = reach > rel
            ok = (tl.zeros_like(rel) + bad) == 0  # per lane, so masks stay boolean vectors
            dead = in_buf & (kept == 0) & ok
            if tl.sum(dead.to(tl.int32), axis=0) > 0:
                if is_kv:
                    _zero_tiles_jit(
                        dk_ptr, rows, dead, h_k, d_k, sk_t, sk_h, sk_d, split, n_split,
                        NT_K, BLOCK_T, BLOCK_C, BD_K,
                    )  # fmt: skip
                    _zero_tiles_jit(
                        dv_ptr, rows, dead, h_v, d_v, sv_t, sv_h, sv_d, split, n_split,
                        NT_V, BLOCK_T, BLOCK_C, BD_V,
                    )  # fmt: skip
                else:
                    _zero_tiles_jit(
                        dq_ptr, rows, dead, h_q, d_q, sq_t, sq_h, sq_d, split, n_split,
                        NT_Q, BLOCK_T, BLOCK_C, BD_Q,
                    )  # fmt: skip


# --------------------------------------------------------------------------- host


def _build() -> Any:
    """Import Triton and turn the functions above into (compiled or interpreted) kernels."""
    global tl, _key_bounds_jit, _seq_index_jit, _search_kept_jit, _zero_tiles_jit
    global _scan_offsets_jit, _read_offsets_jit, _reach_jit, _or_bits_jit, _kernel
    if _kernel is None:
        import triton
        import triton.language as triton_language

        tl = triton_language
        _key_bounds_jit = triton.jit(_key_bounds)
        _seq_index_jit = triton.jit(_seq_index)
        _search_kept_jit = triton.jit(_search_kept)
        _zero_tiles_jit = triton.jit(_zero_tiles)
        _read_offsets_jit = triton.jit(_read_offsets)
        _reach_jit = triton.jit(_reach)
        _or_bits_jit = triton.jit(_or_bits)
        _scan_offsets_jit = triton.jit(_scan_offsets)
        _kernel = triton.jit(_postpass_kernel)
    return _kernel


def available() -> bool:
    """True when Triton imports and a CUDA device is present (computed once, cached).

    Imports Triton on the first call only; never at package import.
    """
    global _available
    if _available is None:
        ok = False
        try:
            if torch.cuda.is_available():
                import triton.language  # noqa: F401

                ok = True
        except Exception as exc:  # ImportError, or a broken install raising anything else
            log_once(
                ("triton-import",),
                logging.INFO,
                "te_gqa_fix: Triton unavailable (%s); using the PyTorch post-pass",
                exc,
            )
        _available = ok
    return _available and not _broken


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _why_unsupported(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    offsets: Tuple[Optional[torch.Tensor], ...],
    require_cuda: bool,
) -> Optional[str]:
    """None when the kernel handles these arguments, else why not (metadata only).

    Runs on every call, so it is written for the common case (a few C-level checks).
    """
    device = dk.device
    if require_cuda and device.type != "cuda":
        return f"device {device}"
    for t in (dk, dv) if dq is None else (dq, dk, dv):
        if type(t) not in _PLAIN:
            return f"{type(t).__name__} (not a plain torch.Tensor)"
        if t.dim() != 3:
            return f"a {t.dim()}-D gradient tensor"
        if t.dtype not in _HANDLED_DTYPES:
            return f"dtype {t.dtype}"
        if t.device != device:
            return "tensors on different devices"
        if 0 in t.stride() and any(n > 1 and st == 0 for n, st in zip(t.shape, t.stride())):
            return "an expanded (zero-stride) tensor"
    for o in offsets:
        if o is None:
            continue
        if type(o) not in _PLAIN or o.dim() != 1 or o.dtype not in _OFFSET_DTYPES:
            return "offsets that are not 1-D int32/int64 tensors"
        if o.device != device:
            return "offsets on another device"
    return None


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _sm_counts.get(index)
    if count is None:
        count = int(torch.cuda.get_device_properties(index).multi_processor_count)
        _sm_counts[index] = count
    return count


def _contig(o: torch.Tensor) -> torch.Tensor:
    # TE's offsets are contiguous; a strided view gets a tiny device copy (no sync).
    return o if o.is_contiguous() else o.contiguous()


class _LaunchPlan:
    """Everything one launch needs that depends only on metadata, resolved once.

    ``compiled`` maps the pointers' 16-byte alignment (the one per-call property Triton
    specializes a pointer on; dtypes and every integer argument are fixed by the plan's
    key) to the kernel Triton compiled for it, captured from the first normal launch.
    ``tail`` is every argument after the tensors, constexprs included, in the kernel's
    parameter order: what Triton's own launcher is handed.
    """

    __slots__ = (
        "c", "compiled", "device_index", "err", "err_ptr", "fast", "grid", "meta", "scalars",
        "tail", "words",
    )  # fmt: skip

    def __init__(
        self,
        grid: Tuple[int, int],
        scalars: tuple,
        meta: Dict[str, Any],
        device_index: int,
        err: torch.Tensor,
        words: Any,
    ) -> None:
        self.grid = grid
        self.scalars = scalars
        self.meta = meta
        self.tail: Optional[tuple] = None
        self.compiled: Dict[object, Any] = {}
        #: ``(call, function, head, error word + tail)`` (see :func:`_launcher_call`) of
        #: the kernel compiled for all pointers 16-byte aligned (the usual case), once
        #: captured: the whole direct launch in one tuple, so the common call reads no dict.
        self.fast: Optional[tuple] = None
        #: The same kernel's launch record for the C launch (te_gqa_fix.c_launch), where
        #: it serves this kernel: then the direct launch is one C call.
        self.c: Optional[bytes] = None
        self.device_index = device_index
        #: The device's pinned error word (te_gqa_fix.offset_errors), the kernel's 8th
        #: pointer: the same memory for every call on that device.
        self.err = err
        self.err_ptr = err.data_ptr()
        #: Both host words of that record (kernel's and PyTorch path's), read per call.
        self.words = words


#: Launch plans by tensor metadata (shapes, strides, batch size, mask): the host work
#: between two calls with the same layout is then a dict lookup. Bounded; cleared when full.
_launch_plans: Dict[tuple, _LaunchPlan] = {}
_MAX_PLANS = 256


def _launch_plan(
    q_t: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    has_q: bool,
    nseq: int,
    span: KeySpan,
    offset_dtypes: tuple,
    padded_given: Tuple[bool, bool] = (True, True),
) -> _LaunchPlan:
    """Grid, scalar and constexpr arguments for one launch, cached.

    The key holds everything Triton specializes the compiled kernel on except the
    pointers' alignment (dtypes of all seven tensors, every integer argument through the
    shapes and strides), so a plan's compiled kernels are valid for every call it serves.
    """
    key = (
        q_t.shape, q_t.stride(), q_t.dtype, dk.shape, dk.stride(), dk.dtype, dv.shape,
        dv.stride(), dv.dtype, has_q, nseq, span, dk.device, offset_dtypes, BLOCK_T,
        BLOCK_C, _PROGRAMS_PER_SM, _NUM_WARPS, _MAX_TILES, _COMPARE_MAX_OFFSETS, _RESIDENT_PER_SM,
        padded_given,
    )  # fmt: skip
    plan = _launch_plans.get(key)
    if plan is not None:
        return plan
    plan = _make_launch_plan(q_t, dk, dv, has_q, nseq, span, padded_given)
    if len(_launch_plans) >= _MAX_PLANS:
        _launch_plans.clear()
    _launch_plans[key] = plan
    return plan


def _make_launch_plan(
    q_t: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    has_q: bool,
    nseq: int,
    span: KeySpan,
    padded_given: Tuple[bool, bool],
) -> _LaunchPlan:
    rows_kv = int(dk.shape[0])
    rows_q = int(q_t.shape[0]) if has_q else 0
    nblk_kv = -(-rows_kv // BLOCK_T)
    nblk_q = -(-rows_q // BLOCK_T)
    # Columns: flattened (head, dim padded to a power of two), in tiles of block_c.
    widths = [int(t.shape[1]) * _next_pow2(int(t.shape[2])) for t in (q_t, dk, dv)]
    block_c = max(1, min(BLOCK_C, _next_pow2(max(widths))))
    tiles = [-(-w // block_c) for w in widths]
    # Each side's column tiles are split into shares (one unit = a row block and a share)
    # when the row blocks alone would give fewer than _PROGRAMS_PER_SM units per SM, and
    # so that a unit stores at most _MAX_TILES tiles per tensor. Per side: MQA's one-head
    # dK/dV rows are one tile, and shares of them would be empty units.
    fill = -(-_PROGRAMS_PER_SM * _sm_count(dk.device) // max(1, nblk_kv + nblk_q))

    def shares(n_tiles: int) -> int:
        n = max(1, min(n_tiles, fill))
        if _MAX_TILES > 0:
            n = max(n, -(-n_tiles // _MAX_TILES))
        return n

    split_kv = shares(max(tiles[1], tiles[2]))
    split_q = shares(tiles[0]) if has_q else 1
    nt_q = -(-tiles[0] // split_q)
    nt_k, nt_v = (-(-n // split_kv) for n in tiles[1:])
    # Units over a grid of at most _RESIDENT_PER_SM programs per SM, each looping over
    # its units: the offsets are read once per program, not once per unit.
    units_kv = nblk_kv * split_kv
    units = units_kv + nblk_q * split_q
    n_prog = min(units, max(1, _RESIDENT_PER_SM * _sm_count(dk.device)))
    n_iter = -(-units // n_prog) if n_prog else 0
    exact = bool(span.exact)
    search = nseq + 1 > _COMPARE_MAX_OFFSETS
    has_wl = exact and span.window_left >= 0
    has_wr = exact and span.window_right >= 0
    scalars = (
        nseq, rows_q, rows_kv, nblk_kv, nblk_q, units_kv, units, split_kv, split_q, n_iter,
        int(q_t.shape[1]), int(q_t.shape[2]), *q_t.stride(),
        int(dk.shape[1]), int(dk.shape[2]), *dk.stride(),
        int(dv.shape[1]), int(dv.shape[2]), *dv.stride(),
        int(span.window_left) if has_wl else 0,
        int(span.window_right) if has_wr else 0,
    )  # fmt: skip
    meta: Dict[str, Any] = dict(
        EXACT=exact,
        TOP_LEFT=bool(span.top_left),
        BOTTOM_RIGHT=bool(span.bottom_right),
        HAS_WL=has_wl,
        HAS_WR=has_wr,
        SEARCH=search,
        N_ITER=(nseq + 1).bit_length() if search else 0,
        BLOCK_T=BLOCK_T,
        BLOCK_C=block_c,
        BD_Q=_next_pow2(int(q_t.shape[2])),
        BD_K=_next_pow2(int(dk.shape[2])),
        BD_V=_next_pow2(int(dv.shape[2])),
        NT_Q=nt_q if has_q else 0,
        NT_K=nt_k,
        NT_V=nt_v,
    )
    # Impossible-offset check (issue #13): five more constexprs and the error word.
    meta.update(offset_errors.kernel_meta(nseq, has_q, *padded_given))
    meta["ONCE"] = not search and meta["OFF_CHUNKS"] == 1
    cuda = dk.device.type == "cuda"
    if cuda:
        meta["num_warps"] = _NUM_WARPS
    index = dk.device.index if cuda and dk.device.index is not None else -1
    if cuda and index < 0:
        index = torch.cuda.current_device()
    err = offset_errors.kernel_flag(dk.device)
    words = offset_errors.pending_words(dk.device)
    return _LaunchPlan((n_prog, 1), scalars, meta, index, err, words)


# ----------------------------------------------------------------- the fast launch
# Triton's ``kernel[grid](...)`` binds and specializes every argument and builds a cache
# key string on every call (20-40 us of Python). The plan fixes all of that except the
# pointers' alignment, so the compiled kernel is launched directly through the launcher
# Triton itself calls (``CompiledKernel.run``), the way ``JITFunction.run`` does.

_fast_ok = True  # cleared (and logged once) when the direct launch ever fails
_runtime_knobs: Any = None
#: te_gqa_fix.c_launch's ``launch(record, *tensors)`` and ``lane(state, args, kwargs)``
#: (the wrapper's whole fast lane, TE's call and ``serve`` included), once loaded.
_c_launch: Any = None
_c_lane: Any = None


def _load_c_launch() -> Any:
    """The C launch (:mod:`te_gqa_fix.c_launch`), set up with torch's current device
    and stream calls and Triton's launch hooks; None where it cannot be had."""
    global _c_launch, _c_lane
    if _c_launch is None:
        get_device = getattr(torch._C, "_cuda_getDevice", None)
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if get_device is None or raw_stream is None:  # a torch without CUDA
            return None
        module = c_launch.load("libcuda.so.1", get_device, raw_stream, _runtime_knobs, _PLAIN)
        if module is not None:
            _c_launch, _c_lane = module.launch, module.lane
    return _c_launch


def _raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as Triton gets it (a C call, no sync)."""
    return torch._C._cuda_getCurrentRawStream(index)


def _current_device() -> int:
    """The current CUDA device (a C call; ``torch.cuda.current_device`` adds Python)."""
    return torch._C._cuda_getDevice()


def _hooks_clear() -> bool:
    """No launch hooks (profilers): the direct launch may skip them. Else use Triton's path.

    A hook is None, or (Triton 3.6) a chain whose ``calls`` list is empty when unused.
    """
    knobs = _runtime_knobs
    if knobs is None:
        return False
    hook = knobs.launch_enter_hook
    if hook is not None and getattr(hook, "calls", True):
        return False
    hook = knobs.launch_exit_hook
    return hook is None or not getattr(hook, "calls", True)


def _capture(plan: _LaunchPlan, align: object, ret: Any, kernel: Any, n_tensors: int) -> None:
    """Keep what ``kernel[grid](...)`` returned when it is a compiled kernel we can relaunch.

    Triton 3.x returns the ``CompiledKernel`` it launched; the interpreter returns None.
    The direct launch needs every argument in the kernel's parameter order: the tail is
    rebuilt by name, and a signature we do not recognise disables the fast path.
    """
    global _runtime_knobs
    if ret is None or not all(hasattr(ret, a) for a in ("run", "function", "packed_metadata")):
        return
    if plan.tail is None:
        names = list(getattr(kernel, "arg_names", ()))
        n_scalar = n_tensors + len(plan.scalars)
        consts = {k: v for k, v in plan.meta.items() if k in names}
        if len(names) != n_scalar + len(consts) or set(names[n_scalar:]) != set(consts):
            log_once(
                ("triton-fast-signature",),
                logging.DEBUG,
                "te_gqa_fix: kernel parameters %s do not match the launch plan; "
                "using Triton's launch path",
                names,
            )
            return
        plan.tail = plan.scalars + tuple(consts[n] for n in names[n_scalar:])
    if _runtime_knobs is None:
        try:
            from triton import knobs

            _runtime_knobs = knobs.runtime
        except Exception:  # Triton without knobs (< 3.4): keep its own launch path
            return
    call, head = _launcher_call(ret.run, ret.packed_metadata)  # run: loads the module
    plan.compiled[align] = (call, ret.function, head)
    if align == 0:
        err = _device_address(plan.err)
        plan.fast = (call, ret.function, head, (err, *plan.tail))
        if call is not ret.run and _load_c_launch() is not None:
            # The release's launcher was read (see _launcher_call): launch from C.
            args = (0,) * c_launch.N_TENSORS + (err, *plan.tail)
            words = ctypes.addressof(plan.words)
            plan.c = c_launch.record(ret, args, (*plan.grid, 1), plan.device_index, words)


#: Triton releases whose ``CudaLauncher`` is read below (3.5.0, 3.5.1, 3.6.0: the same
#: ``__call__`` and C ``launch`` arguments). Other releases keep ``CompiledKernel.run``.
_C_LAUNCH_RELEASES = ("3.5.", "3.6.")


def _triton_version() -> str:
    import triton

    return str(getattr(triton, "__version__", ""))


def _launcher_call(run: Any, packed: Any) -> Tuple[Any, tuple]:
    """What the direct launch calls, and the arguments between the kernel's function
    handle and its parameters.

    By default ``CompiledKernel.run``, handed ``(packed metadata, launch metadata, enter
    hook, exit hook)``, as ``CompiledKernel.__getitem__`` does. Where Triton is a release
    of :data:`_C_LAUNCH_RELEASES`, ``run`` is a ``CudaLauncher`` whose Python
    ``__call__`` only allocates scratch buffers (none when the kernel declares none)
    and forwards to the compiled C ``launch`` with two flags and the two scratch
    pointers in front: 0.6-1.1 us of Python per call (benchmarks/host_cpu.py) on a path
    budgeted in microseconds. Then the C ``launch`` is called directly with what
    ``__call__`` would have passed. Anything else keeps ``run``: a kernel that needs
    scratch, a launch wrapped for tensor descriptors (a Python function), another
    release, whose arguments may differ (3.7 replaced the launcher).
    """
    default = (run, (packed, None, None, None))
    try:
        if type(run).__name__ != "CudaLauncher":
            return default
        if not _triton_version().startswith(_C_LAUNCH_RELEASES):
            return default
        launch = run.launch
        if isinstance(launch, types.FunctionType) or not callable(launch):
            return default
        if run.global_scratch_size > 0 or run.profile_scratch_size > 0:
            return default
        flags = (run.launch_cooperative_grid, run.launch_pdl)
    except Exception:  # an attribute this release does not have: keep run
        return default
    return launch, (*flags, None, None, packed, None, None, None)


_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
_libcuda: Any = None


def _device_address(err: torch.Tensor) -> Any:
    """The pinned error word's device address as an int, else ``err`` itself.

    Why: for a tensor argument Triton's launcher calls ``data_ptr()`` and then asks the
    driver for the device address (``cuPointerGetAttribute(...DEVICE_POINTER)``) on every
    launch. The word is the same pinned memory for the process's lifetime (the plan
    holds it), so the direct launch asks the driver the same question once, here, and
    hands the launcher the answer as an int, as it does for the other seven pointers.
    Where the driver cannot be asked (no libcuda: tests, the interpreter) the tensor is
    passed as before.
    """
    global _libcuda
    try:
        if _libcuda is None:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        address = ctypes.c_uint64(0)
        status = _libcuda.cuPointerGetAttribute(
            ctypes.byref(address),
            ctypes.c_int(_CU_POINTER_ATTRIBUTE_DEVICE_POINTER),
            ctypes.c_uint64(err.data_ptr()),
        )
    except Exception:  # OSError (no driver), AttributeError: keep the tensor
        return err
    return address.value if status == 0 and address.value else err


def _run(plan: _LaunchPlan, tensors: tuple) -> None:
    """Launch the kernel for ``plan`` on ``tensors`` (dq-or-stand-in, dk, dv, 4 offsets);
    the plan's error word is the eighth pointer.

    The common case first, in as few steps as possible: every pointer 16-byte aligned,
    the kernel for that captured (``plan.fast``), no launch hooks, the plan's device
    current; launched from C where the plan has a record for it (``plan.c``,
    :mod:`te_gqa_fix.c_launch`, which checks the same), else through Triton's C launcher.
    Everything else goes through :func:`_run_general`.
    """
    fast = plan.fast
    if fast is not None and _fast_ok:
        c = plan.c
        if c is not None:
            try:
                if _c_launch(c, *tensors):
                    return
            except Exception as exc:
                _fast_failed(exc)
            _run_general(plan, tensors)  # declined: Triton's path decides
            return
        q_t, dk, dv, cu_q, cu_kv, pad_q, pad_kv = tensors
        p0, p1, p2 = q_t.data_ptr(), dk.data_ptr(), dv.data_ptr()
        p3, p4, p5, p6 = cu_q.data_ptr(), cu_kv.data_ptr(), pad_q.data_ptr(), pad_kv.data_ptr()
        index = plan.device_index
        if (
            (p0 | p1 | p2 | p3 | p4 | p5 | p6) & 15 == 0
            and _hooks_clear()
            and (_current_device() == index)
        ):
            call, function, head, tail = fast
            g0, g1 = plan.grid
            try:
                call(g0, g1, 1, _raw_stream(index), function, *head,
                     p0, p1, p2, p3, p4, p5, p6, *tail)  # fmt: skip
                return
            except Exception as exc:
                _fast_failed(exc)
    _run_general(plan, tensors)


def _fast_failed(exc: BaseException) -> None:
    """The direct launch raised: Triton's own launch path from now on (logged once)."""
    global _fast_ok
    _fast_ok = False
    log_once(
        ("triton-fast-failed",),
        logging.WARNING,
        "te_gqa_fix: direct Triton launch failed (%r); using Triton's launch path from now on",
        exc,
    )


def _run_general(plan: _LaunchPlan, tensors: tuple) -> None:
    """:func:`_run` for every case: any pointer alignment, launch hooks, another current
    device, the first launch of a plan (Triton compiles, and its kernel is captured).

    The direct launch hands Triton's launcher the seven tensors' pointers as integers:
    the launcher takes an int as the device address as it is, where for a tensor it calls
    ``data_ptr()`` and asks the driver (``cuPointerGetAttribute``) about every pointer,
    a driver call per argument per launch. The pointers were read here anyway (the
    alignment key), and every one of these tensors is device memory on the plan's CUDA
    device (the plan's key), whose address is its device address. The error word stays
    a tensor: it is pinned host memory, whose device address the driver gives (the same
    value only under unified addressing with ``cudaHostAlloc``).
    """
    g0, g1 = plan.grid
    if g0 == 0:
        return
    index = plan.device_index
    align: object = ()
    if index >= 0:
        q_t, dk, dv, cu_q, cu_kv, pad_q, pad_kv = tensors
        ptrs = (
            q_t.data_ptr(), dk.data_ptr(), dv.data_ptr(), cu_q.data_ptr(), cu_kv.data_ptr(),
            pad_q.data_ptr(), pad_kv.data_ptr(),
        )  # fmt: skip
        p0, p1, p2, p3, p4, p5, p6 = ptrs
        # All 16-byte aligned (the usual case) is one key; otherwise one flag per pointer.
        if (p0 | p1 | p2 | p3 | p4 | p5 | p6 | plan.err_ptr) & 15 == 0:
            align = 0
        else:
            align = tuple(p & 15 == 0 for p in (*ptrs, plan.err_ptr))
        entry = plan.compiled.get(align)
        if entry is not None and _fast_ok and _hooks_clear() and _current_device() == index:
            try:
                call, function, head = entry
                call(g0, g1, 1, _raw_stream(index), function, *head,
                     *ptrs, plan.err, *plan.tail)  # fmt: skip
                return
            except Exception as exc:  # never leave rows unzeroed: Triton's path below
                _fast_failed(exc)
    tensors = (*tensors, plan.err)
    kernel = _build()
    if index >= 0 and _current_device() != index:
        with torch.cuda.device(index):  # Triton launches on the current device's stream
            ret = kernel[plan.grid](*tensors, *plan.scalars, **plan.meta)
    else:
        ret = kernel[plan.grid](*tensors, *plan.scalars, **plan.meta)
    if index >= 0 and align not in plan.compiled and len(plan.compiled) < 16:
        _capture(plan, align, ret, kernel, len(tensors))


def _launch(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
    span: KeySpan,
) -> None:
    """Launch the kernel without checking Triton/CUDA availability.

    The entry point the Triton interpreter tests use (``TRITON_INTERPRET=1``, CPU
    tensors); callers must have checked the arguments with :func:`_why_unsupported`.
    """
    # With dq None its branch never runs; dk stands in so the launch has a pointer.
    q_t = dk if dq is None else dq
    tensors = _tensors(
        q_t, dk, dv, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded
    )
    dtypes = tuple(t.dtype for t in tensors[3:])
    given = (cu_seqlens_q_padded is not None, cu_seqlens_kv_padded is not None)
    plan = _launch_plan(q_t, dk, dv, dq is not None, cu_seqlens_q.numel() - 1, span, dtypes, given)
    _run(plan, tensors)


def _tensors(
    q_t: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
) -> tuple:
    """The kernel's tensor arguments, in its parameter order (offsets made contiguous)."""
    cu_q = _contig(cu_seqlens_q)
    cu_kv = _contig(cu_seqlens_kv)
    pad_q = cu_q if cu_seqlens_q_padded is None else _contig(cu_seqlens_q_padded)
    pad_kv = cu_kv if cu_seqlens_kv_padded is None else _contig(cu_seqlens_kv_padded)
    return (q_t, dk, dv, cu_q, cu_kv, pad_q, pad_kv)


class Launches:
    """Per call shape (owned by the wrapper): output metadata -> launch plan, or why not.

    The wrapper has already checked the offsets (type, dtype, rank, length, device) for
    this call shape; what changes between calls with the same inputs are the outputs,
    new tensors each call, so their shape, strides, dtype and device index form the key
    (anything but a plain tensor goes to the PyTorch post-pass before a key is built).
    """

    __slots__ = ("plans",)

    def __init__(self) -> None:
        self.plans: Dict[tuple, Any] = {}

    def direct(self, key: tuple) -> Optional[_LaunchPlan]:
        """The plan for outputs of metadata ``key`` (:func:`output_key`) once its direct
        launch is armed (the first launch compiled and captured it), else None. What the
        wrapper's fast lane keeps for a call shape."""
        plan = self.plans.get(key)
        return plan if type(plan) is _LaunchPlan and plan.fast is not None else None

    def launch(
        self,
        dq: Optional[torch.Tensor],
        dk: torch.Tensor,
        dv: torch.Tensor,
        offsets: tuple,
        span: KeySpan,
    ) -> bool:
        """Zero the dead rows with the kernel; False (nothing done) when it cannot."""
        if _broken:
            return False
        key = output_key(dq, dk, dv)
        if key is None:
            _handles(dq, dk, dv, offsets)  # says why not, once
            return False
        plan = self.plans.get(key)
        q_t = dk if dq is None else dq
        if plan is None:
            # What an earlier call recorded comes first, as on every other path.
            offset_errors.raise_pending(dk.device)
            # Once per output shape: the checks zero_dead_rows makes on its arguments
            # (dK and dV of equal rows above all: the kernel sizes both from dK).
            check_metadata(dq, dk, dv, *offsets)
            if not _handles(dq, dk, dv, offsets):
                plan = False
            else:
                dtypes = tuple(t.dtype for t in _tensors(q_t, dk, dv, *offsets)[3:])
                nseq = offsets[0].numel() - 1
                given = (offsets[2] is not None, offsets[3] is not None)
                plan = _launch_plan(q_t, dk, dv, dq is not None, nseq, span, dtypes, given)
            if len(self.plans) >= _MAX_PLANS:
                self.plans.clear()
            self.plans[key] = plan
        if plan is False:
            return False
        words = plan.words
        if words[0] | words[1]:  # bad offsets recorded by an earlier call on this device
            offset_errors.raise_pending(dk.device)
        try:
            _run(plan, _tensors(q_t, dk, dv, *offsets))
        except Exception as exc:  # compile or launch failure: never leave rows unzeroed
            _give_up(exc)
            return False
        return True


def output_key(dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor) -> Optional[tuple]:
    """What a launch plan depends on in TE's outputs: shape, strides, dtype and device
    index of each gradient (dQ's only when it is fixed). None for anything but plain
    tensors, which go to the PyTorch post-pass.

    One key for both caches that hold plans by outputs: :class:`Launches` and the
    wrapper's fast lane, which compares it with the key it recorded.
    """
    if not (type(dk) in _PLAIN and type(dv) in _PLAIN):
        return None
    if dq is None:
        return (
            None, dk.shape, dk.stride(), dk.dtype, dk.get_device(),
            dv.shape, dv.stride(), dv.dtype, dv.get_device(),
        )  # fmt: skip
    if type(dq) not in _PLAIN:
        return None
    return (
        dq.shape, dq.stride(), dq.dtype, dq.get_device(),
        dk.shape, dk.stride(), dk.dtype, dk.get_device(),
        dv.shape, dv.stride(), dv.dtype, dv.get_device(),
    )  # fmt: skip


def zero_dead_rows_triton(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    *,
    span: KeySpan,
) -> bool:
    """Zero in place the rows :func:`te_gqa_fix.postpass.dead_row_masks` marks; True if done.

    Same semantics as the PyTorch post-pass (KV row ``t`` is in sequence ``b`` when
    ``pad_kv[b] <= t < pad_kv[b + 1]`` and kept iff its position lies in ``[lo_b, hi_b)``;
    a dQ row is kept iff inside its sequence, ``pos < lq`` and ``lk > 0``; padded offsets
    None means the valid ones). Returns False, having done nothing, when Triton or CUDA
    is missing or the arguments are outside what the kernel handles; the caller then
    runs the PyTorch implementation. No host sync.
    """
    if not available():
        return False
    offsets = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    if not _handles(dq, dk, dv, offsets):
        return False
    try:
        _launch(
            dq, dk, dv, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, span
        )
    except Exception as exc:  # compile or launch failure: never leave rows unzeroed
        _give_up(exc)
        return False
    return True


def _handles(
    dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple
) -> bool:
    """Whether the kernel handles these CUDA arguments; why not is logged once (DEBUG)."""
    why = _why_unsupported(dq, dk, dv, offsets, require_cuda=True)
    if why is not None:
        log_once(
            ("triton-unsupported", why),
            logging.DEBUG,
            "te_gqa_fix: Triton post-pass does not handle %s; using the PyTorch post-pass",
            why,
        )
    return why is None


def _give_up(exc: BaseException) -> None:
    """A launch failed: the PyTorch post-pass serves every later call (logged once)."""
    global _broken
    _broken = True
    log_once(
        ("triton-failed",),
        logging.WARNING,
        "te_gqa_fix: Triton post-pass failed (%r); using the PyTorch post-pass from now on",
        exc,
    )
