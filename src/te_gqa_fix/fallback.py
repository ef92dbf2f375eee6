"""An exact replacement for TE's ``fused_attn_bwd`` on packed THD input, on FlashAttention-2.

Where cuDNN's backward is wrong on live rows (on Hopper, the head dims :mod:`.affected` lists
per cuDNN build, such as 256 on 9.14 and q/k 256 with v 128 on 9.19) no post-pass can repair
it. PyTorch's own
FlashAttention-2 varlen backward computes the same gradients from TE's forward output and
softmax statistics, with the offsets kept on the device: no host sync, CUDA-graph safe.

A call is decided from its metadata once (:func:`call_facts` -> :func:`decide`: a
:class:`Recipe`, or why not); :func:`run` then does the work for every call of that shape.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ._logging import log_once
from .masks import window_pair
from .row_moves import move_rows
from .stack.versions import release
from .te_names import MASKS, OFFSET_NAMES, PACKED, THD_LAYOUTS, THD_MASKS

__all__ = [
    "CallFacts",
    "Recipe",
    "call_facts",
    "coverage",
    "decide",
    "exact_backward",
    "head_dim_reason",
    "run",
    "why_not",
]

# FlashAttention-2's entry points (the CPU tests put an emulation here).
_aten = torch.ops.aten

_TE_DTYPES = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16"}
_QUANTIZERS = ("s_quantizer", "dp_quantizer", "dqkv_quantizer")
# FlashAttention-2's backward reads torch's deterministic mode from this release on.
_DETERMINISTIC_TORCH = (2, 5)


def coverage() -> Tuple[str, ...]:
    """What :func:`exact_backward` reproduces exactly and what it declines, one line each."""
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
class TensorMeta(NamedTuple):
    """What the decision reads of one tensor argument."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class CallFacts(NamedTuple):
    """Every fact :func:`decide` reads from a call: metadata only, hashable, so it keys the
    wrapper's cache. Tensor fields are None for anything but a plain ``torch.Tensor``."""

    q: Optional[TensorMeta]
    k: Optional[TensorMeta]
    v: Optional[TensorMeta]
    d_o: Optional[TensorMeta]
    o: Optional[TensorMeta]
    stats: Optional[TensorMeta]  # aux_ctx_tensors[0]
    offsets: Tuple[Optional[TensorMeta], ...]  # the four, TE's order (OFFSET_NAMES)
    offsets_given: Tuple[bool, ...]
    one_offsets: bool  # cu_seqlens_kv is cu_seqlens_q's memory (self-attention)
    one_padded: bool  # cu_seqlens_kv_padded is cu_seqlens_q_padded's memory (or both None)
    back_to_back: Tuple[bool, bool]  # q's, kv's padded offsets None or the valid ones' memory
    max_seqlens_are_ints: bool
    dropout: object
    attn_bias_type: object
    softmax_type: object
    fp8: bool
    qkv_layout: object
    dqkv_layout: object
    o_format: object
    do_format: object
    fake_dtype: object
    dqkv_dtype: object
    attn_mask_type: object
    window_size: object
    bottom_right_diagonal: object
    has_right_bound: bool  # TE >= 2.12 passes a right window bound to cuDNN
    deterministic: bool


class Recipe(NamedTuple):
    """How :func:`run` computes one call shape.

    ``window`` is FlashAttention-2's (bottom-right aligned) window; ``split``: top-left causal
    across two offset tensors (one call on keys moved to q's rows, or two after a forward);
    ``reuse_stats``: TE's softmax statistics are ``[t >= rows_q, h, 1]`` float32 and replace
    a forward recompute;
    ``layout``: the gradients' layout; ``deterministic``: bitwise repeatable;
    ``one_segmentation``: q and kv rows are segmented alike (one offsets tensor each way,
    as many rows), so FlashAttention-2 gets one offsets tensor for both; ``back_to_back``:
    q's, kv's sequences lie back to back (no padded offsets, or the valid ones, as
    DotProductAttention passes them without padding), so the valid offsets are segments.
    """

    window: Tuple[int, int]
    split: bool
    reuse_stats: bool
    layout: str
    deterministic: bool
    one_segmentation: bool
    back_to_back: Tuple[bool, bool]


