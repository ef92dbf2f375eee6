"""The original report (TE issue #2448), adapted to the installed TE: the bug and the fix.

Two calls of TE's ``fused_attn_fwd``/``fused_attn_bwd`` on packed THD input with 2 query
heads and 1 KV head (GQA), head dim 8, fp16, ``padding_causal``: first with
cu_seqlens_q [0,1,3], then [0,0,3] (sequence 0 has no query tokens), kv [0,3,9], padded
offsets [0,4,12]. Right before each backward a 1 GiB block of 1000.0 is allocated and
freed, so PyTorch's caching allocator hands it to TE's workspace: on Hopper with cuDNN
older than 9.18 the dK/dV rows of the query-less sequence then read 1000 x group size
instead of 0. Each backward runs twice, through TE's own function and through
``te_gqa_fix.fused_attn_bwd``, and both are compared with an fp32 PyTorch reference.

Arguments are bound by name (TE 2.8 has ``dqkv_dtype``; 2.20 has ``o_format``,
``do_format``, ``dqkv_layout``, ...): see :func:`by_name`. The drop-in takes exactly the
arguments TE's function takes, so both backward calls get the same ones.

Run on a GPU machine with TE:  python examples/seed_repro.py
Exit status: 0 when the fixed result is exact, 1 when it is not, 2 (one line on stderr
naming it) where a CUDA GPU or Transformer Engine is missing.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Dict, List

import torch


def by_name(fn: Callable, **kwargs: Any) -> Dict[str, Any]:
    """The keyword arguments that ``fn``'s signature has (the others are dropped), so one
    set of arguments fits TE 2.8 through 2.20."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def reference(q, k, v, d_o, cu_q, cu_kv, pad, scale) -> Dict[str, torch.Tensor]:
    """fp32 attention per sequence (top-left causal, GQA) and its autograd gradients."""
    q32, k32, v32, do32 = (t.detach().float().cpu() for t in (q, k, v, d_o))
    grads = {"dq": torch.zeros_like(q32), "dk": torch.zeros_like(k32), "dv": torch.zeros_like(v32)}
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        if lq == 0 or lk == 0:
            continue  # no queries (or no keys): the true gradient is 0
        s = pad[b]
        qq = q32[s : s + lq].clone().requires_grad_(True)
        kk = k32[s : s + lk].clone().requires_grad_(True)
        vv = v32[s : s + lk].clone().requires_grad_(True)
        scores = torch.einsum("ihd,jhd->hij", qq, kk.repeat_interleave(group, 1)) * scale
        causal = torch.ones(lq, lk, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out = torch.einsum("hij,jhd->ihd", probs, vv.repeat_interleave(group, 1))
        out.backward(do32[s : s + lq])
        grads["dq"][s : s + lq] = qq.grad
        grads["dk"][s : s + lk] = kk.grad
        grads["dv"][s : s + lk] = vv.grad
    return grads


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
        print(f"seed_repro: needs {'; '.join(lacking)}", file=sys.stderr)
        return 2
    import transformer_engine
    from transformer_engine.pytorch.cpp_extensions import fused_attn as te_fa

    import te_gqa_fix

    te_gqa_fix.uninstall()  # TE's own function, even where the start-up hook installed the fix
    te_bwd = te_fa.fused_attn_bwd
    backend = te_fa.FusedAttnBackend["F16_arbitrary_seqlen"]
    extra: Dict[str, Any] = {}
    if "dqkv_dtype" in inspect.signature(te_bwd).parameters:  # TE 2.8
        from transformer_engine.pytorch.constants import TE_DType

        extra["dqkv_dtype"] = TE_DType[torch.float16]

    dev, rows, hq, hk, d = "cuda", 12, 2, 1, 8
    torch.manual_seed(42)
    i32 = dict(dtype=torch.int32, device=dev)
    cu_kv_l, pad_l = [0, 3, 9], [0, 4, 12]
    failures: List[str] = []
    print(f"GPU {torch.cuda.get_device_name()}, TE {transformer_engine.__version__}, ", end="")
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        print(f"cuDNN (as TE runs it) {'.'.join(map(str, get_cudnn_version()))}")
    except Exception:
        print("cuDNN unknown")
    header = (
        "call",
        "cu_seqlens_q",
        "variant",
        "max|dK| rows 0-3",
        "max|dV| rows 0-3",
        "err vs fp32",
    )
    print(
        f"{header[0]:<6}{header[1]:<14}{header[2]:<12}{header[3]:>18}{header[4]:>18}{header[5]:>17}"
    )
    for step, cu_q_l in enumerate(([0, 1, 3], [0, 0, 3])):
        q = torch.randn(rows, hq, d, dtype=torch.float16, device=dev)
        k = torch.randn(rows, hk, d, dtype=torch.float16, device=dev)
        v = torch.randn(rows, hk, d, dtype=torch.float16, device=dev)
        d_o = torch.randn(rows, hq, d, dtype=torch.float16, device=dev)
        common: Dict[str, Any] = dict(
            max_seqlen_q=64,
            max_seqlen_kv=64,
            cu_seqlens_q=torch.tensor(cu_q_l, **i32),
            cu_seqlens_kv=torch.tensor(cu_kv_l, **i32),
            cu_seqlens_q_padded=torch.tensor(pad_l, **i32),
            cu_seqlens_kv_padded=torch.tensor(pad_l, **i32),
            q=q,
            k=k,
            v=v,
            fake_dtype=torch.float16,
            fused_attention_backend=backend,
            attn_scale=d**-0.5,
            dropout=0.0,
            qkv_layout="thd_thd_thd",
            o_format="thd",
            do_format="thd",
            dqkv_layout="thd_thd_thd",
            attn_bias_type="no_bias",
            attn_mask_type="padding_causal",
            window_size=(-1, 0),
            **extra,
        )
        out, aux = te_fa.fused_attn_fwd(
            **by_name(te_fa.fused_attn_fwd, is_training=True, **common)
        )[:2]
        bwd_args = by_name(te_bwd, o=out, d_o=d_o, aux_ctx_tensors=aux, **common)
        ref = reference(q, k, v, d_o, cu_q_l, cu_kv_l, pad_l, d**-0.5)
        # Rows whose true dK/dV is 0: every row of a sequence without queries, padding.
        zero_rows = (ref["dk"].abs().amax(dim=(1, 2)) == 0) & (
            ref["dv"].abs().amax(dim=(1, 2)) == 0
        )
        for variant, fn in (("TE", te_bwd), ("te-gqa-fix", te_gqa_fix.fused_attn_bwd)):
            block = torch.full((1 << 28,), 1000.0, device=dev)  # poison the allocator
            del block
            dq, dk, dv = fn(**bwd_args)[:3]
            dq, dk, dv = (t.float().cpu() for t in (dq, dk, dv))
            err = max(
                float((a - ref[n]).abs().max()) for a, n in ((dq, "dq"), (dk, "dk"), (dv, "dv"))
            )
            dk03, dv03 = float(dk[:4].abs().max()), float(dv[:4].abs().max())
            print(f"{step + 1:<6}{cu_q_l!s:<14}{variant:<12}{dk03:>18.4g}{dv03:>18.4g}{err:>17.3g}")
            if variant == "te-gqa-fix":
                if not (bool((dk[zero_rows] == 0).all()) and bool((dv[zero_rows] == 0).all())):
                    failures.append(f"call {step + 1}: rows whose gradient is 0 are not 0")
                if not err < 5e-2:
                    failures.append(f"call {step + 1}: max error {err:.3g} vs fp32")
    if failures:
        print("FIXED RESULT WRONG:\n  " + "\n  ".join(failures))
        return 1
    print("te-gqa-fix: exact (rows whose true gradient is 0 are 0; the rest match fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
