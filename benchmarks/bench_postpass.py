#!/usr/bin/env python3
"""What the te-gqa-fix post-pass costs next to TE's ``fused_attn_bwd`` and the workarounds.

Run on a CUDA machine with Transformer Engine (written against TE 2.20.2), from the repo
root::

    source .gpu-kit/env.sh && python benchmarks/bench_postpass.py            # all workloads
    source .gpu-kit/env.sh && python benchmarks/bench_postpass.py --quick    # tight budget

It writes ``bench.json`` and ``bench.md`` into ``--out`` (default ``$OUT``, else
``./bench-out``) and prints the main table. Every workload, and every measurement in
it, is independent: a failure is recorded in the output and the rest still runs.

Timing: CUDA events, warm-up first, median of many calls.

* ``device`` mode (GPU-only work): the GPU is first kept busy by ``torch.cuda._sleep``
  so that Python has queued all the timed calls before they run; the events then read
  the device time alone, without host launch gaps. The host time per call (queued,
  no sync) is reported next to it.
* ``wall`` mode (workarounds that block the host: ``torch.cuda.empty_cache()``, a loop
  over ``cu_seqlens.tolist()``): the GPU is idle before each call and the events read
  everything, host stalls included. These are compared with the wrapper in the same
  mode.
* ``host`` mode (no sync inside a timed call, calls interleaved, paired medians): TE's
  call against the wrapper (post-pass and pass-through forced), and, directly, a stub
  with TE's signature returning real gradients against the wrapper of that stub, which
  isolates what the wrapper adds from TE's call-to-call variation (``make_stub``).

Physical bound: the bytes the post-pass must write (dead dK/dV rows x heads x dim x
element size, plus dead dQ rows) divided by the device-to-device copy bandwidth measured
in the same run (traffic: 2 x bytes copied / time).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import te_gqa_fix  # noqa: E402
from te_gqa_fix import c_launch, guard, triton_postpass  # noqa: E402
from te_gqa_fix.masks import KeySpan, key_interval, key_span  # noqa: E402
from te_gqa_fix.postpass import zero_dead_rows  # noqa: E402
from te_gqa_fix.reproduce import call_by_name  # noqa: E402
from te_gqa_fix.wrapper import wrapper_for  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_report  # noqa: E402

ENV_KEYS = ("GPU_KIT_CUDNN", "TE_GQA_FIX", "TE_GQA_FIX_VALIDATE")
CLOCK_HZ = 1.98e9  # H200 boost clock, only used to size torch.cuda._sleep
MAX_SLEEP_S = 0.2

# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    h_q: int
    h_kv: int
    d: int
    dtype: str
    mask: str
    lq: List[int]
    lk: List[int]
    pad: List[int]  # padded offsets, shared by Q and KV (TE's context-parallel convention)
    rows: int
    target_pct: Optional[float] = None  # post-pass / fused_attn_bwd target, percent

    @property
    def tokens(self) -> int:
        return self.rows

    def cu(self, lengths: List[int]) -> List[int]:
        out = [0]
        for n in lengths:
            out.append(out[-1] + n)
        return out


def cp_workload(
    name: str, tokens: int, h_q: int, h_kv: int, d: int, mask: str, cp: int = 2, target=None
) -> Workload:
    """A context-parallel-style step: 8 sequences of varied lengths packed as THD.

    Sequences 1 and 4 have no query tokens on this step (their KV rows are the ones the
    bug poisons); sequence 3 has half its queries; each sequence is padded to a multiple
    of 2 x cp, two of them with an extra padding gap; the rows after the last sequence
    (about 3% of the buffer) are tail rows.
    """
    fractions = [0.22, 0.08, 0.18, 0.05, 0.15, 0.12, 0.10, 0.10]
    mult = 2 * cp
    lk, lq, pad = [], [], [0]
    for b, f in enumerate(fractions):
        n = max(1, int(f * tokens * 0.97) - 1 - (b % 3))
        lk.append(n)
        lq.append(0 if b in (1, 4) else (n // 2 if b == 3 else n))
        room = -(-n // mult) * mult + (mult if b in (2, 5) else 0)
        pad.append(pad[-1] + room)
    if pad[-1] > tokens:
        raise ValueError(f"{name}: {pad[-1]} padded rows exceed {tokens}")
    return Workload(name, h_q, h_kv, d, "bfloat16", mask, lq, lk, pad, tokens, target)


def all_workloads(mask: str) -> Dict[str, Workload]:
    wl = {
        # The seed script's shape: q-empty first sequence, padded offsets [0, 4, 12].
        "seed": Workload("seed", 2, 1, 8, "float16", mask, [0, 3], [3, 6], [0, 4, 12], 12),
        "llama8b-8k": cp_workload("llama8b-8k", 8192, 32, 8, 128, mask, target=3.0),
        "llama8b-32k": cp_workload("llama8b-32k", 32768, 32, 8, 128, mask, target=1.0),
        "llama8b-128k": cp_workload("llama8b-128k", 131072, 32, 8, 128, mask),
        "mqa-8k": cp_workload("mqa-8k", 8192, 16, 1, 128, mask),
        "mqa-32k": cp_workload("mqa-32k", 32768, 16, 1, 128, mask),
    }
    return wl


FULL = ["seed", "llama8b-8k", "llama8b-32k", "llama8b-128k", "mqa-8k", "mqa-32k"]
QUICK = ["seed", "llama8b-8k", "llama8b-32k", "mqa-8k"]


def dead_rows(wl: Workload, span: KeySpan) -> Tuple[int, int]:
    """(dead KV rows, dead Q rows), counted on the host from the lists (reference)."""
    cu_q, cu_kv = wl.cu(wl.lq), wl.cu(wl.lk)
    kv = wl.pad[0] + (wl.rows - wl.pad[-1])
    q = kv
    for b in range(len(wl.lq)):
        room = wl.pad[b + 1] - wl.pad[b]
        lq, lk = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        lo, hi = key_interval(lq, lk, span)
        kv += room - max(0, hi - lo)
        q += room - (lq if lk > 0 else 0)
    return kv, q


# --------------------------------------------------------------------------- timing


def _median_us(times_ms: List[float]) -> float:
    return statistics.median(times_ms) * 1e3


def _stats(times_ms: List[float], mode: str, host_s: Optional[float] = None) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "median_us": _median_us(times_ms),
        "min_us": min(times_ms) * 1e3,
        "max_us": max(times_ms) * 1e3,
        "n": len(times_ms),
        "mode": mode,
    }
    if host_s is not None:
        out["host_us"] = host_s * 1e6
    return out


def _rotated(names: List[str], r: int) -> List[str]:
    r %= len(names)
    return names[r:] + names[:r]


def time_device_group(
    fns: Dict[str, Callable[[], Any]], reps: int, warmup: int, chunk: int = 5
) -> Dict[str, Dict[str, Any]]:
    """Device time per call of each function, interleaved round by round.

    The GPU sleeps while the host queues ``chunk`` rounds (one call of each function,
    in rotating order, so clock or thermal drift hits all alike); the events then read
    device time only. ``host_us`` is the median host time to queue one call.
    """
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for n in names:
        fns[n]()
    round_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    times: Dict[str, List[float]] = {n: [] for n in names}
    hosts: Dict[str, List[float]] = {n: [] for n in names}
    done = 0
    while done < reps:
        k = min(chunk, reps - done)
        torch.cuda._sleep(int(min(MAX_SLEEP_S, 2.0 * k * round_s + 50e-6) * CLOCK_HZ))
        recorded = []
        for i in range(k):
            for n in _rotated(names, done + i):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                h0 = time.perf_counter()
                start.record()
                fns[n]()
                end.record()
                hosts[n].append(time.perf_counter() - h0)
                recorded.append((n, start, end))
        torch.cuda.synchronize()
        for n, start, end in recorded:
            times[n].append(start.elapsed_time(end))
        done += k
    return {n: _stats(times[n], "device", statistics.median(hosts[n])) for n in names}


def time_wall_group(
    fns: Dict[str, Callable[[], Any]], reps: int, warmup: int
) -> Dict[str, Dict[str, Any]]:
    """Everything between two events on an idle GPU, host stalls included; interleaved."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    torch.cuda.synchronize()
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(reps):
        for n in _rotated(names, r):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[n]()
            end.record()
            torch.cuda.synchronize()
            times[n].append(start.elapsed_time(end))
    return {n: _stats(times[n], "wall") for n in names}