def _meta(t: object) -> Optional[TensorMeta]:
    if type(t) is not torch.Tensor:
        return None
    return TensorMeta(t.shape, t.dtype, t.device)  # type: ignore[union-attr]


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


def call_facts(call: Mapping[str, Any]) -> CallFacts:
    """The facts :func:`decide` reads, from TE's ``fused_attn_bwd`` arguments by name.

    Args:
        call: the arguments by name, defaults applied (TE 2.8 .. 2.20).

    Returns:
        A hashable :class:`CallFacts` (metadata only; no host sync).
    """
    get = call.get
    aux = get("aux_ctx_tensors")
    stats = aux[0] if isinstance(aux, (list, tuple)) and aux else None
    window = get("window_size")
    return CallFacts(
        q=_meta(get("q")),
        k=_meta(get("k")),
        v=_meta(get("v")),
        d_o=_meta(get("d_o")),
        o=_meta(get("o")),
        stats=_meta(stats),
        offsets=tuple(_meta(get(n)) for n in OFFSET_NAMES),
        offsets_given=tuple(get(n) is not None for n in OFFSET_NAMES),
        one_offsets=_same_memory(get("cu_seqlens_q"), get("cu_seqlens_kv")),
        one_padded=_same_memory(get("cu_seqlens_q_padded"), get("cu_seqlens_kv_padded")),
        back_to_back=tuple(  # type: ignore[arg-type]
            get(padded) is None or _same_memory(get(padded), get(valid))
            for valid, padded in (OFFSET_NAMES[0::2], OFFSET_NAMES[1::2])
        ),
        max_seqlens_are_ints=all(type(get(n)) is int for n in ("max_seqlen_q", "max_seqlen_kv")),
        dropout=get("dropout"),
        attn_bias_type=get("attn_bias_type", "no_bias"),
        softmax_type=get("softmax_type", "vanilla"),
        fp8=any(get(n) is not None for n in _QUANTIZERS),
        qkv_layout=get("qkv_layout"),
        dqkv_layout=get("dqkv_layout", get("qkv_layout")),
        o_format=get("o_format", "thd"),
        do_format=get("do_format", "thd"),
        fake_dtype=get("fake_dtype"),  # a required argument of every TE release
        dqkv_dtype=get("dqkv_dtype"),
        attn_mask_type=get("attn_mask_type", "padding"),
        window_size=tuple(window) if type(window) is list else window,
        bottom_right_diagonal=get("bottom_right_diagonal"),
        has_right_bound="bottom_right_diagonal" in call,
        deterministic=bool(get("deterministic")),
    )


def _mask_reason(f: CallFacts) -> Union[str, Tuple[Tuple[int, int], bool]]:
    """FlashAttention-2's window for TE's mask and whether it is top-left causal across two
    offsets tensors (:attr:`Recipe.split`), or why FlashAttention-2 cannot reproduce it."""
    name = f.attn_mask_type
    if name not in THD_MASKS:
        return f"attn_mask_type={name!r} (THD takes {', '.join(THD_MASKS)})"
    causal, bottom_right = MASKS[name]
    pair = window_pair(f.window_size)  # type: ignore[arg-type]
    if pair is None:
        return f"window_size={f.window_size!r} is not two integers from -1 to 2**31 - 1"
    left, right = pair
    brd = f.bottom_right_diagonal
    if brd is not None and not isinstance(brd, bool):
        return f"bottom_right_diagonal={brd!r} is not a bool or None"
    if causal and right > 0:
        return f"window_size={f.window_size!r} with causal {name!r} (right must be -1 or 0)"
    if causal and brd is not None and brd != bottom_right:
        return f"bottom_right_diagonal={brd} against {name!r}"
    if not causal and right >= 0 and not f.has_right_bound:
        return f"window_size={f.window_size!r} with {name!r}: TE < 2.12 sets no right bound"
    right = 0 if causal else right
    bottom_right = bottom_right if brd is None else brd
    # FlashAttention-2 aligns to the bottom right; top-left is the same where lq == lk.
    if (left, right) == (-1, -1) or bottom_right or f.one_offsets:
        return (left, right), False
    if (left, right) == (-1, 0):
        return (left, right), True
    return f"top-left window_size={f.window_size!r} across two offset tensors (q, kv)"


