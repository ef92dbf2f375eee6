#!/usr/bin/env python3
"""The post-pass's device time next to TE's ``fused_attn_bwd``, and the wrapper's host time.

Device: TE's backward, the public ``te_gqa_fix.zero_dead_rows`` (``impl="triton"`` and
``impl="torch"``) on its real gradients, interleaved round by round while the GPU is held
busy (``torch.cuda._sleep``) so that the CUDA events read device time, not launch gaps;
medians. Host: the wrapper (``te_gqa_fix.wrapper.wrapper_for``) around a stub with TE's
signature that returns real gradients at once, against the stub itself, called by position
as TE's ``FusedAttnFunc`` calls it, on one CPU; median over rounds of the paired difference,
with the post-pass (``TE_GQA_FIX=always``) and as a pure pass-through (``TE_GQA_FIX=off``,
or the default on a cuDNN measured right, as ``te_gqa_fix.status()`` says).

    python3 benchmarks/bench_postpass.py --out postpass.json [--quick]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch
from common import by_name, cumsum, median, metadata, one_cpu, packed, write

import te_gqa_fix
from te_gqa_fix.wrapper import wrapper_for

MASK = "padding_causal_bottom_right"
WORKLOADS = {  # name: (tokens, query heads, KV heads); head dim 128, bf16
    "llama8b-8k": (8192, 32, 8),
    "llama8b-32k": (32768, 32, 8),
    "llama8b-128k": (131072, 32, 8),
    "mqa-8k": (8192, 16, 1),
    "mqa-32k": (32768, 16, 1),
}
D = 128


def dead_rows(batch: Dict[str, List[int]], rows: int) -> Dict[str, int]:
    """Rows whose true gradient is 0 under ``MASK`` (every key of a sequence with queries
    is attended): padding, the tail, and the KV rows of sequences without queries."""
    kv = q = rows - batch["pad"][-1]
    for lq, lk, a, b in zip(batch["lq"], batch["lk"], batch["pad"], batch["pad"][1:]):
        kv += (b - a) - (lk if lq else 0)
        q += (b - a) - (lq if lk else 0)
    return {"kv": kv, "q": q}


def device_us(fns: Dict[str, Callable[[], Any]], reps: int, chunk: int = 5) -> Dict[str, float]:
    """Median device time of each function, interleaved, the GPU held while Python queues."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    round_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    times: Dict[str, List[float]] = {n: [] for n in fns}
    for _ in range(0, reps, chunk):
        torch.cuda._sleep(int(min(0.2, 2 * chunk * round_s + 5e-5) * 2e9))  # ~2 GHz
        events = []
        for _ in range(chunk):
            for name, fn in fns.items():
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            times[name].append(start.elapsed_time(end) * 1e3)
    return {n: median(t) for n, t in times.items()}


def make_stub(te_bwd: Callable, out: Any) -> Callable:
    """A stand-in for TE's function with its signature that returns ``out`` at once (no
    ``__wrapped__``: the wrapper must wrap the stub, not TE's function)."""
    box = [out]

    def stub_fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
        return box[0]

    stub_fused_attn_bwd.__signature__ = inspect.signature(te_bwd)  # type: ignore[attr-defined]
    stub_fused_attn_bwd.release = box.clear  # type: ignore[attr-defined]
    return stub_fused_attn_bwd


def set_policy(value: Optional[str]) -> None:
    if value is None:
        os.environ.pop("TE_GQA_FIX", None)
    else:
        os.environ["TE_GQA_FIX"] = value


def host_us(
    te_bwd: Callable, kw: Dict[str, Any], out: Any, modes: Dict[str, Optional[str]], rounds: int
) -> Dict[str, Any]:
    """The stub's host time and, per mode (a ``TE_GQA_FIX`` value), the median over rounds
    of wrapper(stub) - stub in the same round; what one call did in each mode
    (``te_gqa_fix.call_counts``)."""
    bound = inspect.signature(te_bwd).bind(**kw)
    bound.apply_defaults()
    args = bound.args  # every argument by position, as TE 2.20 calls it
    stub = make_stub(te_bwd, out)
    wrapped = wrapper_for(stub)
    calls = {"stub": lambda: stub(*args), **{m: lambda: wrapped(*args) for m in modes}}
    did = {}
    for mode, policy in modes.items():
        set_policy(policy)
        before = te_gqa_fix.call_counts()
        returned = wrapped(*args) is out
        did[mode] = {k: v - before.get(k, 0) for k, v in te_gqa_fix.call_counts().items()}
        did[mode]["returned_stub_output"] = returned
    samples: Dict[str, List[float]] = {n: [] for n in calls}
    names = list(calls)
    gc.disable()
    try:
        with one_cpu():
            for r in range(rounds + 10):  # the first 10 rounds warm up
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    set_policy(modes.get(name))
                    t0 = time.perf_counter_ns()
                    calls[name]()
                    if r >= 10:
                        samples[name].append((time.perf_counter_ns() - t0) / 1e3)
                if r % 4 == 3:
                    torch.cuda.synchronize()  # keep the launch queue short
    finally:
        gc.enable()
        stub.release()  # type: ignore[attr-defined]
    res: Dict[str, Any] = {"stub": median(samples["stub"]), "did": did}
    for mode in modes:
        res[mode] = median([a - b for a, b in zip(samples[mode], samples["stub"])])
    return res


