"""THD test batches, TE's fused attention called by argument name, the fp32 reference.

The test harness, shared by the CPU and GPU tests, the evidence scripts and the benchmarks,
so that all of them call whichever TE release is installed the same way. Import it as
``thd`` with the ``tests`` folder on ``sys.path``. TE is imported on demand.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from te_gqa_fix._te import OFFSET_NAMES


def te_function() -> Callable:
    """TE's own ``fused_attn_bwd`` (below any wrapper: te-gqa-fix's or anyone's)."""
    from te_gqa_fix._te import SYMBOL, fused_attn_module
    from te_gqa_fix.wrapper import chain

    return chain(getattr(fused_attn_module(), SYMBOL))[-1]


def _parameters(fn: Callable):
    import te_gqa_fix

    if fn is te_gqa_fix.fused_attn_bwd:  # the drop-in: read the installed TE's signature
        fn = te_function()
    return inspect.signature(inspect.unwrap(fn)).parameters


def call_by_name(fn: Callable, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature has; the rest are dropped."""
    params = _parameters(fn)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _lengths(offsets: Sequence[int]) -> List[int]:
    return [b - a for a, b in zip(offsets, offsets[1:])]


@dataclass
class ThdBatch:
    """A packed THD batch: per-sequence valid lengths and buffer offsets for q and kv."""

    cu_q: List[int]
    cu_kv: List[int]
    pad_q: List[int]
    pad_kv: List[int]
    rows_q: int
    rows_kv: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype
    mask: str = "padding_causal"
    window: Tuple[int, int] = (-1, -1)
    bottom_right_diagonal: Optional[bool] = None
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    head_dim_v: Optional[int] = None  # None: the same as head_dim (MLA uses q/k 192, v 128)

    @classmethod
    def of_tensors(
        cls,
        tensors: Dict[str, torch.Tensor],
        cu_q: Sequence[int],
        cu_kv: Sequence[int],
        pad_q: Sequence[int],
        pad_kv: Sequence[int],
        **fields: Any,
    ) -> ThdBatch:
        """The batch of THD tensors ``q``, ``k``, ``v``, ``d_o``; ``fields`` sets ``mask``, ..."""
        q, k = tensors["q"], tensors["k"]
        return cls(
            cu_q=list(cu_q),
            cu_kv=list(cu_kv),
            pad_q=list(pad_q),
            pad_kv=list(pad_kv),
            rows_q=q.shape[0],
            rows_kv=k.shape[0],
            heads_q=q.shape[1],
            heads_kv=k.shape[1],
            head_dim=q.shape[2],
            dtype=q.dtype,
            tensors=dict(tensors),
            **fields,
        )

    @property
    def lq(self) -> List[int]:
        return _lengths(self.cu_q)

    @property
    def lk(self) -> List[int]:
        return _lengths(self.cu_kv)

    def offsets(self, device: torch.device | str) -> Dict[str, torch.Tensor]:
        """TE's four offset arguments, as int32 tensors on ``device``."""
        values = (self.cu_q, self.cu_kv, self.pad_q, self.pad_kv)
        return {
            n: torch.tensor(v, dtype=torch.int32, device=device)
            for n, v in zip(OFFSET_NAMES, values)
        }

    def max_seqlens(self) -> Tuple[int, int]:
        """Max padded segment length, rounded up to 64 (TE's convention for THD)."""
        longest = (max(_lengths(pad) or [1]) for pad in (self.pad_q, self.pad_kv))
        max_q, max_kv = (max(64, (m + 63) // 64 * 64) for m in longest)
        return max_q, max_kv


def make_batch(
    lq: Sequence[int],
    lk: Sequence[int],
    *,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    gap_q: Sequence[int] | int = 0,
    gap_kv: Sequence[int] | int = 0,
    lead: int = 0,
    tail: int = 0,
    **fields: Any,
) -> ThdBatch:
    """Lay sequences out with ``gap`` padding rows after each, ``lead`` rows before the
    first and ``tail`` rows after the last; ``fields`` sets ``mask``, ``window``, ..."""

    def layout(lengths: Sequence[int], gaps: Sequence[int] | int):
        cu, pad = [0], [lead]
        for i, length in enumerate(lengths):
            cu.append(cu[-1] + length)
            pad.append(pad[-1] + length + (gaps if isinstance(gaps, int) else gaps[i]))
        return cu, pad

    cu_q, pad_q = layout(lq, gap_q)
    cu_kv, pad_kv = layout(lk, gap_kv)
    return ThdBatch(
        cu_q=cu_q,
        cu_kv=cu_kv,
        pad_q=pad_q,
        pad_kv=pad_kv,
        rows_q=pad_q[-1] + tail,
        rows_kv=pad_kv[-1] + tail,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=head_dim,
        dtype=dtype,
        **fields,
    )


def seed_batch(second_call: bool = True) -> ThdBatch:
    """The original report: GQA 2:1, d 8, fp16, kv [0,3,9], padded [0,4,12] for q and kv;
    cu_seqlens_q [0,1,3], then [0,0,3] (the second call has a sequence without queries)."""
    lq = [0, 3] if second_call else [1, 2]
    return make_batch(
        lq,
        [3, 6],
        heads_q=2,
        heads_kv=1,
        head_dim=8,
        dtype=torch.float16,
        gap_q=[4 - lq[0], 8 - lq[1]],
        gap_kv=[1, 2],
    )


def random_inputs(batch: ThdBatch, device: str = "cuda", seed: int = 0) -> Dict[str, torch.Tensor]:
    """Seeded ``q``, ``k``, ``v``, ``d_o`` for the batch, also stored in ``batch.tensors``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dim_v = batch.head_dim if batch.head_dim_v is None else batch.head_dim_v

    def rnd(rows: int, heads: int, dim: int) -> torch.Tensor:
        t = torch.randn(rows, heads, dim, generator=g, dtype=torch.float32)
        return t.to(device=device, dtype=batch.dtype)

    batch.tensors = {
        "q": rnd(batch.rows_q, batch.heads_q, batch.head_dim),
        "k": rnd(batch.rows_kv, batch.heads_kv, batch.head_dim),
        "v": rnd(batch.rows_kv, batch.heads_kv, dim_v),
        "d_o": rnd(batch.rows_q, batch.heads_q, dim_v),
    }
    return batch.tensors


def _fused_attn():
    from transformer_engine.pytorch.cpp_extensions import fused_attn

    return fused_attn


def _backend():
    enum = getattr(_fused_attn(), "FusedAttnBackend", None)
    if enum is None:  # older TE: the pybind enum lives in tex
        import transformer_engine_torch as tex

        return tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen
    return enum["F16_arbitrary_seqlen"]


def _common_kwargs(batch: ThdBatch, device: str) -> Dict[str, Any]:
    max_q, max_kv = batch.max_seqlens()
    t = batch.tensors
    # call_by_name drops what the installed release lacks (o_format etc. are 2.20's).
    return dict(
        q=t["q"],
        k=t["k"],
        v=t["v"],
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        fake_dtype=batch.dtype,
        fused_attention_backend=_backend(),
        attn_scale=batch.head_dim**-0.5,
        dropout=0.0,
        qkv_layout="thd_thd_thd",
        o_format="thd",
        do_format="thd",
        dqkv_layout="thd_thd_thd",
        attn_bias_type="no_bias",
        attn_mask_type=batch.mask,
        window_size=batch.window,
        bottom_right_diagonal=batch.bottom_right_diagonal,
        deterministic=False,
        **batch.offsets(device),
    )


def te_forward(batch: ThdBatch, device: str = "cuda") -> Tuple[torch.Tensor, Any]:
    """TE's ``fused_attn_fwd`` on the batch's tensors: ``(out, aux_ctx_tensors)``."""
    t = batch.tensors
    fwd = _fused_attn().fused_attn_fwd
    t["o"], t["aux"] = call_by_name(fwd, is_training=True, **_common_kwargs(batch, device))[:2]
    return t["o"], t["aux"]


def te_backward(
    batch: ThdBatch, fn: Optional[Callable] = None, device: str = "cuda", **extra: Any
) -> List[torch.Tensor]:
    """``fn`` (default: TE's current ``fused_attn_bwd``) on the batch; returns its output."""
    fn = _fused_attn().fused_attn_bwd if fn is None else fn
    t = batch.tensors
    kw = _common_kwargs(batch, device)
    if "dqkv_dtype" in _parameters(fn):  # TE 2.8
        from transformer_engine.pytorch.constants import TE_DType

        kw["dqkv_dtype"] = TE_DType[batch.dtype]
    kw.update(o=t["o"], d_o=t["d_o"], aux_ctx_tensors=t["aux"], **extra)
    return call_by_name(fn, **kw)


def te_call(batch: ThdBatch, **extra: Any) -> Dict[str, Any]:
    """TE's ``fused_attn_bwd`` arguments for the batch by name, defaults applied (as the
    wrapper binds them for the exact fallback)."""
    sig = inspect.signature(te_function())

    def bind(*args: Any, **kwargs: Any) -> Dict[str, Any]:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    bind.__signature__ = sig  # type: ignore[attr-defined]
    return te_backward(batch, fn=bind, **extra)  # type: ignore[return-value]


def poison_allocator(value: float = 1000.0, numel: int = 1 << 28, device: str = "cuda") -> None:
    """Fill a large block with ``value`` and free it, so the caching allocator hands it
    to the next large allocation (TE's workspace): the deterministic trigger."""
    torch.full((numel,), value, device=device, dtype=torch.float32)


def attention_mask(lq: int, lk: int, batch: ThdBatch) -> torch.Tensor:
    """[lq, lk] bool, True where query i attends key j (the mask's definition)."""
    from te_gqa_fix.masks import key_span

    span = key_span(batch.mask, batch.window, batch.bottom_right_diagonal)
    i = torch.arange(lq).view(-1, 1)
    j = torch.arange(lk).view(1, -1)
    allowed = torch.zeros(lq, lk, dtype=torch.bool)
    for use, s in ((span.top_left, 0), (span.bottom_right, lk - lq)):
        if use:
            ok = torch.ones(lq, lk, dtype=torch.bool)
            if span.window_left >= 0:
                ok &= j >= i + s - span.window_left
            if span.window_right >= 0:
                ok &= j <= i + s + span.window_right
            allowed |= ok
    return allowed


def reference_attention(
    batch: ThdBatch, dtype: torch.dtype = torch.float32, device: str = "cpu", grads: bool = True
) -> Dict[str, torch.Tensor]:
    """Per-sequence softmax attention and its autograd gradients in ``dtype``.

    Returns:
        ``o, dq, dk, dv`` laid out like TE's buffers, and ``lse`` ``[rows_q, heads_q]``, each
        query's log-sum-exp of its scaled scores (TE's softmax statistics); rows outside
        sequences, and queries without keys, get 0. ``grads`` False: the forward alone,
        ``o`` and ``lse`` (no backward is run).
    """
    t = {
        k: batch.tensors[k].detach().to(device=device, dtype=dtype) for k in ("q", "k", "v", "d_o")
    }
    group = batch.heads_q // batch.heads_kv
    o, dq, dk, dv = (torch.zeros_like(t[name]) for name in ("d_o", "q", "k", "v"))
    lse = torch.zeros(batch.rows_q, batch.heads_q, dtype=dtype, device=device)
    scale = batch.head_dim**-0.5
    for sq, sk, lq, lk in zip(batch.pad_q, batch.pad_kv, batch.lq, batch.lk):
        if lq == 0 or lk == 0:
            continue
        q = t["q"][sq : sq + lq].clone().requires_grad_(grads)
        k = t["k"][sk : sk + lk].clone().requires_grad_(grads)
        v = t["v"][sk : sk + lk].clone().requires_grad_(grads)
        scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(group, dim=1)) * scale
        allowed = attention_mask(lq, lk, batch).to(device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse[sq : sq + lq] = torch.logsumexp(scores, -1).t().detach().nan_to_num(0.0, 0.0, 0.0)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out = torch.einsum("hij,jhd->ihd", probs, v.repeat_interleave(group, dim=1))
        o[sq : sq + lq] = out.detach()
        if grads:
            out.backward(t["d_o"][sq : sq + lq])
            dq[sq : sq + lq] = q.grad
            dk[sk : sk + lk] = k.grad
            dv[sk : sk + lk] = v.grad
    if not grads:
        return {"o": o, "lse": lse}
    return {"o": o, "dq": dq, "dk": dk, "dv": dv, "lse": lse}


GRADS = ("dq", "dk", "dv")


def dead_masks(batch: ThdBatch, device: str = "cuda"):
    """The batch's :func:`te_gqa_fix.dead_row_masks`."""
    from te_gqa_fix import dead_row_masks

    return dead_row_masks(
        **batch.offsets(device),
        rows_q=batch.rows_q,
        rows_kv=batch.rows_kv,
        attn_mask_type=batch.mask,
        window_size=batch.window,
        bottom_right_diagonal=batch.bottom_right_diagonal,
    )


def live_q_rows(batch: ThdBatch) -> torch.Tensor:
    """Query rows that attend at least one key (their output is defined)."""
    live = torch.zeros(batch.rows_q, dtype=torch.bool)
    for start, lq, lk in zip(batch.pad_q, batch.lq, batch.lk):
        if lq and lk:
            live[start : start + lq] = attention_mask(lq, lk, batch).any(dim=1)
    return live


def references(batch: ThdBatch, device: str = "cuda") -> Dict[str, Dict[str, torch.Tensor]]:
    """The fp32 reference and the same computation in the batch's own precision."""
    return {
        "fp32": reference_attention(batch, torch.float32, device),
        "same": reference_attention(batch, batch.dtype, device),
    }


def tolerance(err_same: float, ref_max: float, dtype: torch.dtype, factor: float = 2.0) -> float:
    """The bound for an error against the fp32 reference, as in flash-attention's tests:
    ``factor`` times the error of the same computation in ``dtype`` plus 4 ulps of ``ref_max``."""
    return factor * err_same + 4 * torch.finfo(dtype).eps * max(ref_max, 1e-3)


def _max_abs(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def compare(
    batch: ThdBatch, out: Sequence[torch.Tensor], refs, factor: float = 2.0
) -> Dict[str, float]:
    """Errors of TE's (dq, dk, dv) on live rows, their bounds, and dead-row maxima."""
    device = str(out[0].device)
    dead = dead_masks(batch, device)
    live_q = live_q_rows(batch).to(device) & ~dead.q
    res: Dict[str, float] = {}
    for name, got in zip(GRADS, out[:3]):
        mask = live_q if name == "dq" else ~dead.kv
        ref = refs["fp32"][name].to(device)[mask].float()
        same = refs["same"][name].to(device)[mask].float()
        mine = got[mask].float()
        dead_rows = got[dead.q if name == "dq" else dead.kv].float()
        res[f"{name}_err"] = _max_abs(mine - ref)
        res[f"{name}_bound"] = tolerance(_max_abs(same - ref), _max_abs(ref), batch.dtype, factor)
        res[f"{name}_dead_max"] = _max_abs(dead_rows.nan_to_num(float("inf")))
        res[f"{name}_nonfinite_live"] = int((~torch.isfinite(mine)).sum().item())
    return res


def exact(res: Dict[str, float]) -> bool:
    """Every live-row error within its bound, no non-finite live value, dead rows exactly 0."""
    return all(
        res[f"{g}_err"] <= res[f"{g}_bound"]
        and res[f"{g}_dead_max"] == 0.0
        and res[f"{g}_nonfinite_live"] == 0
        for g in GRADS
    )


def corrupted(res: Dict[str, float]) -> bool:
    """Damage on rows that must be 0 (the bug's signature)."""
    return res["dk_dead_max"] > 0 or res["dv_dead_max"] > 0


def large_head_dim_batch(
    head_dim: int = 256, heads: Tuple[int, int] = (8, 2), head_dim_v: Optional[int] = None
) -> ThdBatch:
    """The head-dim case cuDNN < 9.18 gets wrong on live rows: GQA, bf16, a q-empty
    sequence, padding between sequences and tail rows."""
    return make_batch(
        [40, 0, 64, 20],
        [48, 30, 64, 20],
        heads_q=heads[0],
        heads_kv=heads[1],
        head_dim=head_dim,
        dtype=torch.bfloat16,
        gap_q=[2, 0, 4, 1],
        gap_kv=[0, 2, 0, 4],
        tail=3,
        head_dim_v=head_dim_v,
    )
