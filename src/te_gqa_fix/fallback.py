"""An exact replacement for TE's ``fused_attn_bwd`` on packed THD input, on FlashAttention-2.

Where cuDNN's backward is wrong on live rows (Hopper, cuDNN < 9.18, head dim 192/256) no
post-pass can repair it. PyTorch's own FlashAttention-2 varlen kernels compute the same
gradients, with the offsets kept on the device: no host sync, CUDA-graph safe.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from .masks import window_pair

__all__ = ["coverage", "exact_backward", "head_dim_reason", "why_not"]

# FlashAttention-2's entry points (the CPU tests put an emulation here).
_aten = torch.ops.aten

_THD_LAYOUTS = ("thd_thd_thd", "thd_t2hd", "thd_th2d", "t3hd", "th3d")
# packed layout -> (index of the first packed gradient, the dimension they are stacked on)
_PACKED = {"thd_t2hd": (1, 1), "thd_th2d": (1, 2), "t3hd": (0, 1), "th3d": (0, 2)}
# mask name -> (causal, bottom-right by name). THD takes the padding masks only: TE refuses
# the others there, or (older cuDNN) runs them without the per-sequence lengths.
_MASKS = {
    "padding": (False, False),
    "padding_causal": (True, False),
    "padding_causal_bottom_right": (True, True),
}
_TE_DTYPES = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16"}
_OFFSETS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
_device_ok: Dict[int, Optional[str]] = {}


def coverage() -> Tuple[str, ...]:
    """What :func:`exact_backward` reproduces exactly and what it declines, one line each."""
    return (
        "exact: THD, fp16/bf16, MHA/GQA/MQA, head dims up to 256 (v's at most q/k's), padded "
        "offsets, sequences without queries or keys; padding, causal (top-left or bottom-right) "
        "and bottom-right windows; top-left windows when q and kv share one offsets tensor",
        "declined: dropout, bias, non-vanilla softmax, FP8, non-THD, deterministic=True outside "
        "torch's deterministic mode, contradictory causal arguments; needs CUDA sm80+",
    )


def _no(reason: str) -> Tuple[str, Tuple[int, int], bool]:
    return reason, (-1, -1), False


def _mask_plan(call: Mapping[str, Any]) -> Tuple[Optional[str], Tuple[int, int], bool]:
    """``(reason, window, split)``: FlashAttention-2's (bottom-right) window for TE's mask,
    and whether top-left causal needs the two-call split; ``reason`` when not exact."""
    name = call.get("attn_mask_type", "padding")
    if name not in _MASKS:
        return _no(f"attn_mask_type={name!r} (THD takes {', '.join(_MASKS)})")
    causal, bottom_right = _MASKS[name]
    window = call.get("window_size")
    pair = window_pair(window)
    if pair is None:
        return _no(f"window_size={window!r} is not two integers >= -1")
    left, right = pair
    brd = call.get("bottom_right_diagonal")
    if brd is not None and not isinstance(brd, bool):
        return _no(f"bottom_right_diagonal={brd!r} is not a bool or None")
    if causal and right > 0:
        return _no(f"window_size={window!r} with causal {name!r} (right must be -1 or 0)")
    if causal and brd is not None and brd != bottom_right:
        return _no(f"bottom_right_diagonal={brd} against {name!r}")
    if not causal and right >= 0 and "bottom_right_diagonal" not in call:
        return _no(f"window_size={window!r} with {name!r}: TE < 2.12 sets no right bound")
    right = 0 if causal else right
    bottom_right = bottom_right if brd is None else brd
    # FlashAttention-2 aligns to the bottom right; top-left is the same where lq == lk.
    if (left, right) == (-1, -1) or bottom_right:
        return None, (left, right), False
    cu_q, cu_kv = call["cu_seqlens_q"], call["cu_seqlens_kv"]
    one = {(t.data_ptr(), t.shape, t.stride()) for t in (cu_q, cu_kv)}
    if len(one) == 1:  # one memory: every lq == lk
        return None, (left, right), False
    if (left, right) == (-1, 0):
        return None, (-1, 0), True
    return _no(f"top-left window_size={window!r} across two offset tensors (q, kv)")


def _call_reason(call: Mapping[str, Any]) -> Optional[str]:
    """Why this call is not one FlashAttention-2 reproduces exactly (host metadata only)."""
    if float(call.get("dropout") or 0.0) != 0.0:
        return f"dropout={call.get('dropout')} (cuDNN's dropout mask cannot be replayed)"
    for name, want in (("attn_bias_type", "no_bias"), ("softmax_type", "vanilla")):
        if call.get(name, want) != want:
            return f"{name}={call.get(name)!r} (only {want!r})"
    for name in ("s_quantizer", "dp_quantizer", "dqkv_quantizer"):
        if call.get(name) is not None:
            return f"{name} is set (FP8)"
    out_layout = call.get("dqkv_layout", call.get("qkv_layout"))
    for name, value in (("qkv_layout", call.get("qkv_layout")), ("dqkv_layout", out_layout)):
        if value not in _THD_LAYOUTS:
            return f"{name}={value!r} (THD layouts only: {', '.join(_THD_LAYOUTS)})"
    for name in ("o_format", "do_format"):
        if call.get(name, "thd") != "thd":
            return f"{name}={call.get(name)!r} (only 'thd')"
    q, k, v, d_o = (call.get(n) for n in ("q", "k", "v", "d_o"))
    for name, t in zip(("q", "k", "v", "d_o"), (q, k, v, d_o)):
        if type(t) is not torch.Tensor or t.dim() != 3:
            return f"{name} is a {type(t).__name__}, not a plain 3-D tensor (FP8 or not THD)"
        if t.dtype != q.dtype or t.device != q.device:
            return f"{name} differs from q in dtype or device"
    dqkv_dtype = call.get("dqkv_dtype", q.dtype)  # TE < 2.16: a tex.DType
    if call.get("fake_dtype", q.dtype) != q.dtype or (
        dqkv_dtype != q.dtype and str(dqkv_dtype).split(".")[-1] != _TE_DTYPES.get(q.dtype)
    ):
        return f"fake_dtype/dqkv_dtype differ from q's {q.dtype}"
    h_q, d = q.shape[1], q.shape[2]
    if k.shape[1] != v.shape[1] or h_q % k.shape[1] or k.shape[0] != v.shape[0]:
        return f"heads q {h_q}, k {k.shape[1]}, v {v.shape[1]}: KV heads must divide q heads"
    if k.shape[2] != d or d_o.shape != (*q.shape[:2], v.shape[2]):
        return f"head dims q {d}, k {k.shape[2]}, d_o {d_o.shape[2]}: k's and q's must be one"
    reason = head_dim_reason(d, v.shape[2])
    if reason is not None:
        return reason
    if out_layout in ("t3hd", "th3d") and not q.shape == k.shape == v.shape:
        return f"dqkv_layout={out_layout!r} with q {tuple(q.shape)} and k {tuple(k.shape)}"
    offsets = {n: call.get(n) for n in _OFFSETS}
    if (offsets[_OFFSETS[2]] is None) != (offsets[_OFFSETS[3]] is None):
        return "only one of cu_seqlens_q_padded and cu_seqlens_kv_padded is given"
    like = offsets[_OFFSETS[0]]
    for name, t in offsets.items():
        ok = type(t) is torch.Tensor and t.dtype == torch.int32 and t.dim() == 1
        if (t is not None or "padded" not in name) and not (
            ok and 2 <= t.numel() == like.numel() and t.device == q.device
        ):
            return f"{name}: expected 1-D int32 offsets on {q.device}, all of one length"
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = call.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name}={value!r} is not an int >= 0"
    if call.get("deterministic") and not (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        return "deterministic=True outside torch.use_deterministic_algorithms(True)"
    return _mask_plan(call)[0]


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


def _device_reason(q: torch.Tensor) -> Optional[str]:
    """Why torch's FlashAttention-2 cannot run on ``q`` (dtype, device, build); cached."""
    if q.dtype not in _TE_DTYPES:
        return f"dtype {q.dtype} (FlashAttention-2 takes fp16/bf16)"
    if q.device.type != "cuda":
        return f"tensors on {q.device}, not CUDA"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _device_ok:
        schema = str(_aten._flash_attention_backward.default._schema)
        built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
        if not built or "window_size_left" not in schema:
            _device_ok[index] = "this torch has no FlashAttention-2 with window arguments"
        elif torch.cuda.get_device_capability(index) < (8, 0):
            _device_ok[index] = "FlashAttention-2 needs compute capability 8.0 or newer"
        else:
            _device_ok[index] = None
    return _device_ok[index]


