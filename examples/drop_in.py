"""Drop-in: your own attention autograd function calls ``te_gqa_fix.fused_attn_bwd``.

Frameworks with their own attention ``torch.autograd.Function`` (instead of TE's
``DotProductAttention``) call TE's ``fused_attn_fwd``/``fused_attn_bwd`` directly. The
only change is the import of the backward: ``te_gqa_fix.fused_attn_bwd`` takes exactly
what the installed TE's function takes (positional or keyword, TE 2.8 to 2.20), calls it
unchanged and zeroes, in place and without a host sync, the dK/dV (and dQ) rows whose
true gradient is 0. Nothing else in the process is patched.

Run on a GPU machine with TE:  python examples/drop_in.py
Exit status: 0 when the rows of the query-less sequence are 0, 1 when not, 2 (one line on
stderr naming it) where a CUDA GPU or Transformer Engine is missing.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Dict, List

import torch

# -    from transformer_engine.pytorch.cpp_extensions import fused_attn_bwd
# +    from te_gqa_fix import fused_attn_bwd
from te_gqa_fix import fused_attn_bwd


def _kwargs_for(fn: Any, **kwargs: Any) -> Dict[str, Any]:
    """Keep the arguments ``fn`` has (TE's signature differs between releases)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


class ThdGqaAttention(torch.autograd.Function):
    """Packed (THD) causal attention with grouped KV heads on TE's cuDNN backend."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_kv, padded_q, padded_kv, max_seqlen):
        from transformer_engine.pytorch.cpp_extensions import fused_attn as te_fa

        meta: Dict[str, Any] = dict(
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=padded_q,
            cu_seqlens_kv_padded=padded_kv,
            fake_dtype=q.dtype,
            fused_attention_backend=te_fa.FusedAttnBackend["F16_arbitrary_seqlen"],
            attn_scale=q.shape[-1] ** -0.5,
            dropout=0.0,
            qkv_layout="thd_thd_thd",
            o_format="thd",
            do_format="thd",
            dqkv_layout="thd_thd_thd",
            attn_bias_type="no_bias",
            attn_mask_type="padding_causal",
            window_size=(-1, 0),
        )
        fwd = te_fa.fused_attn_fwd
        out, aux = fwd(**_kwargs_for(fwd, is_training=True, q=q, k=k, v=v, **meta))[:2]
        if "dqkv_dtype" in inspect.signature(te_fa.fused_attn_bwd).parameters:  # TE 2.8
            from transformer_engine.pytorch.constants import TE_DType

            meta["dqkv_dtype"] = TE_DType[q.dtype]
        ctx.save_for_backward(q, k, v, out, *aux)
        ctx.n_aux = len(aux)
        ctx.meta = _kwargs_for(te_fa.fused_attn_bwd, **meta)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, *aux = ctx.saved_tensors
        dq, dk, dv = fused_attn_bwd(
            q=q,
            k=k,
            v=v,
            o=out,
            d_o=d_out.contiguous(),
            aux_ctx_tensors=list(aux),
            **ctx.meta,
        )[:3]
        return dq, dk, dv, None, None, None, None, None


def missing() -> List[str]:
    """What this example needs that this machine lacks."""
    out = [] if torch.cuda.is_available() else ["a CUDA GPU"]
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # not installed, or a broken build
        out.append(f"Transformer Engine ({type(exc).__name__}: {' '.join(str(exc).split())})")
    return out


def main() -> int:
    lacking = missing()
    if lacking:
        print(f"drop_in: needs {'; '.join(lacking)}", file=sys.stderr)
        return 2
    dev = "cuda"
    i32 = dict(dtype=torch.int32, device=dev)
    # Sequence 0 has no query tokens this step (as in context parallelism).
    cu_q = torch.tensor([0, 0, 3], **i32)
    cu_kv = torch.tensor([0, 3, 9], **i32)
    padded = torch.tensor([0, 4, 12], **i32)
    q = torch.randn(12, 8, 64, dtype=torch.bfloat16, device=dev, requires_grad=True)
    k = torch.randn(12, 2, 64, dtype=torch.bfloat16, device=dev, requires_grad=True)
    v = torch.randn(12, 2, 64, dtype=torch.bfloat16, device=dev, requires_grad=True)
    out = ThdGqaAttention.apply(q, k, v, cu_q, cu_kv, padded, padded, 64)
    block = torch.full((1 << 28,), 1000.0, device=dev)  # stale memory for TE's workspace
    del block
    out.backward(torch.randn_like(out))
    rows = float(k.grad[:4].abs().max()), float(v.grad[:4].abs().max())
    print(f"max |dK|, |dV| on the rows of the query-less sequence: {rows[0]}, {rows[1]}")
    return 0 if rows == (0.0, 0.0) else 1


if __name__ == "__main__":
    sys.exit(main())