def time_host_group(
    fns: Dict[str, Callable[[], Any]],
    setups: Dict[str, Callable[[], None]],
    rounds: int,
    chunk: int = 4,
    warmup: int = 1,
    sync: Callable[[], None] = torch.cuda.synchronize,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> Dict[str, Dict[str, Any]]:
    """Host time of one call of each function (no sync inside), interleaved round by round.

    The first name is the reference: ``overhead_us`` of every other one is the median over
    rounds of (its time - the reference's time in the same round), which cancels the drift
    that separate medians of two ~150 us quantities would keep. ``setups[name]`` runs
    untimed before each call (it flips the cached cuDNN decision for the pass-through).
    The GPU runs behind the host; a sync every ``chunk`` rounds keeps its queue short so a
    full launch queue never blocks (and inflates) a timed call. GC is off while timing.
    ``warmup`` untimed rounds come first. ``sync`` and ``clock`` (nanoseconds) are
    parameters so that the selftest can run this on CPU with a fake clock.
    """
    import gc

    names = list(fns)
    for _ in range(warmup):
        for n in names:
            setups[n]()
            fns[n]()
    sync()
    samples: Dict[str, List[float]] = {n: [] for n in names}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            for n in _rotated(names, r):
                setups[n]()
                t0 = clock()
                fns[n]()
                samples[n].append((clock() - t0) / 1e3)
            if (r + 1) % chunk == 0:
                sync()
    finally:
        if gc_was:
            gc.enable()
    sync()
    ref = samples[names[0]]
    out: Dict[str, Dict[str, Any]] = {}
    for n in names:
        xs = sorted(samples[n])
        out[n] = {
            "median_us": statistics.median(xs),
            "p10_us": xs[len(xs) // 10],
            "p90_us": xs[(9 * len(xs)) // 10],
            "n": len(xs),
            "mode": "host",
        }
        if n != names[0]:
            out[n]["overhead_us"] = statistics.median(a - b for a, b in zip(samples[n], ref))
    return out


def positional(te_fn: Callable, kwargs: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
    """``kwargs`` as TE's own call site passes them: by position, in ``te_fn``'s order.

    TE 2.20's ``FusedAttnFunc.backward`` calls ``fused_attn_bwd`` with all 33 arguments
    by position; the host timings call the same way, so neither TE's nor the wrapper's
    time includes forwarding a keyword dict that TE never builds.
    """
    bound = inspect.signature(te_fn).bind(**kwargs)
    # Without the defaults, ``args`` stops at the first parameter not given and the rest
    # stay keywords; TE passes every one of them.
    bound.apply_defaults()
    return tuple(bound.args), dict(bound.kwargs)


def make_stub(te_fn: Callable, out: Any) -> Callable:
    """A stand-in for TE's ``fused_attn_bwd`` that returns ``out`` (the same object) at once.

    For the direct host measurement: ``wrapper_for(stub)`` minus ``stub`` is what the
    wrapper itself adds (its Python and, in post-pass mode, its kernel launch on the real
    gradients in ``out``), without TE's call and its +-5 us of call-to-call variation.

    The stub carries TE's signature as ``__signature__``, which ``inspect.signature`` (and
    so the wrapper's argument binder) reads, but neither ``__wrapped__`` nor our wrapper
    marker: ``functools.wraps(te_fn)`` would copy both when ``te_fn`` is already our
    wrapper, and ``wrapper_for`` would then unwrap the stub to TE's function and hand back
    TE's wrapper, timing TE instead of the stub.

    ``stub.release()`` drops ``out`` (``wrapper_for`` keeps the stub's wrapper, and so the
    stub, for the life of the process; the gradients are up to 1.5 GB).
    """
    sig = inspect.signature(te_fn)
    box = [out]

    def stub_fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
        return box[0]

    stub_fused_attn_bwd.__signature__ = sig  # type: ignore[attr-defined]
    stub_fused_attn_bwd.release = box.clear  # type: ignore[attr-defined]
    return stub_fused_attn_bwd


def time_direct(
    te_fn: Callable,
    out: Any,
    kwargs: Dict[str, Any],
    modes: Dict[str, Callable[[], None]],
    rounds: int,
    warmup: int = 10,
    before: Optional[Callable[[], Any]] = None,
    suffix: str = "",
    **timer: Any,
) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Dict[str, Any]]]:
    """Host time the wrapper adds around a stub of ``te_fn`` returning ``out``, per mode.

    ``modes`` maps a timing name to the setup that puts the wrapper in that mode (the
    cached cuDNN decision). Returns the timings (``stub_host``, the reference, then each
    mode with ``overhead_us`` = paired median of wrapper(stub) - stub) and, per mode, what
    one call did (the wrapper's call counters and whether it returned the stub's object):
    the proof that the post-pass mode ran the post-pass and the pass-through did not.
    ``timer`` goes to :func:`time_host_group` (``sync``, ``clock``, ``chunk``).

    ``before`` (untimed) runs before every timed call, the stub's included, and
    ``suffix`` goes on every timing name: with TE's own call as ``before``, the wrapper
    runs in the state TE's call leaves the host in (its caches full of TE's work), as
    in training, where back-to-back calls around a stub keep the wrapper's code and data
    hot. The difference between the two is what the paired overhead adds to the direct.
    """
    from te_gqa_fix import call_counts

    stub = make_stub(te_fn, out)
    wrapped = wrapper_for(stub)
    pos, rest = positional(te_fn, kwargs)

    def stub_call() -> Any:
        return stub(*pos, **rest)

    def wrapper_call() -> Any:
        return wrapped(*pos, **rest)

    checks: Dict[str, Dict[str, Any]] = {}
    fns: Dict[str, Callable[[], Any]] = {"stub_host" + suffix: stub_call}
    setups: Dict[str, Callable[[], None]] = {"stub_host" + suffix: then(lambda: None, before)}
    try:
        for name, setup in modes.items():
            setup()
            counted = call_counts()
            got = wrapper_call()
            after = call_counts()
            checks[name + suffix] = {k: after[k] - counted[k] for k in after}
            checks[name + suffix]["returned_stub_output"] = got is out
            fns[name + suffix], setups[name + suffix] = wrapper_call, then(setup, before)
        return time_host_group(fns, setups, rounds, warmup=warmup, **timer), checks
    finally:
        stub.release()  # type: ignore[attr-defined]


def time_device(fn: Callable[[], Any], reps: int, warmup: int) -> Dict[str, Any]:
    return time_device_group({"f": fn}, reps, warmup)["f"]


def time_wall(fn: Callable[[], Any], reps: int, warmup: int) -> Dict[str, Any]:
    return time_wall_group({"f": fn}, reps, warmup)["f"]


def then(setup: Callable[[], None], before: Optional[Callable[[], Any]]) -> Callable[[], None]:
    """A timing's untimed setup followed by ``before`` (say an untimed call of TE's own
    function, to time the next call in the state it leaves the host in); ``setup`` alone
    when ``before`` is None."""
    if before is None:
        return setup

    def both() -> None:
        setup()
        before()

    return both


def check_no_sync(fn: Callable[[], Any]) -> str:
    """'ok' when ``fn`` runs under ``torch.cuda.set_sync_debug_mode("error")``."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        result = "ok"
    except RuntimeError as exc:
        result = "SYNC: " + str(exc).splitlines()[0][:160]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return result


#: When this process started timing (for :func:`host_context`).
T_START = time.monotonic()


def thread_cpu() -> Dict[str, int]:
    """CPU time (clock ticks, user + system) of each of this process's threads so far,
    by ``"tid:name"`` (the main thread's tid is the pid); empty without ``/proc``."""
    out: Dict[str, int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
            fields = tail.split()  # from the state on: utime and stime are the 12th, 13th
            out[f"{tid}:{head.split('(', 1)[1]}"] = int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return out


def cpu_steal() -> Dict[str, int]:
    """Steal time (clock ticks: time the hypervisor ran something else while this virtual
    CPU wanted to run) of each CPU so far, by ``"cpuN"``; empty without ``/proc/stat``."""
    out: Dict[str, int] = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name.startswith("cpu") and name != "cpu" and len(values) >= 8:
                    out[name] = int(values[7])
    except (OSError, ValueError):
        pass
    return out


def host_snapshot() -> Tuple[float, Dict[str, int], Dict[str, int]]:
    """What :func:`host_context` compares with: now, the threads' CPU times, the CPUs'
    steal times."""
    return time.monotonic(), thread_cpu(), cpu_steal()


def host_context(
    start: float = T_START, since: Optional[Tuple[float, Dict[str, int], Dict[str, int]]] = None
) -> Dict[str, Any]:
    """What else the host was doing when a workload's host times were taken: seconds
    since the run started, the load average, this process's threads and child processes,
    and with ``since`` (:func:`host_snapshot` taken before the timings) the share of one
    CPU each of its busiest threads used over them, and the largest share of that time
    any CPU lost to the hypervisor (steal).

    Why: in several runs the host times of the workloads timed in a process's first
    20 s or so (TE's own call and the stub included) read 1.5x those of the rest; these
    say whether that was other load, helper processes (compile workers) or a thread of
    this process competing with the timed one.
    """
    out: Dict[str, Any] = {"t_s": round(time.monotonic() - start, 1)}
    if since is not None:
        t0, ticks0, steal0 = since
        elapsed = max(time.monotonic() - t0, 1e-6) * os.sysconf("SC_CLK_TCK")
        busy = {n: (t - ticks0.get(n, 0)) / elapsed for n, t in thread_cpu().items()}
        top = sorted(busy.items(), key=lambda kv: -kv[1])[:4]
        out["thread_cpu_share"] = {n: round(v, 2) for n, v in top if v > 0}
        steal = [(t - steal0.get(n, t)) / elapsed for n, t in cpu_steal().items()]
        out["steal_share_max"] = round(max(steal, default=0.0), 3)
    try:
        out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        out["threads"] = len(os.listdir("/proc/self/task"))
        me, kids = str(os.getpid()), 0
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        kids += f.read().rsplit(")", 1)[1].split()[1] == me
                except OSError:
                    continue
        out["children"] = kids
    except (OSError, AttributeError):  # not Linux: the time alone
        pass
    return out


def bandwidth(reps: int) -> Dict[str, float]:
    """Device-to-device copy and fill bandwidth on a 1 GiB buffer."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    copy = time_device(lambda: dst.copy_(src), reps, 3)
    fill = time_device(lambda: dst.zero_(), reps, 3)
    return {
        "bytes": n,
        "copy_us": copy["median_us"],
        "copy_traffic_GBps": 2 * n / copy["median_us"] / 1e3,
        "fill_us": fill["median_us"],
        "fill_GBps": n / fill["median_us"] / 1e3,
    }


# --------------------------------------------------------------------------- TE calls


def _call_kwargs(fn: Callable, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments ``fn`` accepts, filtered once.

    The timed backward calls need a fixed dict (``reproduce.call_by_name`` filters on
    every call, which would add its own Python to the host times being compared).
    """
    names = set(inspect.signature(fn).parameters)
    return {k: v for k, v in kwargs.items() if k in names}


class TE:
    def __init__(self) -> None:
        from transformer_engine.pytorch.cpp_extensions import fused_attn as fa

        from te_gqa_fix.te_compat import find_original

        self.module = fa
        self.fwd = fa.fused_attn_fwd
        self.original = find_original(fa)
        self.wrapper = wrapper_for(self.original)
        self.backend = fa.FusedAttnBackend["F16_arbitrary_seqlen"]


def _common(wl: Workload, cu_q, cu_kv, pad, max_s: int) -> Dict[str, Any]:
    return dict(
        max_seqlen_q=max_s,
        max_seqlen_kv=max_s,
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=pad,
        cu_seqlens_kv_padded=pad,
        attn_scale=None,
        dropout=0.0,
        fast_zero_fill=True,
        qkv_layout="thd_thd_thd",
        o_format="thd",
        do_format="thd",
        dqkv_layout="thd_thd_thd",
        attn_bias_type="no_bias",
        attn_mask_type=wl.mask,
        window_size=(-1, -1),
        deterministic=False,
    )


def backward_arguments(
    wl: Workload, te: Any, randn: Callable[..., torch.Tensor], device: str = "cuda"
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(common, bwd_kw)`` of one workload, the one recipe for what the benchmarks pass
    TE: ``wl``'s offsets on ``device`` and the arguments both directions share
    (:func:`_common`), then q, k, v and d_o from ``randn(*shape)`` in that order, TE's
    forward (``te.fwd``) run once on them, and the keyword arguments TE's backward
    (``te.original``) takes, with that forward's output and auxiliary tensors.
    """
    i32 = dict(dtype=torch.int32, device=device)
    cu_q, cu_kv = torch.tensor(wl.cu(wl.lq), **i32), torch.tensor(wl.cu(wl.lk), **i32)
    pad = torch.tensor(wl.pad, **i32)
    max_s = -(-max(b - a for a, b in zip(wl.pad[:-1], wl.pad[1:])) // 64) * 64
    q = randn(wl.rows, wl.h_q, wl.d)
    k, v = randn(wl.rows, wl.h_kv, wl.d), randn(wl.rows, wl.h_kv, wl.d)
    d_o = randn(wl.rows, wl.h_q, wl.d)
    common = _common(wl, cu_q, cu_kv, pad, max_s)
    out, aux = call_by_name(
        te.fwd, **common, is_training=True, q=q, k=k, v=v, fake_dtype=q.dtype,
        fused_attention_backend=te.backend,
    )[:2]  # fmt: skip
    bwd_kw = _call_kwargs(
        te.original,
        dict(common, q=q, k=k, v=v, o=out, d_o=d_o, fake_dtype=q.dtype, aux_ctx_tensors=aux,
             fused_attention_backend=te.backend),
    )  # fmt: skip
    return common, bwd_kw


# --------------------------------------------------------------------------- workarounds


def make_python_loop(
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    pad_q: torch.Tensor,
    pad_kv: torch.Tensor,
    span: KeySpan,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The obvious user fix: read the offsets on the host (sync), zero slices in a loop."""

    def run(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        cq, ck, pq, pk = cu_q.tolist(), cu_kv.tolist(), pad_q.tolist(), pad_kv.tolist()

        def zero(ts: Tuple[torch.Tensor, ...], a: int, b: int) -> None:
            if b > a:
                for t in ts:
                    t[a:b].zero_()

        n = len(cq) - 1
        zero((dk, dv), 0, pk[0])
        zero((dq,), 0, pq[0])
        for i in range(n):
            lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
            lo, hi = key_interval(lq, lk, span)
            s, e = pk[i], pk[i + 1]
            if hi > lo:
                zero((dk, dv), s, s + lo)
                zero((dk, dv), s + hi, e)
            else:
                zero((dk, dv), s, e)
            zero((dq,), pq[i] + (lq if lk > 0 else 0), pq[i + 1])
        zero((dk, dv), pk[n], dk.shape[0])
        zero((dq,), pq[n], dq.shape[0])

    return run


# --------------------------------------------------------------------------- one workload


def run_workload(wl: Workload, te: TE, args: argparse.Namespace) -> Dict[str, Any]:
    res: Dict[str, Any] = {"workload": asdict(wl), "timings": {}, "checks": {}, "errors": {}}
    dev = "cuda"
    dtype = getattr(torch, wl.dtype)
    span = key_span(wl.mask)
    dead_kv, dead_q = dead_rows(wl, span)
    esize = torch.finfo(dtype).bits // 8
    res["dead_rows_kv"], res["dead_rows_q"] = dead_kv, dead_q
    res["bytes_to_write"] = dead_kv * wl.h_kv * wl.d * esize * 2 + dead_q * wl.h_q * wl.d * esize
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev, dtype=dtype)

    common, bwd_kw = backward_arguments(wl, te, randn, dev)
    cu_q, cu_kv, pad = (common[n] for n in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded"))
    q, k, v = bwd_kw["q"], bwd_kw["k"], bwd_kw["v"]
    offs = (cu_q, cu_kv, pad, pad)
    reps, warm = args.reps, args.warmup
    preps, pwarm = args.postpass_reps, args.postpass_warmup

    def bwd() -> Any:
        return te.original(**bwd_kw)

    def wrapped() -> Any:
        return te.wrapper(**bwd_kw)

    def measure(name: str, thunk: Callable[[], Any]) -> None:
        try:
            res["timings"][name] = thunk()
        except Exception as exc:
            res["errors"][name] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()

    def check(name: str, thunk: Callable[[], Any]) -> None:
        try:
            res["checks"][name] = thunk()
        except Exception as exc:
            res["errors"]["check:" + name] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()

    # Fixed gradient buffers for the post-pass-alone timings (real bwd outputs).
    grads = [t.clone() for t in bwd()[:3]]
    dq0, dk0, dv0 = grads

    def measure_group(group: Dict[str, Callable[[], Any]], timer: Callable, r: int, w: int) -> None:
        ok = {}
        for name, fn in group.items():  # one failing variant must not sink the others
            try:
                fn()
                ok[name] = fn
            except Exception as exc:
                res["errors"][name] = f"{type(exc).__name__}: {exc}"[:400]
                traceback.print_exc()
        try:
            res["timings"].update(timer(ok, r, w) if ok else {})
        except Exception as exc:
            res["errors"]["group:" + ",".join(ok)] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()

    def bwd_torch_fix() -> None:
        g = bwd()
        zero_dead_rows(g[0], g[1], g[2], *offs, attn_mask_type=wl.mask, impl="torch")

    loop = make_python_loop(cu_q, cu_kv, pad, pad, span)

    def empty_cache_bwd() -> Any:
        torch.cuda.empty_cache()
        return bwd()

    def bwd_loop() -> None:
        g = bwd()
        loop(g[0], g[1], g[2])

    # Full backward steps, interleaved: unfixed, the wrapper, and the GPU-only workarounds.
    device_group: Dict[str, Callable[[], Any]] = {"bwd": bwd, "wrapper": wrapped}
    if not args.skip_workarounds:
        device_group["bwd+torch_postpass"] = bwd_torch_fix
    mha_parts: Dict[str, Callable[[], Any]] = {}
    # Workaround: expand K/V to MHA (MHA takes cuDNN's path without the bug).
    if wl.h_q != wl.h_kv and not args.skip_mha and not args.skip_workarounds:
        try:
            group = wl.h_q // wl.h_kv
            k_m, v_m = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out_m, aux_m = call_by_name(
                te.fwd, **common, is_training=True, q=q, k=k_m, v=v_m, fake_dtype=dtype,
                fused_attention_backend=te.backend,
            )[:2]  # fmt: skip
            mha_kw = dict(bwd_kw, k=k_m, v=v_m, o=out_m, aux_ctx_tensors=aux_m)

            def expand() -> Any:
                return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

            def mha_bwd() -> Any:
                return te.original(**mha_kw)

            g_m = mha_bwd()

            def group_sum(g: Any = g_m) -> Any:
                dk_ = g[1].view(wl.rows, wl.h_kv, group, wl.d).sum(2)
                dv_ = g[2].view(wl.rows, wl.h_kv, group, wl.d).sum(2)
                return dk_, dv_

            def mha_total() -> Any:
                expand()
                return group_sum(mha_bwd())

            device_group["mha_total"] = mha_total
            mha_parts = {"mha_expand": expand, "mha_bwd": mha_bwd, "mha_group_sum": group_sum}
        except Exception as exc:
            res["errors"]["mha"] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
    measure_group(device_group, time_device_group, reps, warm)
    for name, fn in mha_parts.items():
        measure(name, lambda fn=fn: time_device(fn, reps, warm))
    mha_parts.clear()
    device_group.pop("mha_total", None)

    # The post-pass alone, on fixed gradient buffers.
    for name, fn in (
        ("postpass_triton", lambda: zero_dead_rows(
            dq0, dk0, dv0, *offs, attn_mask_type=wl.mask, impl="triton")),
        ("postpass_kernel", lambda: triton_postpass.zero_dead_rows_triton(
            dq0, dk0, dv0, *offs, span=span)),
        ("postpass_torch", lambda: zero_dead_rows(
            dq0, dk0, dv0, *offs, attn_mask_type=wl.mask, impl="torch")),
    ):  # fmt: skip
        measure(name, lambda fn=fn: time_device(fn, preps, pwarm))

    # Host time per call: TE alone, the wrapper with the post-pass, and the wrapper where
    # cuDNN is fixed (the cached decision flipped, so both builds show the pass-through).
    dev_index = torch.cuda.current_device()

    def decide(fixed: bool) -> Callable[[], None]:
        def setup() -> None:
            guard._fixed[dev_index] = fixed

        return setup

    bwd_s = (_t(res, "bwd") or 1000.0) / 1e6
    rounds = int(min(args.host_rounds, max(8, args.host_budget / (3 * bwd_s))))
    host_start = host_snapshot()
    launched_from_c, c_lane_calls = c_launch.launch_count(), c_launch.lane_count()
    pos, rest = positional(te.original, bwd_kw)

    def bwd_pos() -> Any:
        return te.original(*pos, **rest)

    def wrapped_pos() -> Any:
        return te.wrapper(*pos, **rest)

    try:
        res["timings"].update(
            time_host_group(
                {"te_host": bwd_pos, "wrapper_host": wrapped_pos, "passthrough_host": wrapped_pos},
                {"te_host": decide(False), "wrapper_host": decide(False),
                 "passthrough_host": decide(True)},
                rounds,
            )
        )  # fmt: skip
    except Exception as exc:
        res["errors"]["host"] = f"{type(exc).__name__}: {exc}"[:400]
        traceback.print_exc()
    finally:
        guard._fixed[dev_index] = False

    # The same, direct: the wrapper around a stub with TE's signature that returns real
    # gradients of one TE call, against the stub, same arguments. TE's call time varies by
    # about +-5 us from call to call, which blurs the paired difference above; this
    # isolates the wrapper's Python and (post-pass mode) its kernel launch on real tensors.
    # Then the same again, each timed call (stub or wrapper) right after an untimed call
    # of TE's own function: the host state of training, where TE's backward runs between
    # two of the wrapper's calls. Rounds as for the paired timing (a TE call each).
    for suffix, direct_rounds, before in (
        ("", args.stub_rounds, None),
        ("_after_te", rounds, bwd_pos),
    ):
        try:
            direct, modes_done = time_direct(
                te.original, bwd(), bwd_kw,
                {"wrapper_stub_host": decide(False), "passthrough_stub_host": decide(True)},
                direct_rounds, before=before, suffix=suffix,
            )  # fmt: skip
            res["timings"].update(direct)
            res["checks"].setdefault("direct_modes", {}).update(modes_done)
        except Exception as exc:
            res["errors"]["host_direct" + suffix] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
        finally:
            guard._fixed[dev_index] = False
    res["host_context"] = host_context(since=host_start)
    # How the post-pass kernel was launched in the steady state: from C (te_gqa_fix.c_launch)
    # or from Python through Triton's C launcher.
    res["checks"]["launched_from_c"] = c_launch.launch_count() - launched_from_c
    # ... and how many wrapper calls the C lane (te_gqa_fix.wrapper._Lane) served whole.
    res["checks"]["c_lane_calls"] = c_launch.lane_count() - c_lane_calls

    # Workarounds that block the host, against the wrapper in the same (wall) mode.
    if not args.skip_workarounds:
        wall_group = {
            "bwd_wall": bwd,
            "wrapper_wall": wrapped,
            "empty_cache+bwd_wall": empty_cache_bwd,
            "bwd+python_loop_wall": bwd_loop,
        }
        measure_group(wall_group, time_wall_group, reps, warm)
        measure("python_loop_wall", lambda: time_wall(lambda: loop(dq0, dk0, dv0), preps, pwarm))

    # Checks: the kernel agrees with the PyTorch post-pass and with the loop on real
    # gradients; the bug shows on the unfixed call; nothing in the fix syncs the host.
    def same_as_torch() -> Dict[str, bool]:
        base = [t.clone() for t in bwd()[:3]]
        for t in base:
            t.view(t.shape[0], -1)[:, ::7] = float("nan")  # stale values anywhere
        a, b, c = ([t.clone() for t in base] for _ in range(3))
        ok_kernel = triton_postpass.zero_dead_rows_triton(*a, *offs, span=span)
        zero_dead_rows(*b, *offs, attn_mask_type=wl.mask, impl="torch")
        loop(*c)

        def eq(x: List[torch.Tensor], y: List[torch.Tensor]) -> bool:
            return all(torch.equal(s.view(torch.int16 if esize == 2 else torch.int32),
                                   t.view(torch.int16 if esize == 2 else torch.int32))
                       for s, t in zip(x, y))  # fmt: skip

        return {
            "kernel_ran": bool(ok_kernel),
            "triton_eq_torch": eq(a, b),
            "loop_eq_torch": eq(c, b),
        }

    check("equal", same_as_torch)

    def poisoned() -> Dict[str, float]:
        from te_gqa_fix.postpass import dead_row_masks

        dead = dead_row_masks(*offs, rows_q=wl.rows, rows_kv=wl.rows, attn_mask_type=wl.mask)
        out_ = {}
        # Big enough for TE's outputs and cuDNN's fp32 partials (they come from the freed
        # block); plus small blocks for the small-allocation pool.
        n_big = max(1 << 28, 4 * wl.rows * wl.h_q * wl.d)
        for label, fn in (("unfixed", bwd), ("wrapper", wrapped)):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            junk = [torch.full((n_big,), 1000.0, device=dev)]
            junk += [torch.full(((1 << 18) - 256,), 1000.0, device=dev) for _ in range(8)]
            del junk
            g = fn()
            stale = torch.cat([g[1][dead.kv].abs().flatten(), g[2][dead.kv].abs().flatten()])
            out_[f"{label}_max_abs_on_dead_kv_rows"] = (
                float(stale.float().nan_to_num(1e30).max()) if stale.numel() else 0.0
            )
        return out_

    check("poisoned_workspace", poisoned)

    g_sync = bwd()[:3]
    check("sync_postpass_triton", lambda: check_no_sync(
        lambda: zero_dead_rows(*g_sync, *offs, attn_mask_type=wl.mask, impl="triton")))  # fmt: skip
    check("sync_postpass_torch", lambda: check_no_sync(
        lambda: zero_dead_rows(*g_sync, *offs, attn_mask_type=wl.mask, impl="torch")))  # fmt: skip
    check("sync_te_bwd", lambda: check_no_sync(bwd))
    check("sync_wrapper", lambda: check_no_sync(wrapped))

    def passthrough_no_sync() -> str:
        guard._fixed[dev_index] = True
        try:
            return check_no_sync(wrapped)
        finally:
            guard._fixed[dev_index] = False

    check("sync_wrapper_passthrough", passthrough_no_sync)
    check("sync_python_loop (detector must fire)", lambda: check_no_sync(lambda: loop(*g_sync)))
    res["postpass_impl"] = "triton" if triton_postpass.available() else "torch (triton unavailable)"
    return res


# --------------------------------------------------------------------------- stack

_t = bench_report._t
summarize = bench_report.summarize


def stack_info() -> Dict[str, Any]:
    """``te_gqa_fix.stack.stack_summary()`` (the project's stack line) plus what the
    benchmark adds: SM count, Triton, this package, Python and the settings."""
    from te_gqa_fix.stack import stack_summary

    info: Dict[str, Any] = dict(stack_summary())
    info["python"] = platform.python_version()
    info["te_gqa_fix"] = te_gqa_fix.__version__
    info["env"] = {k: os.environ.get(k) for k in (*ENV_KEYS, "CUDNN_HOME")}
    try:
        info["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    except Exception as exc:
        info["sm_count"] = f"unknown ({exc})"
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    cud = info.get("cudnn_te")
    if isinstance(cud, (list, tuple)):
        info["cudnn_te"] = ".".join(map(str, cud))
    return info


# --------------------------------------------------------------------------- main


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"workloads {QUICK}, fewer repetitions")
    p.add_argument("--workloads", default=None, help=f"comma-separated subset of {FULL}")
    p.add_argument("--mask", default="padding_causal_bottom_right")
    p.add_argument("--reps", type=int, default=None, help="timed calls per attention measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--postpass-reps", type=int, default=None)
    p.add_argument("--postpass-warmup", type=int, default=10)
    p.add_argument("--skip-mha", action="store_true", help="skip the expand-to-MHA workaround")
    p.add_argument(
        "--skip-workarounds",
        action="store_true",
        help="only the backward, the wrapper, the post-pass and host times (second build)",
    )
    p.add_argument("--host-rounds", type=int, default=200, help="most host-timing rounds")
    p.add_argument(
        "--host-budget", type=float, default=2.0, help="seconds of host timing per workload"
    )
    p.add_argument(
        "--stub-rounds",
        type=int,
        default=1000,
        help="rounds of the direct host timing (wrapper around a stub of TE's function)",
    )
    p.add_argument("--label", default="", help="a name for this run's build (report only)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    p.add_argument("--selftest", action="store_true", help="CPU-only checks of this script")
    a = p.parse_args(argv)
    if a.reps is None:
        a.reps = 10 if a.quick else 20
    if a.postpass_reps is None:
        a.postpass_reps = 50 if a.quick else 100
    return a


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.selftest:
        return selftest(args)
    names = args.workloads.split(",") if args.workloads else (QUICK if args.quick else FULL)
    workloads = all_workloads(args.mask)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    report: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            [f"{k}={shlex.quote(os.environ[k])}" for k in ENV_KEYS if os.environ.get(k)]
            + [shlex.quote(x) for x in [Path(sys.executable).name, *sys.argv]]
        ),
        "args": vars(args),
        "workloads": [],
        "errors": {},
        "bandwidth": {},
    }
    if not torch.cuda.is_available():
        print("bench_postpass: needs a CUDA device", file=sys.stderr)
        return 2
    # TE first: it loads its cuDNN (system or wheel, see .gpu-kit/env.sh) before anything
    # in torch initialises cuDNN; the other order mixes two cuDNN builds in one process.
    te: Optional[TE] = None
    try:
        te = TE()
    except Exception as exc:
        report["errors"]["te"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    report["stack"] = stack_info()
    # The decision the wrapper makes here under the default policy (cached, doctor's
    # facts). The workloads force the post-pass (and flip to the pass-through for its
    # own row) by setting that cached decision; it is restored at the end.
    dev_index = torch.cuda.current_device()
    report["cudnn_fixed"] = guard.cudnn_fixed(dev_index)
    guard._fixed[dev_index] = False
    try:
        report["bandwidth"] = bandwidth(20)
    except Exception as exc:
        report["errors"]["bandwidth"] = f"{type(exc).__name__}: {exc}"
    torch.cuda.empty_cache()
    for name in names:
        if te is None:
            break
        print(f"--- {name}", flush=True)
        t0 = time.time()
        try:
            res = run_workload(workloads[name], te, args)
        except Exception as exc:
            traceback.print_exc()
            wl = workloads.get(name)
            res = {
                "workload": asdict(wl) if wl else {"name": name},
                "timings": {},
                "checks": {},
                "errors": {"workload": f"{type(exc).__name__}: {exc}"[:400]},
            }
        res["seconds"] = round(time.time() - t0, 1)
        res["summary"] = summarize(res, report["bandwidth"])
        report["workloads"].append(res)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # Write as we go: a later failure or timeout keeps what was measured.
        (out_dir / "bench.json").write_text(json.dumps(report, indent=1, default=str))
    guard._fixed[dev_index] = report["cudnn_fixed"]
    report["seconds"] = round(time.time() - t_start, 1)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1, default=str))
    md = bench_report.markdown(report)
    (out_dir / "bench.md").write_text(md)
    print(md)
    return 0


# --------------------------------------------------------------------------- selftest


def selftest_pairing() -> None:
    """``time_host_group`` on fake callables and a fake clock: exact paired medians.

    The reference's cost drifts by up to 370 us from round to round (as TE's call does, in
    smaller steps); "over" costs the reference's cost of the same call plus 3 us, plus
    297 us more on 2 calls in 5; "under" costs 1 us less. Paired medians must read exactly
    3.0 and -1.0 (the difference of separate medians would not). A sync costs a fake second: one inside a timed call would show. Each
    function's own setup must run right before it, and the order rotates round by round.
    """
    now = [0]
    order: List[str] = []
    state = {"setup": ""}
    calls = {"ref": 0, "over": 0, "under": 0}
    drift = [100_000 + 37_000 * ((7 * i) % 11) for i in range(400)]  # ns
    cost = {
        "ref": lambda i: drift[i],
        "over": lambda i: drift[i] + (3_000 if i % 5 > 1 else 300_000),
        "under": lambda i: drift[i] - 1_000,
    }

    def fn(name: str) -> Callable[[], None]:
        def f() -> None:
            assert state["setup"] == name, (state, name)
            order.append(name)
            now[0] += cost[name](calls[name])
            calls[name] += 1

        return f

    def setup(name: str) -> Callable[[], None]:
        return lambda: state.update(setup=name)

    syncs = []

    def sync() -> None:
        syncs.append(len(order))
        now[0] += 10**9

    names = list(calls)
    warmup, rounds, chunk = 3, 101, 4
    out = time_host_group(
        {n: fn(n) for n in names}, {n: setup(n) for n in names}, rounds,
        chunk=chunk, warmup=warmup, sync=sync, clock=lambda: now[0],
    )  # fmt: skip
    assert set(out) == set(names) and "overhead_us" not in out["ref"], out
    assert out["over"]["overhead_us"] == 3.0, out["over"]
    assert out["under"]["overhead_us"] == -1.0, out["under"]
    ref = sorted(drift[i] / 1e3 for i in range(warmup, warmup + rounds))
    assert out["ref"]["median_us"] == statistics.median(ref), out["ref"]
    assert (out["ref"]["p10_us"], out["ref"]["p90_us"]) == (ref[10], ref[90]), out["ref"]
    assert all(t["n"] == rounds and t["mode"] == "host" for t in out.values()), out
    timed = order[3 * warmup :]
    firsts = [timed[3 * r] for r in range(rounds)]
    assert firsts == [names[r % 3] for r in range(rounds)], firsts[:6]
    # After the warm-up, after every chunk of rounds, at the end (calls made before each).
    every = [3 * (warmup + r) for r in range(chunk, rounds + 1, chunk)]
    assert syncs == [3 * warmup, *every, 3 * (warmup + rounds)], syncs
    print(f"time_host_group: paired overheads {out['over']['overhead_us']} / "
          f"{out['under']['overhead_us']} us on a fake clock, {len(syncs)} syncs outside")  # fmt: skip


def _te_like_call(wl: Workload) -> Tuple[Callable, Dict[str, Any], Any, Callable[[Any], None]]:
    """A fake TE 2.20 ``fused_attn_bwd`` (TE's exact signature, from tests/fakes), the
    keyword arguments the benchmark would pass it for ``wl`` (CPU tensors), its call log,
    and a check that a gradients list has exactly the dead rows of ``wl`` zeroed."""
    from te_gqa_fix.postpass import dead_row_masks

    tests_dir = str(ROOT / "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from fakes.te_signatures import build_fake

    te_calls: List[Dict[str, Any]] = []

    def te_body(bound: Dict[str, Any]) -> Any:
        te_calls.append(bound)
        return [torch.full_like(bound[n], 1000.0) for n in ("q", "k", "v")] + [None]

    te_fn = build_fake("2.20", te_body)
    dtype = getattr(torch, wl.dtype)

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return torch.randn(q.shape, dtype=dtype), []

    fake = SimpleNamespace(fwd=fwd, original=te_fn, backend="F16_arbitrary_seqlen (fake)")
    common, kw = backward_arguments(
        wl, fake, lambda *shape: torch.randn(shape, dtype=dtype), device="cpu"
    )
    cu_q, cu_kv, pad = (common[n] for n in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded"))
    dead = dead_row_masks(cu_q, cu_kv, pad, pad, rows_q=wl.rows, rows_kv=wl.rows,
                          attn_mask_type=wl.mask)  # fmt: skip

    def fixed_right(g: Any) -> bool:
        return all(
            bool((t[m] == 0).all()) and bool((t[~m] == 1000.0).all())
            for t, m in ((g[0], dead.q), (g[1], dead.kv), (g[2], dead.kv))
        )

    return te_fn, kw, te_calls, fixed_right


def stub_problems(stub: Callable, te_fn: Callable, kw: Dict[str, Any], out: Any,
                  te_calls: List[Any], fixed_right: Callable[[Any], bool]) -> List[str]:  # fmt: skip
    """What is wrong with ``stub`` as the direct measurement's stand-in for ``te_fn``: its
    signature differs, its wrapper is not its own, calls TE's function, does not return
    the stub's object, or does not post-process it as it would TE's (read by keyword, by
    position, and mixed)."""
    from te_gqa_fix import call_counts
    from te_gqa_fix.wrapper import unwrap

    problems = []
    if inspect.signature(stub) != inspect.signature(te_fn):
        problems.append(f"signature {inspect.signature(stub)} is not TE's")
    w = wrapper_for(stub)
    if unwrap(w) is not stub:
        problems.append(f"wrapper_for(stub) wraps {unwrap(w)!r}, not the stub")
    bound = inspect.signature(te_fn).bind(**kw)
    mixed = (bound.args, bound.kwargs)  # positional up to the first parameter not given
    bound.apply_defaults()
    calls = {"keywords": ((), kw), "mixed": mixed, "positional": (bound.args, {})}
    for how, (a, k) in calls.items():
        for t in out[:3]:
            t.fill_(1000.0)
        n_te, before = len(te_calls), call_counts()
        try:
            got = w(*a, **k)
        except Exception as exc:
            problems.append(f"{how}: the stub's wrapper raised {type(exc).__name__}: {exc}")
            continue
        after = call_counts()
        if len(te_calls) != n_te:
            problems.append(f"{how}: the stub's wrapper called TE's function")
        if got is not out:
            problems.append(f"{how}: the stub's wrapper returned another object")
        if (after["fixed"] - before["fixed"], after["passthrough"] - before["passthrough"]) != (
            1, 0
        ) or not fixed_right(out):  # fmt: skip
            problems.append(f"{how}: the stub's gradients were not post-processed as TE's")
    return problems


def selftest_stub(wl: Workload) -> None:
    """The direct measurement's stub and :func:`time_direct`, on CPU with a fake TE.

    Negative controls show the checks can fail: a stub made with ``functools.wraps`` of
    TE's wrapper (its wrapper is TE's, which calls TE), one without TE's signature (the
    wrapper cannot bind arguments and passes through).
    """
    import functools
    import logging

    from te_gqa_fix import call_counts

    te_fn, kw, te_calls, fixed_right = _te_like_call(wl)
    policy = os.environ.pop("TE_GQA_FIX", None)
    log = logging.getLogger("te_gqa_fix")
    try:
        for src in (te_fn, wrapper_for(te_fn)):
            out = [torch.full_like(kw[n], 1000.0) for n in ("q", "k", "v")] + [None]
            problems = stub_problems(make_stub(src, out), te_fn, kw, out, te_calls, fixed_right)
            assert not problems, problems
        bad = {
            "functools.wraps(TE's wrapper)": lambda o: functools.wraps(wrapper_for(te_fn))(
                lambda *a, **k: o
            ),
            "no signature": lambda o: lambda *a, **k: o,
        }
        log_level, log.level = log.level, logging.CRITICAL  # the expected pass-through warning
        try:
            for why, make in bad.items():
                out = [torch.full_like(kw[n], 1000.0) for n in ("q", "k", "v")] + [None]
                problems = stub_problems(make(out), te_fn, kw, out, te_calls, fixed_right)
                assert problems, f"{why}: the stub checks did not fire"
                print(f"stub check fires on a stub made with {why}: {problems[0]}")
        finally:
            log.level = log_level
        del te_calls[:]

        # time_direct end to end (no GPU: no sync, and the mode is the policy variable
        # here, since the cached cuDNN decision is only read for CUDA tensors).
        def env(value: str) -> Callable[[], None]:
            return lambda: os.environ.__setitem__("TE_GQA_FIX", value)

        out = [torch.full_like(kw[n], 1000.0) for n in ("q", "k", "v")] + [None]
        before = call_counts()
        timings, modes = time_direct(
            te_fn, out, kw, {"wrapper_stub_host": env("auto"), "passthrough_stub_host": env("off")},
            rounds=20, warmup=2, sync=lambda: None,
        )  # fmt: skip
        after = call_counts()
        # In TE's wake: ``before`` runs ahead of every timed call (and warm-up call), the
        # stub's included, and every name carries the suffix.
        ran: List[int] = []
        wake, wake_modes = time_direct(
            te_fn, out, kw, {"wrapper_stub_host": env("auto")}, rounds=10, warmup=2,
            sync=lambda: None, before=lambda: ran.append(1), suffix="_after_te",
        )  # fmt: skip
    finally:
        os.environ.pop("TE_GQA_FIX", None)
        if policy is not None:
            os.environ["TE_GQA_FIX"] = policy
    assert not te_calls, "time_direct called TE's function"
    assert list(timings) == ["stub_host", "wrapper_stub_host", "passthrough_stub_host"], timings
    assert all(t["n"] == 20 for t in timings.values()), timings
    assert "overhead_us" not in timings["stub_host"], timings
    assert all("overhead_us" in timings[n] for n in ("wrapper_stub_host", "passthrough_stub_host"))
    assert modes["wrapper_stub_host"]["fixed"] == 1, modes
    assert modes["passthrough_stub_host"] == dict(modes["passthrough_stub_host"], fixed=0,
                                                  skipped=1, returned_stub_output=True), modes  # fmt: skip
    assert modes["wrapper_stub_host"]["returned_stub_output"], modes
    # One check call per mode, then per mode 2 warm-up + 20 timed calls.
    assert after["fixed"] - before["fixed"] == 1 + 22 and fixed_right(out), (before, after)
    assert after["skipped"] - before["skipped"] == 1 + 22, (before, after)
    assert list(wake) == ["stub_host_after_te", "wrapper_stub_host_after_te"], wake
    assert list(wake_modes) == ["wrapper_stub_host_after_te"], wake_modes
    assert len(ran) == 2 * (2 + 10), len(ran)
    print(
        "time_direct on CPU: post-pass "
        f"{timings['wrapper_stub_host']['overhead_us']:.1f} us, pass-through "
        f"{timings['passthrough_stub_host']['overhead_us']:.1f} us over the stub "
        "(CPU, torch post-pass; not the GPU numbers)"
    )


def selftest(args: argparse.Namespace) -> int:
    """CPU checks of the pieces that do not need a GPU: workloads, counts, loop, the host
    timer and the direct measurement's stub, tables."""
    from te_gqa_fix.postpass import dead_row_masks

    selftest_pairing()
    selftest_stub(all_workloads(args.mask)["seed"])
    selftest_stub(cp_workload("small-gqa", 512, 4, 2, 8, args.mask))

    for wl in all_workloads(args.mask).values():
        span = key_span(wl.mask)
        i32 = dict(dtype=torch.int32)
        cu_q, cu_kv = torch.tensor(wl.cu(wl.lq), **i32), torch.tensor(wl.cu(wl.lk), **i32)
        pad = torch.tensor(wl.pad, **i32)
        dead = dead_row_masks(cu_q, cu_kv, pad, pad, rows_q=wl.rows, rows_kv=wl.rows,
                              attn_mask_type=wl.mask)  # fmt: skip
        assert (int(dead.kv.sum()), int(dead.q.sum())) == dead_rows(wl, span), wl.name
        if wl.rows <= 8192:
            g = [torch.randn(wl.rows, h, 4) for h in (wl.h_q, wl.h_kv, wl.h_kv)]
            a, b = [t.clone() for t in g], [t.clone() for t in g]
            make_python_loop(cu_q, cu_kv, pad, pad, span)(*a)
            zero_dead_rows(*b, cu_q, cu_kv, pad, pad, attn_mask_type=wl.mask, impl="torch")
            assert all(torch.equal(x, y) for x, y in zip(a, b)), wl.name
        print(
            f"{wl.name}: rows {wl.rows}, dead kv {int(dead.kv.sum())}, dead q {int(dead.q.sum())}"
        )
    fake = {"median_us": 1000.0, "host_us": 50.0}
    res = {
        "workload": asdict(all_workloads(args.mask)["llama8b-8k"]),
        "bytes_to_write": 1e7,
        "timings": {k: dict(fake) for k in ("bwd", "wrapper", "postpass_triton", "postpass_torch",
                                             "bwd+torch_postpass", "mha_total", "wrapper_wall",
                                             "empty_cache+bwd_wall", "bwd+python_loop_wall")},
        "checks": {"equal": {"kernel_ran": True, "triton_eq_torch": True, "loop_eq_torch": True}},
        "errors": {},
    }  # fmt: skip
    res["timings"]["postpass_triton"] = {"median_us": 9.0}
    # The paired overheads miss the goals, the direct ones meet them: the direct decide.
    res["timings"]["te_host"] = {"median_us": 150.0}
    res["timings"]["wrapper_host"] = {"median_us": 170.0, "overhead_us": 20.0}
    res["timings"]["passthrough_host"] = {"median_us": 157.0, "overhead_us": 7.0}
    res["timings"]["stub_host"] = {"median_us": 0.5}
    res["timings"]["wrapper_stub_host"] = {"median_us": 12.5, "overhead_us": 12.0}
    res["timings"]["passthrough_stub_host"] = {"median_us": 3.5, "overhead_us": 3.0}
    res["checks"]["direct_modes"] = {
        "wrapper_stub_host": {"calls": 1, "fixed": 1, "skipped": 0, "passthrough": 0,
                              "returned_stub_output": True},
        "passthrough_stub_host": {"calls": 1, "fixed": 0, "skipped": 1, "passthrough": 0,
                                  "returned_stub_output": True},
    }  # fmt: skip
    bw = {"copy_traffic_GBps": 4000.0, "fill_GBps": 3000.0}
    res["summary"] = summarize(res, bw)
    s = res["summary"]
    assert s["host_goal_met"] and s["passthrough_goal_met"] and s["device_goal_met"], s
    assert (s["host_goal_basis"], s["host_overhead_us"], s["host_overhead_paired_us"]) == (
        "direct", 12.0, 20.0), s  # fmt: skip
    assert (s["passthrough_goal_basis"], s["passthrough_overhead_us"]) == ("direct", 3.0), s
    # An older bench.json (no direct timings) is decided on the paired ones.
    old = dict(res, timings={k: v for k, v in res["timings"].items() if "stub" not in k})
    s_old = summarize(old, bw)
    assert s_old["host_goal_basis"] == s_old["passthrough_goal_basis"] == "paired", s_old
    assert not s_old["host_goal_met"] and not s_old["passthrough_goal_met"], s_old
    assert "host_overhead_direct_us" not in s_old, s_old
    # A direct timing whose mode did not do its job (no post-pass ran) does not count.
    bad_modes = dict(res["checks"]["direct_modes"])
    bad_modes["wrapper_stub_host"] = dict(bad_modes["wrapper_stub_host"], fixed=0, skipped=1)
    bad = dict(res, checks=dict(res["checks"], direct_modes=bad_modes))
    s_bad = summarize(bad, bw)
    assert s_bad["host_goal_basis"] == "paired" and not s_bad["host_goal_met"], s_bad
    assert s_bad["passthrough_goal_basis"] == "direct", s_bad
    row = bench_report.host_table([{"workloads": [res]}])[2]
    assert "| 20.0 us | 12.0 us | yes | 157.0 us | 7.0 us | 3.0 us | yes |" in row, row
    row = bench_report.host_table([{"workloads": [old]}])[2]
    assert "| 20.0 us | - | NO (paired) | 157.0 us | 7.0 us | - | NO (paired) |" in row, row
    assert "itself adds 12 us" in bench_report.headline([{"workloads": [res]}])
    assert "adds 20 us of host time per call to TE's" in bench_report.headline(
        [{"workloads": [old]}])  # fmt: skip
    big = dict(res, workload=dict(res["workload"], rows=32768))
    big["timings"] = dict(res["timings"], postpass_triton={"median_us": 4.0})
    assert not summarize(big, bw)["device_goal_met"]  # 1.6x the 2.5 us bound
    reports = [
        {"date": "-", "command": "-", "stack": {"cudnn_te": "9.14.0"}, "bandwidth": bw,
         "workloads": [res], "cudnn_fixed": False},
        {"date": "-", "command": "-", "stack": {"cudnn_te": "9.19.0"}, "bandwidth": bw,
         "workloads": [res], "cudnn_fixed": True},
    ]  # fmt: skip
    block = bench_report.results_block(reports)
    assert "wrapper host overhead (direct, around a stub) <= 15 us: **yes**" in block, block
    mixed = bench_report.results_block([reports[0], dict(reports[1], workloads=[old])])
    assert "(direct where measured, else paired vs TE's call) <= 15 us: **NO**" in mixed, mixed
    print(block)
    print(bench_report.headline(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