def run_workload(
    name: str, fa: Any, te_bwd: Callable, args: argparse.Namespace, passes_through: bool
) -> Dict[str, Any]:
    tokens, hq, hkv = WORKLOADS[name]
    batch = packed(tokens)
    i32 = dict(dtype=torch.int32, device="cuda")
    cu_q, cu_kv = torch.tensor(cumsum(batch["lq"]), **i32), torch.tensor(cumsum(batch["lk"]), **i32)
    pad = torch.tensor(batch["pad"], **i32)
    torch.manual_seed(0)
    q, d_o = (torch.randn(tokens, hq, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k, v = (torch.randn(tokens, hkv, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    max_s = -(-max(b - a for a, b in zip(batch["pad"], batch["pad"][1:])) // 64) * 64
    common = dict(
        max_seqlen_q=max_s,
        max_seqlen_kv=max_s,
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=pad,
        cu_seqlens_kv_padded=pad,
        q=q,
        k=k,
        v=v,
        fake_dtype=torch.bfloat16,
        fused_attention_backend=fa.FusedAttnBackend["F16_arbitrary_seqlen"],
        attn_scale=None,
        dropout=0.0,
        fast_zero_fill=True,
        qkv_layout="thd_thd_thd",
        o_format="thd",
        do_format="thd",
        dqkv_layout="thd_thd_thd",
        attn_bias_type="no_bias",
        attn_mask_type=MASK,
        window_size=(-1, -1),
    )
    if "dqkv_dtype" in inspect.signature(te_bwd).parameters:  # TE 2.8
        from transformer_engine.pytorch.constants import TE_DType

        common["dqkv_dtype"] = TE_DType[torch.bfloat16]
    out, aux = fa.fused_attn_fwd(**by_name(fa.fused_attn_fwd, is_training=True, **common))[:2]
    kw = by_name(te_bwd, o=out, d_o=d_o, aux_ctx_tensors=aux, **common)
    grads = [t.clone() for t in te_bwd(**kw)[:3]]
    offs = (cu_q, cu_kv, pad, pad)
    dev = device_us(
        {
            "bwd": lambda: te_bwd(**kw),
            "postpass_triton": lambda: te_gqa_fix.zero_dead_rows(
                *grads, *offs, attn_mask_type=MASK, impl="triton"
            ),
            "postpass_torch": lambda: te_gqa_fix.zero_dead_rows(
                *grads, *offs, attn_mask_type=MASK, impl="torch"
            ),
        },
        args.reps,
    )
    # Pass-through: the default where the cuDNN was measured right, else the policy off.
    passthrough = None if passes_through else "off"
    host = host_us(
        te_bwd, kw, te_bwd(**kw), {"postpass": "always", "passthrough": passthrough}, args.rounds
    )
    dead = dead_rows(batch, tokens)
    return {
        "name": name,
        "tokens": tokens,
        "heads": f"{hq}/{hkv}",
        "d": D,
        "dtype": "bf16",
        "mask": MASK,
        "batch": batch,
        "dead_rows": dead,
        "bytes_to_write": 2 * (dead["kv"] * hkv * 2 + dead["q"] * hq) * D,
        "device_us": dev,
        "host_us": host,
        "passthrough_via": (
            "TE_GQA_FIX=auto (cuDNN measured right)" if passes_through else "TE_GQA_FIX=off"
        ),
    }


def copy_bandwidth_GBps(reps: int) -> float:
    """Device-to-device copy on 1 GiB, as read + write traffic."""
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = device_us({"copy": lambda: dst.copy_(src)}, reps)["copy"]
    return 2 * src.numel() / us / 1e3


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="postpass.json", help="the JSON file to write")
    ap.add_argument("--quick", action="store_true", help="no 128K workload, fewer repetitions")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--reps", type=int, default=None, help="timed calls per device timing")
    ap.add_argument("--rounds", type=int, default=1000, help="rounds of the host timing")
    args = ap.parse_args(argv)
    names = args.workloads.split(",")
    if args.quick:
        names = [n for n in names if not n.endswith("128k")]
    args.reps = args.reps or (10 if args.quick else 20)
    # TE first: it loads its cuDNN before anything in torch initialises another one.
    from transformer_engine.pytorch.cpp_extensions import fused_attn as fa

    te_gqa_fix.uninstall()  # TE's own function, even under the start-up hook
    doc = {"bench": "postpass", **metadata()}
    # The rule for head dims up to 128, this GPU and the cuDNN TE runs.
    passes_through = te_gqa_fix.status().verdict == "right"
    policy = os.environ.get("TE_GQA_FIX")
    try:
        doc["copy_GBps"] = copy_bandwidth_GBps(args.reps)
        doc["workloads"] = []
        for name in names:
            doc["workloads"].append(run_workload(name, fa, fa.fused_attn_bwd, args, passes_through))
            w = doc["workloads"][-1]
            print(
                f"{name}: bwd {w['device_us']['bwd']:.0f} us, post-pass "
                f"{w['device_us']['postpass_triton']:.1f} us, host +{w['host_us']['postpass']:.1f} "
                f"/ +{w['host_us']['passthrough']:.1f} us"
            )
            torch.cuda.empty_cache()
    finally:
        set_policy(policy)
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