def _tensor_reason(f: CallFacts) -> Optional[str]:
    """Why the tensors are not ones FlashAttention-2 takes (shapes, dtypes, devices)."""
    named = (("q", f.q), ("k", f.k), ("v", f.v), ("d_o", f.d_o))
    for name, t in named:
        if t is None or len(t.shape) != 3:
            return f"{name} is not a plain 3-D tensor (FP8 or not THD)"
    q, k, v, d_o = f.q, f.k, f.v, f.d_o
    for name, t in named[1:]:
        if t.dtype != q.dtype or t.device != q.device:  # type: ignore[union-attr]
            return f"{name} differs from q in dtype or device"
    dqkv = f.dqkv_dtype
    if f.fake_dtype != q.dtype or (  # type: ignore[union-attr]
        dqkv is not None and dqkv != q.dtype and str(dqkv).split(".")[-1] != _TE_DTYPES.get(q.dtype)  # type: ignore[union-attr]
    ):
        return f"fake_dtype/dqkv_dtype differ from q's {q.dtype}"  # type: ignore[union-attr]
    (rows_q, h_q, d), (rows_k, h_k, d_k), (rows_v, h_v, d_v) = q.shape, k.shape, v.shape  # type: ignore[union-attr]
    if h_k != h_v or h_q % h_k or rows_k != rows_v:
        return f"heads q {h_q}, k {h_k}, v {h_v}, rows k {rows_k}, v {rows_v}: KV heads must divide q heads, k and v share rows"
    if d_k != d or d_o.shape != (rows_q, h_q, d_v):  # type: ignore[union-attr]
        return f"head dims q {d}, k {d_k}, v {d_v}, d_o {d_o.shape}: k's must be q's, d_o [t, h_q, d_v]"  # type: ignore[union-attr]
    reason = head_dim_reason(d, d_v)
    if reason is not None:
        return reason
    if f.dqkv_layout in ("t3hd", "th3d") and not q.shape == k.shape == v.shape:  # type: ignore[union-attr]
        return f"dqkv_layout={f.dqkv_layout!r} with q {q.shape} and k {k.shape}"  # type: ignore[union-attr]
    if f.offsets_given[2] != f.offsets_given[3]:
        return "only one of cu_seqlens_q_padded and cu_seqlens_kv_padded is given"
    first = f.offsets[0]
    for name, given, t in zip(OFFSET_NAMES, f.offsets_given, f.offsets):
        if not given and "padded" in name:
            continue
        if (
            t is None or t.dtype != torch.int32 or len(t.shape) != 1 or first is None
            or not 2 <= t.shape[0] == first.shape[0] or t.device != q.device  # type: ignore[union-attr]
        ):  # fmt: skip
            return f"{name}: expected 1-D int32 offsets on {q.device}, all of one length"  # type: ignore[union-attr]
    if not f.max_seqlens_are_ints:
        return "max_seqlen_q/max_seqlen_kv are not ints"
    return None


def _stats_layout_known(f: CallFacts) -> bool:
    """TE's softmax statistics are ``[t >= rows_q, h_q, 1]`` float32 and its output ``o`` is
    q's rows with v's head dim: FlashAttention-2's backward can take both as they are."""
    q, v, o, stats = f.q, f.v, f.o, f.stats
    return (
        o is not None and stats is not None
        and o.shape == (q.shape[0], q.shape[1], v.shape[2]) and o.dtype == q.dtype  # type: ignore[union-attr]
        and o.device == q.device and stats.dtype == torch.float32  # type: ignore[union-attr]
        and len(stats.shape) == 3 and stats.shape[0] >= q.shape[0]  # type: ignore[union-attr]
        and stats.shape[1:] == (q.shape[1], 1) and stats.device == q.device  # type: ignore[union-attr]
    )  # fmt: skip


