"""An exact replacement for TE's ``fused_attn_bwd`` on packed THD input, on FlashAttention-2.

Where cuDNN's backward is wrong on rows that receive attention (on Hopper, the head dims
:mod:`te_gqa_fix.rules` lists per cuDNN build, such as 256 on 9.14 and q/k 256 with v 128 on
9.19) no post-pass can repair it. PyTorch's own FlashAttention-2 varlen backward computes
the same gradients from TE's forward output and softmax statistics, with the offsets kept
on the device: no host sync, CUDA-graph safe.

An optional layer: the wrapper imports it at the first call that needs it. A call shape is
decided once (:func:`decide`: a :class:`Recipe`, or why not); :func:`run` then does the work
for every call of that shape. The split's row moves live in :mod:`._row_moves`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .. import checks
from .._logging import log_once
from .._te import MASKS, PACKED, THD_LAYOUTS, THD_MASKS, FallbackArgs, release
from ..masks import window_pair
from ._row_moves import move_rows

__all__ = ["Recipe", "coverage", "decide", "exact_backward", "head_dim_reason", "run"]

# FlashAttention-2's entry points (the CPU tests put an emulation here).
_aten = torch.ops.aten

_TE_DTYPES = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16"}
# FlashAttention-2's backward reads torch's deterministic mode from this release on.
_DETERMINISTIC_TORCH = (2, 5)


def coverage() -> Tuple[str, ...]:
    """What the fallback reproduces exactly and what it declines, one line each."""
    return (
        "exact: THD, fp16/bf16, MHA/GQA/MQA, head dims up to 256 (v's at most q/k's), padded "
        "offsets, sequences without queries or keys; padding, causal (top-left or bottom-right) "
        "and bottom-right windows; top-left windows when q and kv share one offsets tensor "
        "(top-left causal across two: a query past its sequence's last key whose logsumexp is "
        "below -88 gets NaN in dQ); deterministic=True bitwise repeatable",
        "declined: dropout, bias, non-vanilla softmax, FP8, non-THD, contradictory causal "
        "arguments; needs CUDA sm80+ (a declined call raises under TE_GQA_FIX_GUARD=fallback)",
    )


# --------------------------------------------------------------------------- the decision
class Recipe(NamedTuple):
    """How :func:`run` computes one call shape.

    Attributes:
        window: FlashAttention-2's (bottom-right aligned) window.
        split: top-left causal across two offsets tensors (one call on keys moved to q's
            rows with TE's statistics, or two calls after a forward without them).
        reuse_stats: TE's softmax statistics are ``[t >= rows_q, h, 1]`` float32 and TE's
            output has q's rows and v's head dim: they replace a forward recompute.
        layout: the gradients' layout.
        deterministic: bitwise repeatable (torch's deterministic FlashAttention-2 backward).
        one_segmentation: q and kv rows are segmented alike (one offsets tensor each way, as
            many rows), so FlashAttention-2 gets one offsets tensor for both.
        back_to_back: q's, kv's sequences lie back to back (no padded offsets, or the valid
            ones, as DotProductAttention passes them without padding), so the valid offsets
            are the segments.
    """

    window: Tuple[int, int]
    split: bool
    reuse_stats: bool
    layout: str
    deterministic: bool
    one_segmentation: bool
    back_to_back: Tuple[bool, bool]


def _same_memory(a: object, b: object) -> bool:
    if a is b:
        return True
    return (
        type(a) is torch.Tensor
        and type(b) is torch.Tensor
        and a.data_ptr() == b.data_ptr()  # type: ignore[union-attr]
        and a.shape == b.shape  # type: ignore[union-attr]
        and a.stride() == b.stride()  # type: ignore[union-attr]
    )


def _plain(t: object) -> bool:
    return type(t) is torch.Tensor


def _mask_reason(
    a: FallbackArgs, has_right_bound: bool
) -> Union[str, Tuple[Tuple[int, int], bool]]:
    """FlashAttention-2's window for TE's mask and whether it is top-left causal across two
    offsets tensors (:attr:`Recipe.split`), or why FlashAttention-2 cannot reproduce it."""
    name = "padding" if a.attn_mask_type is None else a.attn_mask_type
    if name not in THD_MASKS:
        return f"attn_mask_type={name!r} (THD takes {', '.join(THD_MASKS)})"
    causal, bottom_right = MASKS[name]
    window = tuple(a.window_size) if type(a.window_size) is list else a.window_size
    pair = window_pair(window)  # type: ignore[arg-type]
    if pair is None:
        return f"window_size={window!r} is not two integers from -1 to 2**31 - 1"
    left, right = pair
    brd = a.bottom_right_diagonal
    if brd is not None and not isinstance(brd, bool):
        return f"bottom_right_diagonal={brd!r} is not a bool or None"
    if causal and right > 0:
        return f"window_size={window!r} with causal {name!r} (right must be -1 or 0)"
    if causal and brd is not None and brd != bottom_right:
        return f"bottom_right_diagonal={brd} against {name!r}"
    if not causal and right >= 0 and not has_right_bound:
        return f"window_size={window!r} with {name!r}: TE < 2.12 sets no right bound"
    right = 0 if causal else right
    bottom_right = bottom_right if brd is None else brd
    # FlashAttention-2 aligns to the bottom right; top-left is the same where lq == lk.
    if (left, right) == (-1, -1) or bottom_right or _same_memory(a.cu_seqlens_q, a.cu_seqlens_kv):
        return (left, right), False
    if (left, right) == (-1, 0):
        return (left, right), True
    return f"top-left window_size={window!r} across two offset tensors (q, kv)"


def _tensor_reason(a: FallbackArgs) -> Optional[str]:
    """Why the tensors are not ones FlashAttention-2 takes, beyond what the input gate
    (:func:`te_gqa_fix.checks.gradients`) checked of q, k, v and the offsets already."""
    named = (("q", a.q), ("k", a.k), ("v", a.v), ("d_o", a.d_o))
    for name, t in named:
        if not _plain(t) or t.dim() != 3:
            return f"{name} is not a plain 3-D tensor (FP8 or not THD)"
    q, k, v, d_o = a.q, a.k, a.v, a.d_o
    for name, t in named[1:]:
        if t.dtype != q.dtype or t.device != q.device:
            return f"{name} differs from q in dtype or device"
    dqkv = a.dqkv_dtype
    if a.fake_dtype != q.dtype or (
        dqkv is not None and dqkv != q.dtype and str(dqkv).split(".")[-1] != _TE_DTYPES.get(q.dtype)
    ):
        return f"fake_dtype/dqkv_dtype differ from q's {q.dtype}"
    (rows_q, h_q, d), d_k, d_v = q.shape, k.shape[2], v.shape[2]
    if d_k != d or tuple(d_o.shape) != (rows_q, h_q, d_v):
        return f"head dims q {d}, k {d_k}, v {d_v}, d_o {tuple(d_o.shape)}: k's must be q's, d_o [t, h_q, d_v]"
    reason = head_dim_reason(d, d_v)
    if reason is not None:
        return reason
    layout = a.dqkv_layout or a.qkv_layout
    if layout in ("t3hd", "th3d") and not q.shape == k.shape == v.shape:
        return f"dqkv_layout={layout!r} with q {tuple(q.shape)} and k {tuple(k.shape)}"
    if (a.cu_seqlens_q_padded is None) != (a.cu_seqlens_kv_padded is None):
        return "only one of cu_seqlens_q_padded and cu_seqlens_kv_padded is given"
    if a.cu_seqlens_q.shape[0] < 2:
        return "no sequence (cu_seqlens_q holds one offset)"
    if type(a.max_seqlen_q) is not int or type(a.max_seqlen_kv) is not int:
        return "max_seqlen_q/max_seqlen_kv are not ints"
    return None


def _stats_reusable(a: FallbackArgs) -> bool:
    """TE's softmax statistics are ``[t >= rows_q, h_q, 1]`` float32 and its output ``o`` is
    q's rows with v's head dim: FlashAttention-2's backward can take both as they are."""
    q, v, o = a.q, a.v, a.o
    aux = a.aux_ctx_tensors
    stats = aux[0] if isinstance(aux, (list, tuple)) and aux else None
    return (
        _plain(o) and _plain(stats)
        and tuple(o.shape) == (q.shape[0], q.shape[1], v.shape[2]) and o.dtype == q.dtype
        and o.device == q.device and stats.dtype == torch.float32
        and stats.dim() == 3 and stats.shape[0] >= q.shape[0]
        and tuple(stats.shape[1:]) == (q.shape[1], 1) and stats.device == q.device
    )  # fmt: skip


def decide(a: FallbackArgs, has_right_bound: bool = True) -> Union[Recipe, str]:
    """How :func:`run` serves calls like this one, or why it cannot (metadata only).

    Args:
        a: the call's arguments by name.
        has_right_bound: the installed TE passes a right window bound to cuDNN with every
            mask (TE >= 2.12: its signature has ``bottom_right_diagonal``).

    Returns:
        A :class:`Recipe`, or the reason (naming the argument or the limit) it is declined.
    """
    if a.dropout not in (None, 0.0):  # 0 and False too (== 0.0)
        return f"dropout={a.dropout!r} (cuDNN's dropout mask cannot be replayed)"
    for name, value, want in (
        ("attn_bias_type", a.attn_bias_type, "no_bias"),
        ("softmax_type", a.softmax_type, "vanilla"),
    ):
        if value not in (None, want):
            return f"{name}={value!r} (only {want!r})"
    if any(x is not None for x in (a.s_quantizer, a.dp_quantizer, a.dqkv_quantizer)):
        return "a quantizer is set (FP8)"
    layout = a.dqkv_layout or a.qkv_layout
    for name, value in (("qkv_layout", a.qkv_layout), ("dqkv_layout", layout)):
        if value not in THD_LAYOUTS:
            return f"{name}={value!r} (THD layouts only: {', '.join(THD_LAYOUTS)})"
    for name, value in (("o_format", a.o_format), ("do_format", a.do_format)):
        if value not in (None, "thd"):
            return f"{name}={value!r} (only 'thd')"
    reason = _tensor_reason(a)
    if reason is not None:
        return reason
    mask = _mask_reason(a, has_right_bound)
    if isinstance(mask, str):
        return mask
    reason = _device_reason(a.q.dtype, a.q.device)
    if reason is not None:
        return reason
    window, split = mask
    deterministic = bool(a.deterministic)
    if deterministic and release(torch.__version__) < _DETERMINISTIC_TORCH:
        log_once(
            ("no-deterministic-fa2",), logging.WARNING,
            "deterministic=True, but FlashAttention-2 in torch %s has no deterministic "
            "backward: the exact fallback's gradients are exact, not bitwise repeatable",
            torch.__version__,
        )  # fmt: skip
        deterministic = False
    one_segmentation = (
        _same_memory(a.cu_seqlens_q, a.cu_seqlens_kv)
        and _same_memory(a.cu_seqlens_q_padded, a.cu_seqlens_kv_padded)
        and a.q.shape[0] == a.k.shape[0]
    )
    back_to_back = tuple(
        pad is None or _same_memory(pad, cu)
        for cu, pad in (
            (a.cu_seqlens_q, a.cu_seqlens_q_padded),
            (a.cu_seqlens_kv, a.cu_seqlens_kv_padded),
        )
    )
    return Recipe(
        window, split, _stats_reusable(a), str(layout), deterministic, one_segmentation,
        back_to_back,  # type: ignore[arg-type]
    )  # fmt: skip


def head_dim_reason(d_qk: int, d_v: Optional[int] = None) -> Optional[str]:
    """Why the fallback cannot serve these head dims, or None when it can.

    Args:
        d_qk: the q/k head dim; d_v: the v head dim (default: the same).

    Returns:
        None for multiples of 8 up to 256 with ``d_v <= d_qk``; else the reason.
    """
    d_v = d_qk if d_v is None else d_v
    if d_qk % 8 or d_v % 8 or not 0 < d_v <= d_qk <= 256:
        return f"head dims {d_qk}/{d_v} (FlashAttention-2: multiples of 8 up to 256, v's <= q's)"
    return None


_device_ok: Dict[Tuple[torch.dtype, torch.device], Optional[str]] = {}


def _device_reason(dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why torch's FlashAttention-2 cannot run on this dtype and device; cached."""
    key = (dtype, device)
    if key not in _device_ok:
        _device_ok[key] = _probe_device(dtype, device)
    return _device_ok[key]


def _probe_device(dtype: torch.dtype, device: torch.device) -> Optional[str]:
    if dtype not in _TE_DTYPES:
        return f"dtype {dtype} (FlashAttention-2 takes fp16/bf16)"
    if device.type != "cuda":
        return f"tensors on {device}, not CUDA"
    schema = str(_aten._flash_attention_backward.default._schema)
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    if not built or "window_size_left" not in schema:
        return "this torch has no FlashAttention-2 with window arguments"
    index = torch.cuda.current_device() if device.index is None else device.index
    if torch.cuda.get_device_capability(index) < (8, 0):
        return "FlashAttention-2 needs compute capability 8.0 or newer"
    return None


# ------------------------------------------------------------------------------ the work
def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as FlashAttention-2 loads it: unit last stride, 16-byte aligned rows (a copy
    where not: ``contiguous()`` would return a contiguous but misaligned view unchanged)."""
    *outer, last = t.stride()
    if last == 1 and t.data_ptr() % 16 == 0 and not any(map((8).__rmod__, outer)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _varlen_offsets(lo: torch.Tensor, hi: torch.Tensor, rows: int) -> torch.Tensor:
    """Varlen offsets ``[0, lo_0, hi_0, lo_1, hi_1, ..., hi_{B-1}, rows]``: sequence ``b`` is
    segment ``2b + 1`` (rows ``[lo_b, hi_b)``), every other row lies in a segment of its own.
    Clamped to the buffer and non-decreasing, so impossible offsets stay inside it. A buffer
    row is then FlashAttention-2's row too: TE's per-row statistics index it unchanged."""
    off = F.pad(torch.stack((lo, hi), 1).reshape(-1), (1, 1))
    off[-1:].fill_(rows)
    return torch.cummax(off.clamp(0, rows), 0).values.to(torch.int32)


def _segments(
    cu: torch.Tensor, padded: Optional[torch.Tensor], back_to_back: bool, rows: int
) -> torch.Tensor:
    """FlashAttention-2's varlen offsets for one side of TE's call (valid offsets ``cu``,
    buffer offsets ``padded``).

    Where its sequences lie back to back (:attr:`Recipe.back_to_back`), the valid offsets
    themselves, clamped to the buffer and non-decreasing: sequence ``b`` is segment ``b``,
    rows past the last lie in none. Else :func:`_varlen_offsets` of the padded starts. Either
    way a buffer row is FlashAttention-2's row."""
    if back_to_back:
        return torch.cummax(cu.clamp(0, rows), 0).values
    start = padded[:-1]  # type: ignore[index]
    return _varlen_offsets(start, start + (cu[1:] - cu[:-1]), rows)


def _bounds(a: FallbackArgs) -> Tuple[int, int]:
    """FlashAttention-2's ``max_q``, ``max_k`` from TE's bounds. It takes a window of at
    least ``max_k`` as unbounded: exact when ``max_k`` bounds every query and key count.
    A ``max_q`` of 1 would switch it to a decode layout."""
    max_q, max_k = a.max_seqlen_q, a.max_seqlen_kv
    if max_q < 0 or max_k < 0:
        raise ValueError(f"max_seqlen_q/max_seqlen_kv: expected ints >= 0, got {max_q}, {max_k}")
    max_q = max(max_q, 2)
    return max_q, max(max_k, max_q)


@contextlib.contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    """torch's deterministic mode (not warn-only) for the block alone when ``on``; the
    previous mode comes back even when the block raises. Host flags only: graph-safe."""
    if not on or (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # its outputs are all written
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


class _Flash(NamedTuple):
    """One FlashAttention-2 call's tensors (head dims padded to q/k's) and bounds."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    d_o: torch.Tensor
    max_q: int
    max_k: int
    scale: float


_placeholders: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}


def _philox_placeholders(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The seed and offset tensors FlashAttention-2's backward takes and, without dropout,
    never reads: made once per device (first use outside CUDA-graph capture)."""
    found = _placeholders.get(device)
    if found is None:
        found = _placeholders[device] = (
            torch.zeros(2, dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.int64, device=device),
        )
    return found


def _flash(f: _Flash, off_q, off_k, window, deterministic, out=None, lse=None) -> tuple:
    """FlashAttention-2's backward on these segments: fed TE's ``out`` and statistics
    ``lse`` (``[h, t]``), or after its own forward where they are None."""
    left, right = window
    kw = dict(scale=f.scale, window_size_left=left, window_size_right=right)
    causal = (left, right) == (-1, 0)
    if lse is None:
        out, lse, seed, offset, _ = _aten._flash_attention_forward(
            f.q, f.k, f.v, off_q, off_k, f.max_q, f.max_k, 0.0, causal, False, **kw
        )
    else:  # dropout 0: the philox state is not read
        seed, offset = _philox_placeholders(f.q.device)
    with _deterministic(deterministic):
        return _aten._flash_attention_backward(
            f.d_o, f.q, f.k, f.v, out, lse, off_q, off_k, f.max_q, f.max_k, 0.0, causal,
            seed, offset, **kw,
        )  # fmt: skip


def _pack(layout: str, grads: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
    """dQ, dK, dV as TE returns them: for packed layouts, views of one buffer."""
    if layout not in PACKED:
        return list(grads)
    first, dim = PACKED[layout]
    return [*grads[:first], *torch.stack(grads[first:], dim).unbind(dim)]


def _top_left_in_one_call(f: _Flash, a: FallbackArgs, recipe: Recipe, out, lse) -> tuple:
    """Top-left causal across two offsets tensors, on TE's statistics, in one call.

    Query i of a sequence sees keys j <= i with j < lk. FlashAttention-2 aligns its causal
    mask bottom-right, which is top-left only where a segment has as many keys as queries:
    so key p < n = min(lq, lk) moves to the row of query p, the rest of the query's segment
    gets zero keys, and one causal call runs on q's segments for both. With TE's statistics
    a key's probability does not depend on the other keys, and a zero key adds 0 to every
    real gradient: its dQ term is dS * 0. (Its probability exp(-lse) must be finite: a query
    from lk on whose logsumexp is below -88 would get NaN.) dK and dV move back; keys no
    query sees (p >= n) get 0, their true gradient.
    """
    side_q = (a.cu_seqlens_q, a.cu_seqlens_q_padded)
    side_kv = (a.cu_seqlens_kv, a.cu_seqlens_kv_padded)
    rows_q, rows_k = f.q.shape[0], f.k.shape[0]
    k, v = move_rows((f.k, f.v), rows_q, side_q, side_kv)  # finite: v is 0 where k is
    off = _segments(a.cu_seqlens_q, a.cu_seqlens_q_padded, recipe.back_to_back[0], rows_q)
    moved = f._replace(k=k, v=v, max_k=f.max_q)
    dq, dk, dv = _flash(moved, off, off, (-1, 0), recipe.deterministic, out, lse)
    dk, dv = move_rows((dk, dv), rows_k, side_kv, side_q)
    return dq, dk, dv


def run(recipe: Recipe, a: FallbackArgs) -> List[Optional[torch.Tensor]]:
    """What TE's ``fused_attn_bwd`` returns for these arguments, computed with
    FlashAttention-2.

    Every row with a nonzero true gradient is exact. Rows whose true gradient is 0 (padding,
    rows outside sequences, keys no query attends, dQ of sequences without keys) may hold
    anything, NaN included: the post-pass (dQ too) must follow. TE's ``max_seqlen_q`` /
    ``max_seqlen_kv`` must bound every valid sequence length, as TE requires.

    Args:
        recipe: :func:`decide`'s recipe for calls like this one.
        a: the call's arguments by name.

    Returns:
        ``[dq, dk, dv, None, None]`` as TE returns them (no dBias, no dSoftmaxOffset).
    """
    q, k, v, d_o = _ready(a.q), _ready(a.k), _ready(a.v), _ready(a.d_o)
    rows_q, rows_k, d_qk, d_v = q.shape[0], k.shape[0], q.shape[-1], v.shape[-1]
    out = lse = None
    if recipe.reuse_stats:
        out = _ready(a.o)
        # [t, h, 1], row t = buffer row t of q: FlashAttention-2's [h, t] on our segments.
        stats = a.aux_ctx_tensors[0][:rows_q, :, 0].t()
        # A NaN there (a row no key is attended by, or padding) must not reach any gradient:
        # +inf makes every probability of its row 0, as for FlashAttention-2's own empty rows.
        inf = float("inf")
        lse = torch.empty(stats.shape, dtype=torch.float32, device=stats.device)
        torch.nan_to_num(stats, nan=inf, posinf=inf, neginf=-inf, out=lse)
    if d_v < d_qk:  # zero columns: P @ [V, 0] = [O, 0], so dQ, dK and dV[:d_v] hold
        pad = (0, d_qk - d_v)
        v, d_o = F.pad(v, pad), F.pad(d_o, pad)
        out = None if out is None else F.pad(out, pad)
    scale = a.attn_scale
    f = _Flash(q, k, v, d_o, *_bounds(a), d_qk**-0.5 if scale is None else float(scale))
    det = recipe.deterministic
    if not recipe.split:
        back_q, back_k = recipe.back_to_back
        off_q = _segments(a.cu_seqlens_q, a.cu_seqlens_q_padded, back_q, rows_q)
        off_k = (
            off_q
            if recipe.one_segmentation
            else _segments(a.cu_seqlens_kv, a.cu_seqlens_kv_padded, back_k, rows_k)
        )
        dq, dk, dv = _flash(f, off_q, off_k, recipe.window, det, out, lse)
    elif lse is not None:
        dq, dk, dv = _top_left_in_one_call(f, a, recipe, out, lse)
    else:
        cu_q, cu_kv = a.cu_seqlens_q, a.cu_seqlens_kv
        pad_q, pad_kv = a.cu_seqlens_q_padded, a.cu_seqlens_kv_padded
        if pad_q is None:
            pad_q, pad_kv = cu_q, cu_kv
        start_q, len_q = pad_q[:-1], cu_q[1:] - cu_q[:-1]
        start_k, len_k = pad_kv[:-1], cu_kv[1:] - cu_kv[:-1]
        # Top-left causal: query i of a sequence sees keys [0, min(i, lk - 1)]. The first
        # n = min(lq, lk) queries and keys form a square, causal both ways round; queries
        # from lk on (only when lq > lk) see every key. Keys from lq on are seen by none.
        # Each query's keys lie in one of the two calls, so each call's forward holds.
        n = torch.minimum(len_q, len_k)
        off_qa = _varlen_offsets(start_q, start_q + n, rows_q)
        off_ka = _varlen_offsets(start_k, start_k + n, rows_k)
        dq, dk, dv = _flash(f, off_qa, off_ka, (-1, 0), det)
        off_qb = _varlen_offsets(start_q + n, start_q + len_q, rows_q)
        off_kb = _varlen_offsets(start_k, start_k + len_k, rows_k)
        dq_b, dk_b, dv_b = _flash(f, off_qb, off_kb, (-1, -1), det)
        # Each live query row is in one call's sequence segments (odd segment index).
        rows = torch.arange(rows_q, dtype=torch.int32, device=q.device)
        in_b = torch.searchsorted(off_qb, rows, right=True) % 2 == 0
        dq = torch.where(in_b.view(-1, 1, 1), dq_b, dq)
        dk, dv = dk + dk_b, dv + dv_b
    return [*_pack(recipe.layout, (dq, dk, dv[..., :d_v])), None, None]


def exact_backward(call: Mapping[str, Any]) -> List[Optional[torch.Tensor]]:
    """:func:`run` for one call, decided now (the wrapper decides once per call shape).

    Args:
        call: TE's ``fused_attn_bwd`` arguments by name (names the release lacks: absent).

    Returns:
        ``[dq, dk, dv, None, None]`` as TE returns them; rows whose true gradient is 0 hold
        anything until the post-pass runs.

    Raises:
        InputError: malformed q, k, v or offsets (the input gate, as the wrapper checks them).
        ValueError: when :func:`decide` declines the call, with its reason.
    """
    a = FallbackArgs(**{name: call.get(name) for name in FallbackArgs._fields})
    offsets = (a.cu_seqlens_q, a.cu_seqlens_kv, a.cu_seqlens_q_padded, a.cu_seqlens_kv_padded)
    checks.gradients(a.q, a.k, a.v, *offsets, names=("q", "k", "v"))
    recipe = decide(a, "bottom_right_diagonal" in call)
    if isinstance(recipe, str):
        raise ValueError(f"exact_backward cannot reproduce this call: {recipe}")
    return run(recipe, a)