def why_not(call: Mapping[str, Any]) -> Optional[str]:
    """Whether :func:`exact_backward` reproduces this TE call exactly.

    Args:
        call: TE's ``fused_attn_bwd`` arguments by name, defaults applied (TE 2.8 .. 2.20).

    Returns:
        None when it does; else the reason, naming the argument or the limit.
    """
    return _call_reason(call) or _device_reason(call["q"])


def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as FlashAttention-2 loads it: unit last stride, 16-byte aligned rows."""
    aligned = t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])
    return t if t.stride(-1) == 1 and aligned else t.contiguous()


def _segments(lo: torch.Tensor, hi: torch.Tensor, rows: int) -> torch.Tensor:
    """Varlen offsets ``[0, lo_0, hi_0, lo_1, hi_1, ..., hi_{B-1}, rows]``: sequence ``b`` is
    segment ``2b + 1`` (rows ``[lo_b, hi_b)``), every other row lies in a segment of its own.
    Clamped to the buffer and non-decreasing, so impossible offsets stay inside it."""
    off = torch.nn.functional.pad(torch.stack((lo, hi), 1).reshape(-1), (1, 1))
    off[-1:].fill_(rows)
    return torch.cummax(off.clamp(0, rows), 0).values.to(torch.int32)


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
    max_q = max(call["max_seqlen_q"], 2)
    return max_q, max(call["max_seqlen_kv"], max_q)


def _flash(q, k, v, d_o, off_q, off_k, max_q, max_k, window, scale) -> tuple:
    """FlashAttention-2's forward (for its softmax statistics) and backward on these segments."""
    left, right = window
    kw = dict(scale=scale, window_size_left=left, window_size_right=right)
    causal = (left, right) == (-1, 0)
    o, lse, rng, unused, _ = _aten._flash_attention_forward(
        q, k, v, off_q, off_k, max_q, max_k, 0.0, causal, False, **kw
    )
    return _aten._flash_attention_backward(
        d_o, q, k, v, o, lse, off_q, off_k, max_q, max_k, 0.0, causal, rng, unused, **kw
    )