def decide(f: CallFacts) -> Union[Recipe, str]:
    """How :func:`run` serves a call with these facts, or why it cannot.

    Args:
        f: :func:`call_facts` of the call.

    Returns:
        A :class:`Recipe`, or the reason (naming the argument or the limit) it is declined.
    """
    if f.dropout not in (None, 0.0):  # 0 and False too (== 0.0)
        return f"dropout={f.dropout!r} (cuDNN's dropout mask cannot be replayed)"
    for name, value, want in (
        ("attn_bias_type", f.attn_bias_type, "no_bias"),
        ("softmax_type", f.softmax_type, "vanilla"),
    ):
        if value != want:
            return f"{name}={value!r} (only {want!r})"
    if f.fp8:
        return "a quantizer is set (FP8)"
    for name, value in (("qkv_layout", f.qkv_layout), ("dqkv_layout", f.dqkv_layout)):
        if value not in THD_LAYOUTS:
            return f"{name}={value!r} (THD layouts only: {', '.join(THD_LAYOUTS)})"
    for name, value in (("o_format", f.o_format), ("do_format", f.do_format)):
        if value != "thd":
            return f"{name}={value!r} (only 'thd')"
    reason = _tensor_reason(f)
    if reason is not None:
        return reason
    mask = _mask_reason(f)
    if isinstance(mask, str):
        return mask
    reason = _device_reason(f.q.dtype, f.q.device)  # type: ignore[union-attr]
    if reason is not None:
        return reason
    window, split = mask
    one_segmentation = f.one_offsets and f.one_padded and f.q.shape[0] == f.k.shape[0]  # type: ignore[union-attr]
    return Recipe(
        window, split, _stats_layout_known(f), str(f.dqkv_layout), f.deterministic,
        one_segmentation, f.back_to_back,
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


def why_not(call: Mapping[str, Any]) -> Optional[str]:
    """Whether :func:`exact_backward` reproduces this TE call exactly.

    Args:
        call: TE's ``fused_attn_bwd`` arguments by name, defaults applied (TE 2.8 .. 2.20).

    Returns:
        None when it does; else the reason, naming the argument or the limit.
    """
    recipe = decide(call_facts(call))
    return recipe if isinstance(recipe, str) else None


# ------------------------------------------------------------------------------ the work
def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as FlashAttention-2 loads it: unit last stride, 16-byte aligned rows (a copy
    where not: ``contiguous()`` would return a contiguous but misaligned view unchanged)."""
    aligned = t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])
    return t if t.stride(-1) == 1 and aligned else t.clone(memory_format=torch.contiguous_format)


def _varlen_offsets(lo: torch.Tensor, hi: torch.Tensor, rows: int) -> torch.Tensor:
    """Varlen offsets ``[0, lo_0, hi_0, lo_1, hi_1, ..., hi_{B-1}, rows]``: sequence ``b`` is
    segment ``2b + 1`` (rows ``[lo_b, hi_b)``), every other row lies in a segment of its own.
    Clamped to the buffer and non-decreasing, so impossible offsets stay inside it. A buffer
    row is then FlashAttention-2's row too: TE's per-row statistics index it unchanged."""
    off = F.pad(torch.stack((lo, hi), 1).reshape(-1), (1, 1))
    off[-1:].fill_(rows)
    return torch.cummax(off.clamp(0, rows), 0).values.to(torch.int32)


def _segments(call: Mapping[str, Any], side: str, back_to_back: bool, rows: int) -> torch.Tensor:
    """FlashAttention-2's varlen offsets for one side (``"q"`` or ``"kv"``) of TE's call.

    Where its sequences lie back to back (:attr:`Recipe.back_to_back`), the valid offsets
    themselves, clamped to the buffer and non-decreasing: sequence ``b`` is segment ``b``,
    rows past the last lie in none. Else :func:`_varlen_offsets` of the padded starts. Either
    way a buffer row is FlashAttention-2's row."""
    cu = call["cu_seqlens_" + side]
    if back_to_back:
        return torch.cummax(cu.clamp(0, rows), 0).values
    start = call[f"cu_seqlens_{side}_padded"][:-1]
    return _varlen_offsets(start, start + (cu[1:] - cu[:-1]), rows)


def _sequences(call: Mapping[str, Any]) -> Tuple[torch.Tensor, ...]:
    """Each sequence's first buffer row and valid length, q then kv (device tensors); padded
    offsets None means the valid offsets, as in TE."""
    cu_q, cu_kv = call["cu_seqlens_q"], call["cu_seqlens_kv"]
    pad_q, pad_kv = call.get("cu_seqlens_q_padded"), call.get("cu_seqlens_kv_padded")
    if pad_q is None:
        pad_q, pad_kv = cu_q, cu_kv
    return pad_q[:-1], cu_q[1:] - cu_q[:-1], pad_kv[:-1], cu_kv[1:] - cu_kv[:-1]


def _bounds(call: Mapping[str, Any]) -> Tuple[int, int]:
    """FlashAttention-2's ``max_q``, ``max_k`` from TE's bounds. It takes a window of at
    least ``max_k`` as unbounded: exact when ``max_k`` bounds every query and key count.
    A ``max_q`` of 1 would switch it to a decode layout."""
    max_q, max_k = call["max_seqlen_q"], call["max_seqlen_kv"]
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


def _deterministic_available() -> bool:
    return release(torch.__version__) >= _DETERMINISTIC_TORCH


class _Args(NamedTuple):
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


def _flash(a: _Args, off_q, off_k, window, deterministic, out=None, lse=None) -> tuple:
    """FlashAttention-2's backward on these segments: fed TE's ``out`` and statistics
    ``lse`` (``[h, t]``), or after its own forward where they are None."""
    left, right = window
    kw = dict(scale=a.scale, window_size_left=left, window_size_right=right)
    causal = (left, right) == (-1, 0)
    if lse is None:
        out, lse, seed, offset, _ = _aten._flash_attention_forward(
            a.q, a.k, a.v, off_q, off_k, a.max_q, a.max_k, 0.0, causal, False, **kw
        )
    else:  # dropout 0: the philox state is not read
        seed, offset = _philox_placeholders(a.q.device)
    with _deterministic(deterministic):
        return _aten._flash_attention_backward(
            a.d_o, a.q, a.k, a.v, out, lse, off_q, off_k, a.max_q, a.max_k, 0.0, causal,
            seed, offset, **kw,
        )  # fmt: skip


def _pack(layout: str, grads: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
    """dQ, dK, dV as TE returns them: for packed layouts, views of one buffer."""
    if layout not in PACKED:
        return list(grads)
    first, dim = PACKED[layout]
    return [*grads[:first], *torch.stack(grads[first:], dim).unbind(dim)]


def _top_left_in_one_call(a: _Args, call, recipe: Recipe, out, lse) -> tuple:
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
    sides = [(call["cu_seqlens_" + s], call.get(f"cu_seqlens_{s}_padded")) for s in ("q", "kv")]
    rows_q, rows_k = a.q.shape[0], a.k.shape[0]
    k, v = move_rows((a.k, a.v), rows_q, sides[0], sides[1])  # finite: v is 0 where k is
    off = _segments(call, "q", recipe.back_to_back[0], rows_q)
    moved = a._replace(k=k, v=v, max_k=a.max_q)
    dq, dk, dv = _flash(moved, off, off, (-1, 0), recipe.deterministic, out, lse)
    dk, dv = move_rows((dk, dv), rows_k, sides[1], sides[0])
    return dq, dk, dv


def run(recipe: Recipe, call: Mapping[str, Any]) -> List[Optional[torch.Tensor]]:
    """What TE's ``fused_attn_bwd(**call)`` returns, computed with FlashAttention-2.

    Every row with a nonzero true gradient is exact. Rows whose true gradient is 0 (padding,
    rows outside sequences, keys no query attends, dQ of sequences without keys) may hold
    anything, NaN included: the post-pass (``zero_dead_rows``, dQ too) must follow. TE's
    ``max_seqlen_q``/``max_seqlen_kv`` must bound every valid sequence length, as TE requires.

    Args:
        recipe: :func:`decide`'s recipe for this call's :func:`call_facts`.
        call: TE's ``fused_attn_bwd`` arguments by name, defaults applied.

    Returns:
        ``[dq, dk, dv, None, None]`` as TE returns them (no dBias, no dSoftmaxOffset).
    """
    q, k, v, d_o = (_ready(call[n]) for n in ("q", "k", "v", "d_o"))
    rows_q, rows_k, d_qk, d_v = q.shape[0], k.shape[0], q.shape[-1], v.shape[-1]
    out = lse = None
    if recipe.reuse_stats:
        out = _ready(call["o"])
        # [t, h, 1], row t = buffer row t of q: FlashAttention-2's [h, t] on our segments.
        stats = call["aux_ctx_tensors"][0][:rows_q, :, 0].t()
        # A NaN there (a row no key is attended by, or padding) must not reach any gradient:
        # +inf makes every probability of its row 0, as for FlashAttention-2's own empty rows.
        inf = float("inf")
        lse = torch.empty(stats.shape, dtype=torch.float32, device=stats.device)
        torch.nan_to_num(stats, nan=inf, posinf=inf, neginf=-inf, out=lse)
    if d_v < d_qk:  # zero columns: P @ [V, 0] = [O, 0], so dQ, dK and dV[:d_v] hold
        pad = (0, d_qk - d_v)
        v, d_o = F.pad(v, pad), F.pad(d_o, pad)
        out = None if out is None else F.pad(out, pad)
    if recipe.deterministic and not _deterministic_available():
        log_once(
            ("no-deterministic-fa2",), logging.WARNING,
            "te_gqa_fix: deterministic=True, but FlashAttention-2 in torch %s has no "
            "deterministic backward: the exact fallback's gradients are exact, not bitwise "
            "repeatable", torch.__version__,
        )  # fmt: skip
    scale = call.get("attn_scale")
    args = _Args(q, k, v, d_o, *_bounds(call), d_qk**-0.5 if scale is None else float(scale))
    det = recipe.deterministic
    if not recipe.split:
        back_q, back_k = recipe.back_to_back
        off_q = _segments(call, "q", back_q, rows_q)
        off_k = off_q if recipe.one_segmentation else _segments(call, "kv", back_k, rows_k)
        dq, dk, dv = _flash(args, off_q, off_k, recipe.window, det, out, lse)
    elif lse is not None:
        dq, dk, dv = _top_left_in_one_call(args, call, recipe, out, lse)
    else:
        start_q, len_q, start_k, len_k = _sequences(call)
        # Top-left causal: query i of a sequence sees keys [0, min(i, lk - 1)]. The first
        # n = min(lq, lk) queries and keys form a square, causal both ways round; queries
        # from lk on (only when lq > lk) see every key. Keys from lq on are seen by none.
        # Each query's keys lie in one of the two calls, so each call's forward holds.
        n = torch.minimum(len_q, len_k)
        off_qa = _varlen_offsets(start_q, start_q + n, rows_q)
        off_ka = _varlen_offsets(start_k, start_k + n, rows_k)
        dq, dk, dv = _flash(args, off_qa, off_ka, (-1, 0), det)
        off_qb = _varlen_offsets(start_q + n, start_q + len_q, rows_q)
        off_kb = _varlen_offsets(start_k, start_k + len_k, rows_k)
        dq_b, dk_b, dv_b = _flash(args, off_qb, off_kb, (-1, -1), det)
        # Each live query row is in one call's sequence segments (odd segment index).
        rows = torch.arange(rows_q, dtype=torch.int32, device=q.device)
        in_b = torch.searchsorted(off_qb, rows, right=True) % 2 == 0
        dq = torch.where(in_b.view(-1, 1, 1), dq_b, dq)
        dk, dv = dk + dk_b, dv + dv_b
    return [*_pack(recipe.layout, (dq, dk, dv[..., :d_v])), None, None]


def exact_backward(call: Mapping[str, Any]) -> List[Optional[torch.Tensor]]:
    """:func:`run` for one call, decided now (the wrapper decides once per call shape).

    Args:
        call: TE's ``fused_attn_bwd`` arguments by name, defaults applied.

    Returns:
        ``[dq, dk, dv, None, None]`` as TE returns them; rows whose true gradient is 0 hold
        anything until the post-pass runs.

    Raises:
        ValueError: when :func:`why_not` gives a reason.
    """
    recipe = decide(call_facts(call))
    if isinstance(recipe, str):
        raise ValueError(f"exact_backward cannot reproduce this call: {recipe}")
    return run(recipe, call)
