"""te-gqa-fix's Triton kernels: the post-pass, and the exact fallback's row moves.

The post-pass kernel zeroes, in place, the THD rows whose true gradient is 0.
Kept rows follow :func:`te_gqa_fix.postpass.dead_row_masks`: ``_key_bounds`` restates
:func:`te_gqa_fix.masks.key_bounds` and ``_read_offsets`` restates
:func:`te_gqa_fix.checks.offset_faults` in ``tl`` (the tests hold each to its Python
statement). Impossible offsets make every program store nothing and OR the offending
arguments' bits (:data:`te_gqa_fix.checks.ARGUMENT_BITS`, passed in as constants) into a
pinned host word that :mod:`te_gqa_fix.postpass` reads without a sync. Launches are
prepared in :mod:`te_gqa_fix.postpass`.

The row-move kernel copies rows of two THD tensors between two buffers' segmentations
(:func:`te_gqa_fix.fallback._row_moves.move_rows` states the rule and launches it). Both
kernels find a row's sequence with one binary search over the buffer offsets,
``_seq_index``.

Triton is imported by :func:`build` and :func:`build_row_moves` alone.
"""

from __future__ import annotations

from typing import Any

# Set by build(); Triton resolves these globals when it compiles (or interprets) the bodies.
tl: Any = None
_key_bounds_jit: Any = None
_seq_index_jit: Any = None
_search_kept_jit: Any = None
_zero_tiles_jit: Any = None
_scan_offsets_jit: Any = None
_read_offsets_jit: Any = None
_reach_jit: Any = None
_or_jit: Any = None
_kernel: Any = None
_copy_rows_jit: Any = None
_row_moves_kernel: Any = None


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
    """Attended key interval ``[lo, hi)`` as :func:`te_gqa_fix.masks.key_bounds`."""
    zero = tl.zeros_like(lk)
    if EXACT:
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


