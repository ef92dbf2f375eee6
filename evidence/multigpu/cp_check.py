"""Context parallelism (THD + GQA) on N ranks: TE's CP attention against one GPU and fp32.

Run under torchrun; the rank count comes from the launcher (``WORLD_SIZE``), never assumed::

    source .gpu-kit/env.sh && \\
      torchrun --standalone --nproc-per-node 2 evidence/multigpu/cp_check.py --out "$OUT"

Every rank builds the same global packed batch (seeded on the CPU, so bit-identical),
splits it with TE's own THD partitioning helper (DualChunkSwap), and runs
``DotProductAttention(qkv_format="thd", num_gqa_groups=...)`` with
``set_context_parallel_group`` for each ``cp_comm_type``. The per-rank output and
dQ/dK/dV are all-gathered and put back in sequence order, then compared on rank 0 with

* the same ``DotProductAttention`` on one GPU without CP, and
* an fp32 PyTorch reference (per-sequence causal softmax attention, GQA by
  ``repeat_interleave``),

with flash-attention's dtype-derived tolerance: the error of TE (bf16) against fp32 must
be at most twice the error of the same attention computed by PyTorch in bf16, plus a few
bf16 ulps of the reference's magnitude. Padding rows of dK/dV must be exactly 0.

Each config runs unpatched (``te_gqa_fix.uninstall()``) and patched
(``te_gqa_fix.install()`` before the module is built), both with a poisoned allocator
block freed between forward and backward (the deterministic trigger of the bug notes:
a workspace cuDNN never writes then reads the sentinel, so damaged rows show 1000 x the
GQA group size). Unpatched runs only *record* whether corruption was observed (cuDNN
>= 9.18 is clean); patched runs must pass.

``--heads 8/2,32/8``, ``--comm p2p``, ``--shapes te2186``, ``--modes patched`` narrow the
sweep; ``--try-unsupported`` runs configs TE 2.20.2 is known to reject (a2a needs the
head counts divisible by cp) and records how TE rejects them.

Rank 0 writes ``cp_results_cp<N>[_<tag>].json`` (rewritten after every config, so a later
hang loses nothing) and ``cp_summary_cp<N>[_<tag>].txt`` under ``--out`` (default ``$OUT``;
tag default ``$GPU_KIT_CUDNN``), and prints a summary table. Exit status 0 when every patched config that TE supports passes.

Only the standard library and torch are imported at module level (pytest collects the
wrapper on CPU machines); Transformer Engine is imported after the backend env is set.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# cp_report beside it; the evidence harness (stack_probe); the test harness (thd). Loaded
# by path (pytest) or run as a script: either way these folders are on the path.
for _folder in (os.path.join(ROOT, "tests"), os.path.dirname(HERE), HERE):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

from cp_report import check_results, summary_table, write_results  # noqa: E402

import stack_probe  # noqa: E402
from te_gqa_fix import rules  # noqa: E402
from te_gqa_fix._te import te_cudnn_version  # noqa: E402
from thd import ThdBatch, reference_attention, tolerance  # noqa: E402

TENSORS = ("out", "dq", "dk", "dv")
COMM_TYPES = ("p2p", "all_gather", "a2a")
MODES = ("unpatched", "patched")
DEFAULT_SHAPES = ("te2186", "tailpad", "empty")
DEFAULT_HEADS = "8/2,8/1"

# Messages with which TE 2.x rejects a CP configuration it does not implement: such a
# config is recorded as "unsupported" (with the message), never as a pass.
_TE_REJECTIONS = (
    "No dot product attention backend is available",
    "No support for cp_comm_type",
    "requires num_heads % cp_size",
    "Unsupported communication type",
    "does not support context parallelism",
    "Context parallelism does not support",
)


# ----------------------------------------------------------------------------- shapes


def shape_pairs(name: str, cp: int) -> List[Tuple[int, int]]:
    """(valid length, padded length) per sequence; every padded length is a multiple of 2*cp.

    * ``te2186``: the batch of TE issue #2186, lengths 9 8 8 12 8 12, each padded to the
      next multiple of 2*cp (cp=2 gives exactly cu_seqlens [0,9,17,25,37,45,57], padded
      [0,12,20,28,40,48,60]); with cp=2 the first sequence's 4th chunk (rank 0's second
      half) is pure padding.
    * ``tailpad``: padded length 4u (u = 2*cp, so 4 tokens per DualChunkSwap chunk) with
      valid lengths 1, 2u, 2u+1, 4u-3, 4u and one (u-1, u): sequences whose second half on
      every rank is pure padding, whose whole share on ranks > 0 is padding, half-filled
      chunks and a fully valid one.
    * ``empty``: adds a zero-length sequence padded to u (pure padding) and one padded
      to 0 between valid ones.
    """
    u = 2 * cp
    if name == "te2186":
        return [(n, -(-n // u) * u) for n in (9, 8, 8, 12, 8, 12)]
    if name == "tailpad":
        return [
            (1, 4 * u),
            (2 * u, 4 * u),
            (2 * u + 1, 4 * u),
            (4 * u - 3, 4 * u),
            (4 * u, 4 * u),
            (u - 1, u),
        ]
    if name == "empty":
        return [(3, 2 * u), (0, u), (3 * u, 4 * u), (0, 0), (u + 1, 2 * u)]
    raise ValueError(f"unknown shape {name!r}; known: {', '.join(DEFAULT_SHAPES)}")


def cumulative(values: Sequence[int]) -> List[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + int(v))
    return out


def dual_chunk_swap_indices(padded: Sequence[int], cp: int, rank: int) -> List[int]:
    """The token rows rank ``rank`` holds under DualChunkSwap (TE's default CP split):
    chunks ``rank`` and ``2*cp-1-rank`` of every sequence, in sequence order. Used only to
    cross-check TE's helper; the test splits with TE's own indices."""
    rows: List[int] = []
    starts = cumulative(padded)
    for start, length in zip(starts[:-1], padded):
        c = length // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            rows.extend(range(start + chunk * c, start + (chunk + 1) * c))
    return rows


def valid_rows(pairs: Sequence[Tuple[int, int]]) -> Tuple[List[int], List[int]]:
    """(rows holding tokens, padding rows) of the global packed buffer."""
    starts = cumulative([p for _, p in pairs])
    valid: List[int] = []
    pad: List[int] = []
    for (n, p), s in zip(pairs, starts[:-1]):
        valid.extend(range(s, s + n))
        pad.extend(range(s + n, s + p))
    return valid, pad


def parse_heads(spec: str) -> List[Tuple[int, int]]:
    heads = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        hq, _, hkv = item.partition("/")
        hq_i, hkv_i = int(hq), int(hkv or hq)
        if hq_i % hkv_i:
            raise ValueError(f"--heads {item}: query heads must be a multiple of KV heads")
        heads.append((hq_i, hkv_i))
    return heads


def predicted_unsupported(comm: str, hq: int, hkv: int, cp: int) -> Optional[str]:
    """Why TE 2.20.2 rejects this config before running it (read from its source), or None."""
    if comm == "a2a" and (hq % cp or hkv % cp):
        return (
            f"unsupported by TE 2.20.2: cp_comm_type='a2a' scatters heads over the CP group and "
            f"asserts num_heads % cp_size == 0 for Q and K/V (context_parallel.py, "
            f"AttnFuncWithCPAndQKVOA2A.forward; utils.get_attention_backend also disables "
            f"FusedAttention for a2a with an odd num_gqa_groups); got {hq}/{hkv} heads, cp={cp}"
        )
    return None


# ----------------------------------------------------------------------------- helpers


def force_fused_backend(debug: bool = False) -> None:
    """Only cuDNN's fused attention may run: it is the backend with the bug. TE reads these
    when it selects a backend (and a copy of NVTE_FLASH_ATTN at import), so this runs before
    TE is imported."""
    os.environ["NVTE_FLASH_ATTN"] = "0"
    os.environ["NVTE_UNFUSED_ATTN"] = "0"
    os.environ["NVTE_FUSED_ATTN"] = "1"
    if debug:
        os.environ["NVTE_DEBUG"] = "1"
        os.environ["NVTE_DEBUG_LEVEL"] = "2"


@contextlib.contextmanager
def true_fp32() -> Iterator[None]:
    """fp32 matmuls really in fp32 (no TF32) for the reference."""
    old_mm = torch.backends.cuda.matmul.allow_tf32
    old_prec = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_mm
        torch.set_float32_matmul_precision(old_prec)


def log(rank: int, msg: str, all_ranks: bool = False) -> None:
    if rank == 0 or all_ranks:
        print(f"[cp_check rank {rank}] {msg}", flush=True)


# ----------------------------------------------------------------------------- references


def thd_batch(
    pairs: Sequence[Tuple[int, int]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
) -> ThdBatch:
    """The packed self-attention batch of ``pairs`` (valid, padded length), causal."""
    cu = cumulative([n for n, _ in pairs])
    cu_padded = cumulative([p for _, p in pairs])
    tensors = {"q": q, "k": k, "v": v, "d_o": dout}
    return ThdBatch.of_tensors(tensors, cu, cu, cu_padded, cu_padded, mask="padding_causal")


def reference_pair(batch: ThdBatch, device: torch.device) -> Dict[str, Dict[str, torch.Tensor]]:
    """The one reference (``thd.reference_attention``), in fp32 (really:
    no TF32) and in the batch's own precision (the yardstick of the bound), with the
    output named ``out`` as in this harness's records."""
    refs = {}
    with true_fp32():
        refs["fp32"] = reference_attention(batch, torch.float32, str(device))
    refs["low"] = reference_attention(batch, batch.dtype, str(device))
    return {k: {("out" if n == "o" else n): t for n, t in r.items()} for k, r in refs.items()}


def max_abs(a: torch.Tensor, b: Optional[torch.Tensor], rows: torch.Tensor) -> float:
    """max |a - b| (or |a| when b is None) over ``rows``; NaN propagates (so bounds fail)."""
    if rows.numel() == 0:
        return 0.0
    x = a.index_select(0, rows).float()
    if b is not None:
        x = x - b.index_select(0, rows).float()
    x = x.abs()
    if torch.isnan(x).any():
        return float("nan")
    return float(x.max().item())


# ----------------------------------------------------------------------------- the run


def _forward(dpa: Any, b: Any, q: Any, k: Any, v: Any, cu: Any, cu_pad: Any) -> Any:
    """One THD forward of ``dpa`` (one GPU or this rank's part) on batch ``b``'s offsets."""
    return dpa(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=b.max_seqlen,
        max_seqlen_kv=b.max_seqlen,
    )


@dataclass
class Case:
    """One shape of the sweep: the packed batch (``thd.ThdBatch``, self-attention:
    q and kv share offsets), the longest padded sequence, and its token and padding rows."""

    shape: str
    batch: ThdBatch
    max_seqlen: int
    valid: torch.Tensor
    pad: torch.Tensor

    @property
    def total(self) -> int:
        return self.batch.rows_q

    def tensor(self, name: str) -> torch.Tensor:
        return self.batch.tensors["d_o" if name == "dout" else name]


class Runner:
    """Holds the process group, the CP stream and cached references of one process."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.args = args
        self.dist = dist
        self.created_pg = False
        # --cpu-dry-run: gloo on CPU against a fake TE, to exercise this harness only.
        self.cuda = not args.cpu_dry_run
        #: TE runs a cuDNN measured right here, TE_GQA_FIX=auto: the wrapper passes through.
        self.pass_through = False
        backend = "nccl" if self.cuda else "gloo"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            world = int(os.environ.get("WORLD_SIZE", "0"))
            if world < 1 or "RANK" not in os.environ:
                raise RuntimeError(
                    "cp_check must be launched with torchrun (WORLD_SIZE/RANK unset)"
                )
            kwargs: Dict[str, Any] = {"timeout": datetime.timedelta(seconds=args.nccl_timeout)}
            if self.cuda:
                torch.cuda.set_device(local_rank)
                kwargs["device_id"] = torch.device("cuda", local_rank)
            dist.init_process_group(backend=backend, **kwargs)
            self.created_pg = True
        elif self.cuda:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if self.cuda:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        ranks = list(range(self.world))
        self.cp_ranks = ranks
        self.cp_group = dist.new_group(ranks=ranks, backend=backend)
        self.cp_stream = torch.cuda.Stream() if self.cuda else None
        self.refs: Dict[Tuple[Any, ...], Dict[str, Any]] = {}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    # -- environment ------------------------------------------------------------------

    def capability(self) -> Optional[Tuple[int, int]]:
        return torch.cuda.get_device_capability(self.device) if self.cuda else None

    def stack(self) -> Dict[str, Any]:
        """The stack line (``evidence/stack_probe.py``'s), the rule's verdict for it
        (``te_gqa_fix.rules.judge``), and this run's own facts (ranks, policy, argv, env)."""
        import te_gqa_fix
        from te_gqa_fix.settings import get as setting

        info: Dict[str, Any] = stack_probe.probe()
        cudnn = te_cudnn_version()
        rule = rules.judge(self.capability(), cudnn)
        if not self.cuda:
            info["gpu"] = "cpu (dry run)"
        info.update(
            host=platform.node(),
            python=platform.python_version(),
            gpus_visible=torch.cuda.device_count() if self.cuda else 0,
            world_size=self.world,
            cp_size=self.world,
            te_gqa_fix=te_gqa_fix.__version__,
            te_gqa_fix_policy=setting("TE_GQA_FIX"),
            verdict=rule.status,
            # stale rows unpatched: Hopper with a cuDNN older than the upstream fix
            bug_expected=rule.status in ("stale_rows", "live_rows_wrong")
            and cudnn is not None
            and cudnn < rules.CUDNN_FIXED,
            argv=sys.argv,
            env={
                k: v
                for k, v in sorted(os.environ.items())
                if k.startswith(
                    ("NVTE_", "NCCL_NVLS", "GPU_KIT", "TE_GQA_FIX", "CUDNN_", "PYTORCH_CUDA_ALLOC")
                )
            },
        )
        return info

    # -- inputs -----------------------------------------------------------------------

    def batch(self, shape: str, hq: int, hkv: int) -> Case:
        """Global inputs, identical on every rank (CPU generator), plus metadata."""
        args = self.args
        pairs = shape_pairs(shape, self.world)
        padded = [p for _, p in pairs]
        total = sum(padded)
        gen = torch.Generator().manual_seed(
            args.seed + 1009 * hq + 31 * hkv + zlib.crc32(shape.encode())
        )
        d = args.head_dim
        dtype = torch.bfloat16

        def randn(*shape_: int) -> torch.Tensor:
            return torch.randn(*shape_, generator=gen).to(dtype).to(self.device)

        q, k, v = randn(total, hq, d), randn(total, hkv, d), randn(total, hkv, d)
        dout = randn(total, hq, d)
        valid, pad = valid_rows(pairs)
        valid_t = torch.tensor(valid, dtype=torch.long, device=self.device)
        pad_t = torch.tensor(pad, dtype=torch.long, device=self.device)
        if pad:
            dout.index_fill_(0, pad_t, 0.0)  # a loss never weighs padding tokens
        batch = thd_batch(pairs, q, k, v, dout)
        return Case(shape, batch, max(padded), valid_t, pad_t)

    def cu(self, b: Case) -> Tuple[torch.Tensor, torch.Tensor]:
        offsets = b.batch.offsets(self.device)
        return offsets["cu_seqlens_q"], offsets["cu_seqlens_q_padded"]

    def partition(self, b: Case) -> Dict[str, Any]:
        """Every rank's token rows, from TE's THD partitioning helper (all ranks' indices
        are computed locally, to undo the split after the all-gather)."""
        _, cu_pad = self.cu(b)
        total, cp = b.total, self.world
        source = None
        idx: List[torch.Tensor] = []
        errors = []
        try:
            from transformer_engine.pytorch.attention.dot_product_attention.context_parallel import (
                get_thd_partitioned_indices,
            )

            idx = [get_thd_partitioned_indices(cu_pad, total, cp, r).long() for r in range(cp)]
            source = "context_parallel.get_thd_partitioned_indices"
        except Exception as exc:
            errors.append(f"get_thd_partitioned_indices: {exc!r}")
            try:
                import transformer_engine_torch as tex

                idx = [
                    tex.thd_get_partitioned_indices(cu_pad, total, cp, r).long() for r in range(cp)
                ]
                source = "transformer_engine_torch.thd_get_partitioned_indices"
            except Exception as exc2:
                errors.append(f"tex.thd_get_partitioned_indices: {exc2!r}")
        padded = [e - s for s, e in zip(b.batch.pad_q, b.batch.pad_q[1:])]
        expected = [dual_chunk_swap_indices(padded, cp, r) for r in range(cp)]
        if source is None:
            idx = [torch.tensor(e, dtype=torch.long, device=self.device) for e in expected]
            source = "python DualChunkSwap fallback (TE helper unavailable)"
        got = [t.tolist() for t in idx]
        flat = sorted(x for rows in got for x in rows)
        return {
            "idx": idx,
            "source": source,
            "errors": errors,
            "covers_all_rows_once": flat == list(range(total)),
            "equal_sizes": len({len(rows) for rows in got}) == 1,
            "matches_dual_chunk_swap": got == expected,
        }

    # -- references (rank 0 only) ---------------------------------------------------------

    def references(self, b: Case, hq: int, hkv: int) -> Dict[str, Any]:
        key = (b.shape, hq, hkv)
        if key in self.refs:
            return self.refs[key]
        pair = reference_pair(b.batch, self.device)
        ref: Dict[str, Any] = {**pair, "single": None, "single_error": None}
        try:
            ref["single"] = self.run_single(b, hq, hkv)
        except Exception:
            ref["single_error"] = traceback.format_exc(limit=6)
        self.refs[key] = ref
        return ref

    def run_single(self, b: Case, hq: int, hkv: int) -> Dict[str, torch.Tensor]:
        """The same DotProductAttention on this GPU alone, full batch, no CP, patched and
        not poisoned (no sequence lacks queries globally; the result is checked vs fp32)."""
        import transformer_engine.pytorch as te

        import te_gqa_fix

        te_gqa_fix.install()
        dpa = te.DotProductAttention(
            hq,
            self.args.head_dim,
            num_gqa_groups=hkv,
            qkv_format="thd",
            attn_mask_type="padding_causal",
        )
        cu, cu_pad = self.cu(b)
        q, k, v = (b.tensor(n).detach().clone().requires_grad_() for n in ("q", "k", "v"))
        out = _forward(dpa, b, q, k, v, cu, cu_pad)
        out.backward(b.tensor("dout").reshape(out.shape))
        self.sync()
        return {
            "out": out.detach().reshape(b.tensor("q").shape),
            "dq": q.grad,
            "dk": k.grad,
            "dv": v.grad,
        }

    # -- one CP config ----------------------------------------------------------------

    def poison(self) -> None:
        """Hand the caching allocator freed blocks full of a finite sentinel, on the compute
        stream and on the CP stream, so a workspace cuDNN never writes reads 1000.

        Both of PyTorch's pools: one large block (2**poison_log2 floats) serves requests
        over 1 MiB, and ``poison_small`` 1 MiB blocks (2 MiB segments) serve the small pool,
        where the workspace of a small test batch lands. ``empty_cache`` first, so that
        little else is cached to be handed out instead.
        """
        if not self.args.poison or not self.cuda:
            return
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for stream in (torch.cuda.current_stream(), self.cp_stream):
            with torch.cuda.stream(stream):
                blocks = [torch.full((1 << self.args.poison_log2,), 1000.0, device=self.device)]
                blocks += [
                    torch.full((1 << 18,), 1000.0, device=self.device)
                    for _ in range(self.args.poison_small)
                ]
                del blocks

    def run_cp(
        self, b: Case, part: Dict[str, Any], comm: str, hq: int, hkv: int, patched: bool
    ) -> Dict[str, Any]:
        """Forward + backward with CP on this rank; returns local results and diagnostics."""
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.attention.dot_product_attention import (
            _attention_backends as backends,
        )

        import te_gqa_fix

        if patched:
            te_gqa_fix.install()  # before the module is built, as a framework would
        else:
            te_gqa_fix.uninstall()
        installed = te_gqa_fix.is_installed()
        dpa = te.DotProductAttention(
            hq,
            self.args.head_dim,
            num_gqa_groups=hkv,
            qkv_format="thd",
            attn_mask_type="padding_causal",
        )
        dpa.set_context_parallel_group(self.cp_group, self.cp_ranks, self.cp_stream, comm)
        cu, cu_pad = self.cu(b)
        mine = part["idx"][self.rank]
        dout = b.tensor("dout").index_select(0, mine)
        before = te_gqa_fix.call_counts()
        # Patched: --steps training steps of the same batch (new leaves, poisoned each
        # time); the last one's gradients are compared. From the second step on, TE's call
        # takes the wrapper's cached path for a call shape it has seen.
        for _ in range(self.args.steps if patched else 1):
            q, k, v = (
                b.tensor(n).index_select(0, mine).contiguous().requires_grad_()
                for n in ("q", "k", "v")
            )
            out = _forward(dpa, b, q, k, v, cu, cu_pad)
            self.poison()
            out.backward(dout.reshape(out.shape))
            self.sync()
        backend = {
            "use_fused_attention": bool(backends.get("use_fused_attention")),
            "fused_attention_backend": (
                None
                if backends.get("fused_attention_backend") is None
                else int(backends["fused_attention_backend"])
            ),
            "use_flash_attention": bool(backends.get("use_flash_attention")),
            "use_unfused_attention": bool(backends.get("use_unfused_attention")),
        }
        after = te_gqa_fix.call_counts()
        delta = {key: after[key] - before[key] for key in after}
        if patched:
            te_gqa_fix.uninstall()
        return {
            "tensors": {
                "out": out.detach().reshape(q.shape[0], hq, -1),
                "dq": q.grad,
                "dk": k.grad,
                "dv": v.grad,
            },
            "info": {
                "rank": self.rank,
                "installed": installed,
                "call_counts": delta,
                "backend": backend,
                "out_shape": list(out.shape),
            },
        }

    def gather(self, local: torch.Tensor, part: Dict[str, Any], total: int) -> torch.Tensor:
        """All-gather one per-rank tensor and undo the THD partition (sequence order)."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self.dist.all_gather(parts, local, group=self.cp_group)
        full = torch.zeros((total, *local.shape[1:]), dtype=local.dtype, device=local.device)
        for r in range(self.world):
            full.index_copy_(0, part["idx"][r], parts[r])
        return full

    def one_config(
        self, b: Case, part: Dict[str, Any], comm: str, hq: int, hkv: int, mode: str
    ) -> Dict[str, Any]:
        args = self.args
        patched = mode == "patched"
        rec: Dict[str, Any] = {
            "cp_size": self.world,
            "cp_comm_type": comm,
            "heads_q": hq,
            "heads_kv": hkv,
            "head_dim": args.head_dim,
            "dtype": "bf16",
            "mask": "padding_causal",
            "shape": b.shape,
            "cu_seqlens": b.batch.cu_q,
            "cu_seqlens_padded": b.batch.pad_q,
            "max_seqlen": b.max_seqlen,
            "mode": mode,
            "patched": patched,
            "poisoned": bool(args.poison),
            "partition": {k: v for k, v in part.items() if k != "idx"},
        }
        t0 = time.time()
        reason = predicted_unsupported(comm, hq, hkv, self.world)
        if reason and not args.try_unsupported:
            rec.update(status="unsupported", reasons=[reason], elapsed_s=0.0)
            return rec

        # Stage 1: TE (may raise; symmetric across ranks in practice).
        local: Optional[Dict[str, Any]] = None
        err: Optional[str] = None
        try:
            local = self.run_cp(b, part, comm, hq, hkv, patched)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
            log(
                self.rank,
                f"{comm} {hq}/{hkv} {b.shape} {mode}: TE raised\n{traceback.format_exc()}",
                all_ranks=True,
            )
            with contextlib.suppress(Exception):
                import te_gqa_fix

                te_gqa_fix.uninstall()
        infos: List[Any] = [None] * self.world
        self.dist.all_gather_object(
            infos,
            {"rank": self.rank, "error": err, "info": None if local is None else local["info"]},
        )
        rec["ranks"] = infos
        errors = [i["error"] for i in infos if i["error"]]
        if errors:
            msg = errors[0]
            known = any(s in msg for s in _TE_REJECTIONS) and comm != "p2p"
            rec.update(
                status="unsupported" if known else "error",
                reasons=[("unsupported by TE (raised): " if known else "raised: ") + msg],
                elapsed_s=round(time.time() - t0, 3),
            )
            return rec

        # Stage 2: gather to every rank (collective), compare on rank 0.
        assert local is not None
        full = {name: self.gather(local["tensors"][name], part, b.total) for name in TENSORS}
        if self.rank == 0:
            self.compare(rec, b, full, infos, hq, hkv)
        rec["elapsed_s"] = round(time.time() - t0, 3)
        return rec

    def compare(
        self,
        rec: Dict[str, Any],
        b: Case,
        full: Dict[str, torch.Tensor],
        infos: List[Any],
        hq: int,
        hkv: int,
    ) -> None:
        ref = self.references(b, hq, hkv)
        valid, pad = b.valid, b.pad
        patched = rec["patched"]
        err_fp32, err_pt, atol, bound, err_single, single_fp32, pad_max, nonfinite, peak = (
            {} for _ in range(9)
        )
        for name in TENSORS:
            got = full[name]
            err_fp32[name] = max_abs(got, ref["fp32"][name], valid)
            err_pt[name] = max_abs(ref["low"][name], ref["fp32"][name], valid)
            ref_max = max_abs(ref["fp32"][name], None, valid)
            bound[name] = tolerance(err_pt[name], ref_max, b.batch.dtype, self.args.factor)
            atol[name] = bound[name] - self.args.factor * err_pt[name]
            if ref["single"] is not None:
                err_single[name] = max_abs(got, ref["single"][name], valid)
                single_fp32[name] = max_abs(ref["single"][name], ref["fp32"][name], valid)
            pad_max[name] = max_abs(got, None, pad)
            # out/dq rows of padding are not defined by TE's contract; dK/dV rows are (0).
            checked = valid if name in ("out", "dq") else torch.arange(b.total, device=got.device)
            nonfinite[name] = bool((~torch.isfinite(got.index_select(0, checked))).any().item())
            peak[name] = max_abs(got, None, torch.arange(b.total, device=got.device))

        checks: List[Tuple[str, bool, str]] = []
        for name in TENSORS:
            checks.append((f"{name} finite", not nonfinite[name], ""))
            checks.append(
                (
                    f"{name} vs fp32",
                    err_fp32[name] <= bound[name],
                    f"{err_fp32[name]:.4g} > {self.args.factor:g}*{err_pt[name]:.4g}"
                    f"+{atol[name]:.3g}",
                )
            )
            if name in err_single:
                checks.append(
                    (
                        f"{name} vs single-GPU",
                        err_single[name] <= bound[name],
                        f"{err_single[name]:.4g} > {bound[name]:.4g}",
                    )
                )
        for name in ("dk", "dv"):
            checks.append(
                (f"{name} padding rows == 0", pad_max[name] == 0.0, f"max {pad_max[name]:.4g}")
            )

        # Harness checks: the right backend ran and the patch state is what we claim.
        harness: List[Tuple[str, bool, str]] = []
        for info in infos:
            i = info["info"]
            r = info["rank"]
            harness.append(
                (
                    f"rank {r} ran FusedAttention",
                    i["backend"]["use_fused_attention"],
                    f"backend {i['backend']}",
                )
            )
            cc = i["call_counts"]
            if patched:
                harness.append(
                    (f"rank {r} patched", i["installed"], "te_gqa_fix.is_installed() False")
                )
                # On a cuDNN measured right the wrapper passes through under TE_GQA_FIX=auto.
                want = "skipped" if self.pass_through else "fixed"
                harness.append(
                    (f"rank {r} {want} calls > 0", cc[want] > 0, f"call_counts delta {cc}")
                )
                harness.append(
                    (f"rank {r} no passthrough", cc["passthrough"] == 0, f"call_counts delta {cc}")
                )
            else:
                harness.append(
                    (
                        f"rank {r} unpatched",
                        not i["installed"] and cc["calls"] == 0,
                        f"installed={i['installed']} calls={cc}",
                    )
                )
        if ref["single"] is None:
            harness.append(("single-GPU reference ran", False, ref["single_error"] or ""))
        else:
            for name in TENSORS:
                harness.append(
                    (
                        f"single-GPU {name} vs fp32",
                        single_fp32[name] <= bound[name],
                        f"{single_fp32[name]:.4g} > {bound[name]:.4g}",
                    )
                )
        part = rec["partition"]
        harness.append(
            (
                "partition covers every row once",
                part["covers_all_rows_once"] and part["equal_sizes"],
                str(part),
            )
        )

        numeric_failed = [f"{n}: {d}" for n, ok, d in checks if not ok]
        harness_failed = [f"{n}: {d}" for n, ok, d in harness if not ok]
        rec.update(
            err_vs_fp32=err_fp32,
            err_bf16_torch_vs_fp32=err_pt,
            atol=atol,
            bound=bound,
            err_vs_single=err_single,
            err_single_vs_fp32=single_fp32,
            pad_rows_max_abs=pad_max,
            peak_abs=peak,
            nonfinite=nonfinite,
            fixed_calls=[i["info"]["call_counts"]["fixed"] for i in infos],
            backend=infos[0]["info"]["backend"],
        )
        if patched:
            failed = harness_failed + numeric_failed
            rec["status"] = "pass" if not failed else "fail"
            rec["reasons"] = failed
        else:
            rec["corruption_observed"] = bool(numeric_failed)
            rec["status"] = (
                "error"
                if harness_failed
                else ("corruption_observed" if numeric_failed else "clean")
            )
            rec["reasons"] = harness_failed + numeric_failed


# ----------------------------------------------------------------------------- entry points


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or "cp_check_out",
        help="directory for the JSON/summary (default $OUT)",
    )
    p.add_argument(
        "--tag",
        default=os.environ.get("GPU_KIT_CUDNN", ""),
        help="suffix of the output file names (default $GPU_KIT_CUDNN: system/pip), so runs "
        "on both cuDNN builds can share one $OUT",
    )
    p.add_argument(
        "--comm",
        default=",".join(COMM_TYPES),
        help="cp_comm_type list (default p2p,all_gather,a2a)",
    )
    p.add_argument("--heads", default=DEFAULT_HEADS, help="q/kv head pairs, e.g. 8/2,8/1,32/8")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="te2186,tailpad,empty")
    p.add_argument("--modes", default=",".join(MODES), help="unpatched,patched")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--factor",
        type=float,
        default=2.0,
        help="bound = factor * |bf16 torch - fp32| + 2 bf16 ulps (flash-attention uses 2)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--steps",
        type=int,
        default=1,
        help="patched: training steps per configuration, the last one compared (2 or more "
        "take the wrapper's cached path for a call shape it has seen)",
    )
    p.add_argument(
        "--no-poison",
        dest="poison",
        action="store_false",
        help="do not poison the allocator before backward",
    )
    p.add_argument(
        "--poison-log2",
        type=int,
        default=28,
        help="sentinel block of 2**N fp32 (default 28: 1 GiB)",
    )
    p.add_argument(
        "--poison-small",
        type=int,
        default=64,
        help="also free N blocks of 1 MiB of sentinel (PyTorch's small-allocation pool)",
    )
    p.add_argument(
        "--try-unsupported", action="store_true", help="run configs predicted unsupported anyway"
    )
    p.add_argument(
        "--nccl-timeout", type=int, default=180, help="seconds before a stuck collective aborts"
    )
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="exercise this harness on CPU with gloo (needs a fake transformer_engine on "
        "PYTHONPATH, see evidence/tests/test_cp_check_helpers.py); tests nothing about TE",
    )
    p.add_argument(
        "--debug-te",
        action="store_true",
        help="NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 (why a backend is off)",
    )
    return p


def run(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run every config on this rank (a collective: all ranks call it); returns the results
    dict on every rank (rank 0's, broadcast) and writes files on rank 0."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    force_fused_backend(args.debug_te)
    runner = Runner(args)
    rank = runner.rank
    results: Dict[str, Any] = {
        "poison": bool(args.poison),
        "config": {k: v for k, v in vars(args).items()},
        "records": [],
        "stack": {},
    }
    try:
        results["stack"] = runner.stack()
        runner.pass_through = results["stack"].get("te_gqa_fix_policy") == "auto" and (
            rules.judge(runner.capability(), te_cudnn_version()).status == "right"
        )
        # The cuDNN every worker's TE runs (TE_GQA_FIX_CUDNN acts per process).
        per_rank: List[Any] = [None] * runner.world
        runner.dist.all_gather_object(per_rank, results["stack"].get("cudnn_te"))
        results["stack"]["cudnn_te_per_rank"] = per_rank
        log(rank, f"stack: {json.dumps(results['stack'], default=str)}")
        comms = [c for c in args.comm.split(",") if c]
        heads = parse_heads(args.heads)
        shapes = [s for s in args.shapes.split(",") if s]
        modes = [m for m in args.modes.split(",") if m]
        for bad in set(comms) - set(COMM_TYPES):
            raise ValueError(f"unknown cp_comm_type {bad!r}")
        for bad in set(modes) - set(MODES):
            raise ValueError(f"unknown mode {bad!r}")
        for shape in shapes:
            for hq, hkv in heads:
                setup_error: Optional[str] = None
                try:
                    b = runner.batch(shape, hq, hkv)
                    part = runner.partition(b)
                    log(
                        rank,
                        f"shape {shape}: cu_seqlens {b.batch.cu_q} padded "
                        f"{b.batch.pad_q} partition via {part['source']}",
                    )
                except Exception as exc:  # same inputs on every rank: fails on all alike
                    setup_error = f"setup: {type(exc).__name__}: {exc}"
                    log(rank, traceback.format_exc(), all_ranks=True)
                for comm in comms:
                    for mode in modes:
                        t0 = time.time()
                        try:
                            if setup_error is not None:
                                raise RuntimeError(setup_error)
                            rec = runner.one_config(b, part, comm, hq, hkv, mode)
                        except Exception as exc:  # a harness bug: record, keep going
                            rec = {
                                "cp_size": runner.world,
                                "cp_comm_type": comm,
                                "heads_q": hq,
                                "heads_kv": hkv,
                                "shape": shape,
                                "mode": mode,
                                "patched": mode == "patched",
                                "status": "error",
                                "reasons": [f"harness: {type(exc).__name__}: {exc}"],
                                "traceback": traceback.format_exc(limit=8),
                            }
                            log(rank, rec["traceback"], all_ranks=True)
                        rec.setdefault("elapsed_s", round(time.time() - t0, 3))
                        rec["cudnn_te"] = results["stack"].get("cudnn_te")
                        results["records"].append(rec)
                        if rank == 0:
                            log(
                                rank,
                                f"{comm:<10} {hq}/{hkv} {shape:<7} {mode:<9} -> "
                                f"{rec.get('status')} ({rec['elapsed_s']:.1f}s)",
                            )
                            write_results(args.out, results)
                runner.refs.clear()
    except Exception as exc:
        results["fatal"] = f"{type(exc).__name__}: {exc}"
        log(rank, traceback.format_exc(), all_ranks=True)
    finally:
        if rank == 0:
            paths = write_results(args.out, results)
            print(summary_table(results), flush=True)
            print(f"[cp_check] wrote {paths[0]} and {paths[1]}", flush=True)
    box = [results if rank == 0 else None]
    with contextlib.suppress(Exception):
        runner.dist.broadcast_object_list(box, src=0)
    shared = box[0] if box[0] is not None else results
    if runner.created_pg:
        with contextlib.suppress(Exception):
            runner.dist.barrier()
        runner.dist.destroy_process_group()
    return shared


def main(argv: Optional[Sequence[str]] = None) -> int:
    results = run(argv)
    return 0 if not check_results(results) else 1


if __name__ == "__main__":
    if "--cpu-dry-run" not in sys.argv:
        # TE must load its cuDNN before anything in torch (NCCL init, cudnn queries) loads
        # torch's copy: otherwise the process maps a mix of two cuDNN builds and fails.
        with contextlib.suppress(ImportError):
            import transformer_engine.pytorch  # noqa: F401
    sys.exit(main())