def _pack(layout: str, grads: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
    """dQ, dK, dV as TE returns them: for packed layouts, views of one buffer."""
    if layout not in _PACKED:
        return list(grads)
    first, dim = _PACKED[layout]
    return [*grads[:first], *torch.stack(grads[first:], dim).unbind(dim)]


def exact_backward(call: Mapping[str, Any]) -> List[Optional[torch.Tensor]]:
    """What TE's ``fused_attn_bwd(**call)`` returns, computed with FlashAttention-2.

    Every row with a nonzero true gradient is exact. Rows whose true gradient is 0 (padding,
    rows outside sequences, keys no query attends, dQ of sequences without keys) may hold
    anything, NaN included: the post-pass (``zero_dead_rows``, dQ too) must follow. TE's
    ``max_seqlen_q``/``max_seqlen_kv`` must bound every valid sequence length, as TE requires.

    Args:
        call: TE's ``fused_attn_bwd`` arguments by name, defaults applied.

    Returns:
        ``[dq, dk, dv, None, None]`` as TE returns them (no dBias, no dSoftmaxOffset).

    Raises:
        ValueError: when :func:`why_not` gives a reason.
    """
    reason = why_not(call)
    if reason is not None:
        raise ValueError(f"exact_backward cannot reproduce this call: {reason}")
    q, k, v, d_o = (_ready(call[n]) for n in ("q", "k", "v", "d_o"))
    start_q, len_q, start_k, len_k = _sequences(call)
    _, window, split = _mask_plan(call)
    max_q, max_k = _bounds(call)
    scale = call.get("attn_scale")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    d_v = v.shape[-1]
    if d_v < q.shape[-1]:  # zero columns: P @ [V, 0] = [O, 0], so dQ, dK and dV[:d_v] hold
        pad = (0, q.shape[-1] - d_v)
        v, d_o = F.pad(v, pad), F.pad(d_o, pad)
    rows_q, rows_k = q.shape[0], k.shape[0]
    args = (q, k, v, d_o)
    if not split:
        off_q = _segments(start_q, start_q + len_q, rows_q)
        off_k = _segments(start_k, start_k + len_k, rows_k)
        dq, dk, dv = _flash(*args, off_q, off_k, max_q, max_k, window, scale)
    else:
        # Top-left causal: query i of a sequence sees keys [0, min(i, lk - 1)]. The first
        # n = min(lq, lk) queries and keys form a square, causal both ways round; queries
        # from lk on (only when lq > lk) see every key. Keys from lq on are seen by none.
        n = torch.minimum(len_q, len_k)
        off_qa = _segments(start_q, start_q + n, rows_q)
        off_ka = _segments(start_k, start_k + n, rows_k)
        dq, dk, dv = _flash(*args, off_qa, off_ka, max_q, max_k, (-1, 0), scale)
        off_qb = _segments(start_q + n, start_q + len_q, rows_q)
        off_kb = _segments(start_k, start_k + len_k, rows_k)
        dq_b, dk_b, dv_b = _flash(*args, off_qb, off_kb, max_q, max_k, (-1, -1), scale)
        # Each live query row is in one call's sequence segments (odd segment index).
        rows = torch.arange(rows_q, dtype=torch.int32, device=q.device)
        in_b = torch.searchsorted(off_qb, rows, right=True) % 2 == 0
        dq = torch.where(in_b.view(-1, 1, 1), dq_b, dq)
        dk, dv = dk + dk_b, dv + dv_b
    layout = call.get("dqkv_layout", call["qkv_layout"])
    return [*_pack(layout, (dq, dk, dv[..., :d_v])), None, None]