def _seq_index(pad_ptr, rows, nseq, SEARCH_STEPS: tl.constexpr):
    """Per row, the last ``b`` with ``pad[b] <= row`` (-1 if none), by binary search in
    ``SEARCH_STEPS = (nseq + 1).bit_length()`` steps (constexpr: the interpreter needs that)."""
    lo = tl.zeros_like(rows)
    hi = tl.zeros_like(rows) + (nseq + 1)
    for _ in range(SEARCH_STEPS):
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
    SEARCH_STEPS: tl.constexpr,
):
    """Per row, whether it is kept (the ``SEARCH`` path), from its sequence's offsets."""
    seg = _seq_index_jit(pad_ptr, rows, nseq, SEARCH_STEPS)
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
    """Zero the dead rows in column tiles ``split, split + n_split, ...`` of the flattened
    ``(h, d)`` (``d`` padded to ``BLOCK_D``, a power of two; tiles past the heads masked)."""
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
    CU_Q_BIT: tl.constexpr,
    CU_KV_BIT: tl.constexpr,
    PAD_Q_BIT: tl.constexpr,
    PAD_KV_BIT: tl.constexpr,
    OFF_BLOCK: tl.constexpr,
):
    """Chunk ``c`` of the offsets, one lane each: ``(err, f_kv, e_kv, f_q, e_q)``.

    ``err`` holds the argument bits of impossible offsets (without padded offsets,
    ``PAD_*_BIT`` name the valid argument); unless ``SEARCH``, ``[f, e)`` are each
    sequence's kept rows (empty past the last one).
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
    bad_cq = (has_off & (cq0 < 0)) | (has_seg & (cq1 < cq0))
    bad_ck = (has_off & (ck0 < 0)) | (has_seg & (ck1 < ck0))
    bad_pq = (has_off & (pq0 < 0)) | (has_seg & (pq1 < pq0))
    bad_pk = (has_off & (pk0 < 0)) | (has_seg & (pk1 < pk0))
    # A segment shorter than its valid length: the two arguments disagree, name both.
    short_q = has_seg & (pq1 - pq0 < cq1 - cq0)
    short_k = has_seg & (pk1 - pk0 < ck1 - ck0)
    err = tl.where(bad_cq, CU_Q_BIT, 0) | tl.where(bad_ck, CU_KV_BIT, 0)
    err = err | tl.where(bad_pq, PAD_Q_BIT, 0) | tl.where(bad_pk, PAD_KV_BIT, 0)
    err = err | tl.where(short_q, PAD_Q_BIT | CU_Q_BIT, 0)
    err = err | tl.where(short_k, PAD_KV_BIT | CU_KV_BIT, 0)
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
    """``reach`` updated with the kept intervals ``[first, end)``: row ``row0 + i`` is kept
    iff ``reach[i] > i``, the largest clamped end over the intervals starting at or before it."""
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


def _or(a, b):
    """The combine function of an OR reduction."""
    return a | b


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
    CU_Q_BIT: tl.constexpr,
    CU_KV_BIT: tl.constexpr,
    PAD_Q_BIT: tl.constexpr,
    PAD_KV_BIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OFF_BLOCK: tl.constexpr,
    OFF_CHUNKS: tl.constexpr,
):
    """``(error bits, reach)`` for one row block from every chunk of the offsets; every
    program reaches the same verdict, so all of them zero nothing when the offsets are bad."""
    err = tl.zeros([OFF_BLOCK], dtype=tl.int32)
    reach = tl.zeros([BLOCK_T], dtype=tl.int32)
    for c in range(OFF_CHUNKS):
        err_c, f_kv, e_kv, f_q, e_q = _read_offsets_jit(
            cu_q_ptr, cu_kv_ptr, pad_q_ptr, pad_kv_ptr, c, nseq, rows_q, rows_kv, window_left,
            window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR, SEARCH, HAS_Q,
            CU_Q_BIT, CU_KV_BIT, PAD_Q_BIT, PAD_KV_BIT, OFF_BLOCK,
        )  # fmt: skip
        err = err | err_c
        if not SEARCH:
            first = tl.where(is_kv, f_kv, f_q)
            end = tl.where(is_kv, e_kv, e_q)
            reach = _reach_jit(first, end, row0, reach, BLOCK_T, OFF_CHUNKS > 1)
    return tl.reduce(err, 0, _or_jit), reach


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
    units_per_program,
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
    SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BD_Q: tl.constexpr,
    BD_K: tl.constexpr,
    BD_V: tl.constexpr,
    NT_Q: tl.constexpr,
    NT_K: tl.constexpr,
    NT_V: tl.constexpr,
    HAS_Q: tl.constexpr,
    CU_Q_BIT: tl.constexpr,
    CU_KV_BIT: tl.constexpr,
    PAD_Q_BIT: tl.constexpr,
    PAD_KV_BIT: tl.constexpr,
    OFF_BLOCK: tl.constexpr,
    OFF_CHUNKS: tl.constexpr,
    ONCE: tl.constexpr,
):
    # Units: u < units_kv are dK/dV (row block u % nblk_kv, column share u // nblk_kv of
    # split_kv), the rest dQ likewise (nblk_q, split_q). Program pid takes units pid,
    # pid + n_prog, ... (units_per_program of them at most).
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    rel = tl.arange(0, BLOCK_T)
    if ONCE:
        # One chunk, no search: read the offsets once per program, not per row block.
        err0, f_kv, e_kv, f_q, e_q = _read_offsets_jit(
            cu_q_ptr, cu_kv_ptr, pad_q_ptr, pad_kv_ptr, 0, nseq, rows_q, rows_kv, window_left,
            window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR, SEARCH, HAS_Q,
            CU_Q_BIT, CU_KV_BIT, PAD_Q_BIT, PAD_KV_BIT, OFF_BLOCK,
        )  # fmt: skip
        bad = tl.reduce(err0, 0, _or_jit)
    for it in range(units_per_program):
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
                    HAS_WR, SEARCH, HAS_Q, CU_Q_BIT, CU_KV_BIT, PAD_Q_BIT, PAD_KV_BIT, BLOCK_T,
                    OFF_BLOCK, OFF_CHUNKS,
                )  # fmt: skip
            # Impossible offsets: every program zeroes nothing; unit 0 records which
            # argument into the pinned host word err_ptr (te_gqa_fix.postpass's error record).
            if (bad != 0) & (u == 0):
                tl.store(err_ptr, tl.load(err_ptr) | bad)
            rows = row0 + rel.to(tl.int64)
            in_buf = rows < n_rows
            if SEARCH:
                # Many sequences: a binary search per row, not a compare with every sequence.
                if is_kv:
                    kept = _search_kept_jit(
                        pad_kv_ptr, cu_q_ptr, cu_kv_ptr, rows, in_buf, nseq, window_left,
                        window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR, True,
                        SEARCH_STEPS,
                    )  # fmt: skip
                else:
                    kept = _search_kept_jit(
                        pad_q_ptr, cu_q_ptr, cu_kv_ptr, rows, in_buf, nseq, window_left,
                        window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR, False,
                        SEARCH_STEPS,
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


def build() -> Any:
    """Import Triton and return the post-pass kernel; raises ImportError without Triton."""
    global tl, _key_bounds_jit, _seq_index_jit, _search_kept_jit, _zero_tiles_jit
    global _scan_offsets_jit, _read_offsets_jit, _reach_jit, _or_jit, _kernel
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
        _or_jit = triton.jit(_or)
        _scan_offsets_jit = triton.jit(_scan_offsets)
        _kernel = triton.jit(_postpass_kernel)
    return _kernel


def _copy_rows(
    src, dst, source, target, live, in_rows, dim, width, s_row, s_head, d_row, d_head,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Row ``source[i]`` of ``src`` into row ``target[i]`` of ``dst`` where ``live[i]``, 0
    elsewhere in ``in_rows``; a row is ``width`` elements of heads x ``dim``, unit last stride."""
    for c in range(0, width, BLOCK_W):
        cols = c + tl.arange(0, BLOCK_W)
        in_cols = (cols < width)[None, :]
        off = (cols // dim) * s_head + cols % dim
        val = tl.load(
            src + source[:, None] * s_row + off[None, :], mask=live[:, None] & in_cols, other=0.0
        )
        off = (cols // dim) * d_head + cols % dim
        tl.store(dst + target[:, None] * d_row + off[None, :], val, mask=in_rows[:, None] & in_cols)


def _move_rows_kernel(
    src_a, src_b, dst_a, dst_b, cu_dst, pad_dst, cu_src, pad_src,
    nseq, rows_dst, rows_src, dim_a, dim_b, width_a, width_b,
    sa_row, sa_head, sb_row, sb_head, da_row, da_head, db_row, db_head,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    """:func:`move_rows` for one block of destination rows, two tensors at once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    # The last sequence b with pad_dst[b] <= row (-1 if none), among the nseq starts.
    found = _seq_index_jit(pad_dst, rows, nseq - 1, SEARCH_STEPS)
    seq = tl.maximum(found, 0)
    pos = rows - tl.load(pad_dst + seq)
    n = tl.minimum(
        tl.load(cu_dst + seq + 1) - tl.load(cu_dst + seq),
        tl.load(cu_src + seq + 1) - tl.load(cu_src + seq),
    )
    in_rows = rows < rows_dst
    live = in_rows & (found >= 0) & (pos >= 0) & (pos < n) & (tl.zeros_like(rows) + rows_src > 0)
    source = tl.minimum(tl.maximum(tl.load(pad_src + seq) + pos, 0), rows_src - 1).to(tl.int64)
    target = rows.to(tl.int64)
    _copy_rows_jit(
        src_a, dst_a, source, target, live, in_rows, dim_a, width_a, sa_row, sa_head, da_row,
        da_head, BLOCK_W,
    )  # fmt: skip
    _copy_rows_jit(
        src_b, dst_b, source, target, live, in_rows, dim_b, width_b, sb_row, sb_head, db_row,
        db_head, BLOCK_W,
    )  # fmt: skip


def build_row_moves() -> Any:
    """Import Triton and return the row-move kernel; raises ImportError without Triton."""
    global _copy_rows_jit, _row_moves_kernel
    if _row_moves_kernel is None:
        import triton

        build()  # tl and the shared binary search
        _copy_rows_jit = triton.jit(_copy_rows)
        _row_moves_kernel = triton.jit(_move_rows_kernel)
    return _row_moves_kernel
