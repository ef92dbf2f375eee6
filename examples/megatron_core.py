"""Megatron-Core training with packed THD sequences, GQA and context parallelism.

    torchrun --standalone --nproc-per-node 2 examples/megatron_core.py --steps 24 --out run.json

A small Megatron-Core ``GPTModel`` built with the Transformer Engine layer spec
(``get_gpt_layer_with_transformer_engine_spec``: TE's fused attention, cuDNN backend), GQA
(16 query heads, 4 query groups, head dim 128), bf16, RoPE, trained for ``--steps`` optimizer
steps on a fixed synthetic dataset of packed sequences, with Megatron's own machinery:
``parallel_state`` (context-parallel group of ``--cp`` ranks, default all of them),
``Float16Module`` + ``DistributedDataParallel``, the no-pipelining
``forward_backward_func`` with per-token loss (``calculate_per_token_loss``: the gradient is
the mean over every loss token of the global batch, whatever the CP size), and
``get_megatron_optimizer`` (Adam, fp32 main params, gradient clipping at 1.0).

The packed batch is what Megatron's sequence packing hands the model: documents of mixed
lengths, each padded to a multiple of ``2 * cp`` (CP load balancing), the bin's tail padded
onto the last document, described by ``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv,
cu_seqlens_q/kv_padded, max_seqlen_q/kv)``, and split across the CP ranks by Megatron-Core's
``get_batch_on_this_cp_rank`` (per-document zigzag through TE's
``thd_get_partitioned_indices``). The padding multiple defaults to 4 for CP 1 and 2, so a
CP-1 run sees the very same global batch as a CP-2 run.

This file contains **no te-gqa-fix call**. With ``TE_GQA_FIX_AUTOPATCH=1`` in the
environment (and te-gqa-fix pip-installed, which puts its start-up file in site-packages),
every rank gets the fix the moment Megatron imports ``transformer_engine.pytorch``; the
``te_gqa_fix`` logger says so at INFO level, which is why logging is configured at INFO
before anything imports TE. Without the variable TE runs unmodified. The JSON records, by
plain introspection, whether TE's ``fused_attn_bwd`` names are wrapped (``__wrapped__``).

``--poison`` is the deterministic trigger of the bug notes: a forward hook on every
``TEDotProductAttention`` registers a gradient hook on its output, so right before each
attention backward the caching allocator is emptied, handed a 1 GiB block (and 64 blocks of
1 MiB) filled with 1000.0 on the compute stream and on TE's CP stream, and those blocks are
freed at once. A workspace cuDNN never writes then reads 1000 instead of whatever happened
to be there. The hook mutates nothing else: no parameter, activation, gradient or RNG
state is touched (the blocks are fresh allocations, dropped before the backward runs).

Per step, rank 0 prints ``step, loss, grad norm, attention grad norm, nan`` and, with
``--out``, writes a JSON of every step: the loss, Megatron's reported grad norm, the grad
norm / max |grad| / non-finite count of each parameter group (attention qkv and proj per
layer and in total, MLP, norms, embedding, output layer) read from DDP's reduced main
grads before the optimizer step, and checksums of the weights at the start and at the end.
The stack (torch, TE, cuDNN TE runs, Megatron-Core, GPU, environment) goes in the header.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import sys
import time
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

PAD_ID = 0
# Parameter groups reported per step (first match wins), by Megatron-Core's parameter names.
GROUPS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("attn_qkv", ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")),
    ("attn_norm", ("self_attention.linear_qkv.layer_norm",)),
    ("attn_proj", ("self_attention.linear_proj.",)),
    ("mlp", (".mlp.",)),
    ("embedding", ("embedding.",)),
    ("output_layer", ("output_layer.",)),
)
# TE's modules that hold fused_attn_bwd by name (the call sites te-gqa-fix rebinds).
TE_SITES = (
    "transformer_engine.pytorch.cpp_extensions.fused_attn",
    "transformer_engine.pytorch.attention.dot_product_attention.backends",
    "transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
)


# ----------------------------------------------------------------------------- data


def pad_multiple_for(cp: int, requested: int = 0) -> int:
    """Megatron pads every packed document to a multiple of 2 * cp (CP load balancing).
    Default 4 = 2 * max(cp, 2): CP 1 and CP 2 then pack the identical global batch."""
    mult = requested or 2 * max(cp, 2)
    if mult % (2 * cp):
        raise ValueError(f"--pad-multiple {mult} is not a multiple of 2 * cp = {2 * cp}")
    return mult


def doc_lengths(gen: torch.Generator, count: int) -> List[int]:
    """Mixed document lengths: short ones (1-24 tokens, like short SFT samples) and long ones."""
    out = []
    for _ in range(count):
        if torch.rand((), generator=gen).item() < 0.5:
            out.append(int(torch.randint(1, 25, (), generator=gen)))
        else:
            out.append(int(torch.randint(64, 1025, (), generator=gen)))
    return out


def markov_tokens(gen: torch.Generator, n: int, vocab: int, perm: torch.Tensor) -> List[int]:
    """A learnable stream: the next token is perm[current - 1] with probability 3/4
    (``perm`` maps 1..vocab-1 onto itself, so padding id 0 never appears in a document)."""
    toks = [int(torch.randint(1, vocab, (), generator=gen))]
    for _ in range(n - 1):
        if torch.rand((), generator=gen).item() < 0.75:
            toks.append(int(perm[toks[-1] - 1]))
        else:
            toks.append(int(torch.randint(1, vocab, (), generator=gen)))
    return toks


def pack_bin(docs: Sequence[Sequence[int]], seq_length: int, pad_multiple: int) -> Dict[str, Any]:
    """One packed sample (plain lists): each document padded to ``pad_multiple``, the bin's
    tail padding attached to the last document (``cu_seqlens_padded[-1] == seq_length``).

    ``labels[i]`` is the next token of the same document; ``loss_mask`` is 1 on tokens that
    have one (not on a document's last token, not on padding).
    """
    tokens: List[int] = []
    labels: List[int] = []
    loss_mask: List[float] = []
    position_ids: List[int] = []
    cu = [0]
    cu_pad = [0]
    for doc in docs:
        n = len(doc)
        if n < 1:
            raise ValueError("empty document")
        padded = -(-n // pad_multiple) * pad_multiple
        tokens += list(doc) + [PAD_ID] * (padded - n)
        labels += list(doc[1:]) + [PAD_ID] * (padded - n + 1)
        loss_mask += [1.0] * (n - 1) + [0.0] * (padded - n + 1)
        position_ids += list(range(n)) + [0] * (padded - n)
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + padded)
    if cu_pad[-1] > seq_length:
        raise ValueError(f"documents need {cu_pad[-1]} tokens, the bin holds {seq_length}")
    tail = seq_length - cu_pad[-1]
    if tail % pad_multiple:
        raise ValueError(f"seq_length {seq_length} is not a multiple of {pad_multiple}")
    tokens += [PAD_ID] * tail
    labels += [PAD_ID] * tail
    loss_mask += [0.0] * tail
    position_ids += [0] * tail
    cu_pad[-1] = seq_length
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": cu,
        "cu_seqlens_padded": cu_pad,
        "max_seqlen": max(b - a for a, b in zip(cu_pad[:-1], cu_pad[1:])),
    }


def make_dataset(
    seed: int, num_bins: int, seq_length: int, vocab: int, pad_multiple: int
) -> List[Dict[str, Any]]:
    """The fixed synthetic dataset: ``num_bins`` packed samples, a function of the arguments
    only (CPU generator), identical on every rank and for every CP size."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab - 1, generator=gen) + 1  # the chain never emits PAD_ID
    bins = []
    for _ in range(num_bins):
        docs: List[List[int]] = []
        used = 0
        while True:
            (n,) = doc_lengths(gen, 1)
            need = -(-n // pad_multiple) * pad_multiple
            if used + need > seq_length:
                break
            docs.append(markov_tokens(gen, n, vocab, perm))
            used += need
        bins.append(pack_bin(docs, seq_length, pad_multiple))
    return bins


# ----------------------------------------------------------------------------- helpers


def finite(x: Any) -> Any:
    """JSON-safe numbers: NaN/Inf become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def group_of(name: str) -> str:
    for group, needles in GROUPS:
        if any(n in name for n in needles):
            return group
    return "other"


def layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


def grad_stats(named_grads: Sequence[Tuple[str, torch.Tensor]]) -> Dict[str, Dict[str, Any]]:
    """Per group (and per layer for the attention groups): L2 norm, max |g|, non-finite count.
    A NaN anywhere makes the norm NaN (reported as such, never hidden)."""
    acc: Dict[str, torch.Tensor] = {}
    for name, grad in named_grads:
        group = group_of(name)
        keys = ["all", group]
        layer = layer_of(name)
        if group.startswith("attn_") and layer is not None:
            keys.append(f"layer{layer}.{group}")
        g = grad.detach().float()
        stats = torch.stack(
            [g.pow(2).sum(), g.abs().max(), (~torch.isfinite(g)).sum().float()]
        ).double()
        for key in keys:
            if key not in acc:
                acc[key] = stats.clone()
            else:
                acc[key][0] += stats[0]
                acc[key][1] = torch.maximum(acc[key][1], stats[1])
                acc[key][2] += stats[2]
    out: Dict[str, Dict[str, Any]] = {}
    for key, s in sorted(acc.items()):
        sq, mx, bad = s.tolist()
        out[key] = {"norm": math.sqrt(sq) if sq >= 0 else sq, "max_abs": mx, "nonfinite": int(bad)}
    return out


def checksum(params: Sequence[torch.Tensor]) -> Dict[str, float]:
    s = torch.zeros((), dtype=torch.float64, device=params[0].device)
    s2 = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for p in params:
        d = p.detach().double()
        s += d.sum()
        s2 += d.pow(2).sum()
    return {"sum": s.item(), "sumsq": s2.item()}


def te_sites_wrapped() -> Dict[str, Optional[bool]]:
    """Is the ``fused_attn_bwd`` each TE module holds a wrapper (``__wrapped__``)? Reads
    attributes only; calls nothing."""
    out: Dict[str, Optional[bool]] = {}
    for name in TE_SITES:
        fn = getattr(sys.modules.get(name), "fused_attn_bwd", None)
        out[name] = None if fn is None else hasattr(fn, "__wrapped__")
    return out


def make_poison(log2: int, small: int, streams) -> Any:
    """The allocator-poisoning trigger (see the module docstring)."""

    def poison() -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for stream in streams():
            with torch.cuda.stream(stream):
                blocks = [torch.full((1 << log2,), 1000.0, device="cuda")]
                blocks += [torch.full((1 << 18,), 1000.0, device="cuda") for _ in range(small)]
                del blocks

    return poison


# ----------------------------------------------------------------------------- training


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cp", type=int, default=0, help="context-parallel size (default: world)")
    p.add_argument("--cp-comm", default="p2p", help="Megatron cp_comm_type (p2p, all_gather, a2a)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="", help="JSON of every step (rank 0)")
    p.add_argument("--poison", action="store_true", help="allocator-poisoning trigger")
    p.add_argument("--poison-log2", type=int, default=28, help="poison block of 2**N fp32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4, help="num_query_groups (KV heads)")
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-length", type=int, default=4096, help="tokens per packed bin")
    p.add_argument("--micro-batches", type=int, default=2, help="packed bins per global batch")
    p.add_argument("--num-bins", type=int, default=8, help="size of the fixed dataset")
    p.add_argument("--pad-multiple", type=int, default=0, help="default 2*max(cp,2)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip-grad", type=float, default=1.0)
    return p


def stack_info(args: argparse.Namespace, world: int, cp: int) -> Dict[str, Any]:
    info: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": (
            ".".join(map(str, torch.cuda.get_device_capability()))
            if torch.cuda.is_available()
            else None
        ),
        "world_size": world,
        "cp_size": cp,
        "argv": sys.argv,
        "env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(("NVTE_", "NCCL_NVLS", "GPU_KIT", "TE_GQA_FIX", "CUDNN_"))
        },
    }
    try:
        import transformer_engine

        info["te"] = transformer_engine.__version__
        from transformer_engine.pytorch.utils import get_cudnn_version

        info["cudnn_te"] = ".".join(map(str, get_cudnn_version()))
    except Exception as exc:
        info.setdefault("cudnn_te", f"unavailable: {exc!r}")
    try:
        from megatron.core.package_info import __version__ as mcore_version

        info["megatron_core"] = mcore_version
    except Exception as exc:
        info["megatron_core"] = f"unavailable: {exc!r}"
    info["fused_attn_bwd_wrapped"] = te_sites_wrapped()
    return info


def missing(device: str, layer_spec: Any) -> List[str]:
    """What this run needs that this machine (or this launch) lacks. TE is imported before
    Megatron-Core, as Megatron-Core's own import would: TE loads its cuDNN first."""

    def why(exc: Exception) -> str:
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"

    out = [] if device != "cuda" or torch.cuda.is_available() else ["a CUDA GPU"]
    if layer_spec is None:  # TE's layer spec
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as exc:  # not installed, or a broken build
            out.append(f"Transformer Engine ({why(exc)})")
    try:
        import megatron.core  # noqa: F401
    except Exception as exc:
        out.append(f"Megatron-Core ({why(exc)})")
    if "RANK" not in os.environ:
        out.append("a torchrun launch (torchrun --nproc-per-node 2 examples/megatron_core.py)")
    return out


def main(
    argv: Optional[Sequence[str]] = None,
    *,
    device: str = "cuda",
    dist_backend: str = "nccl",
    layer_spec: Any = None,
    half: bool = True,
) -> int:
    """The training run. The keyword arguments exist for the CPU dry run of the test suite
    (``device="cpu"``, ``dist_backend="gloo"``, a non-TE ``layer_spec``, ``half=False``: fp32);
    their defaults are the real run: CUDA, NCCL, TE's layer spec, bf16."""
    args = build_parser().parse_args(argv)
    cuda = device == "cuda"
    # INFO before anything imports TE: the start-up hook (if enabled) logs there.
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    lacking = missing(device, layer_spec)
    if lacking:
        print(f"megatron_core: needs {'; '.join(lacking)}", file=sys.stderr)
        return 2
    # Only cuDNN's fused attention (the backend in question): Megatron's own switch
    # (attention_backend=fused below), which sets TE's NVTE_*_ATTN variables itself and
    # refuses values set by hand that disagree with it.

    # Megatron-Core (imports transformer_engine.pytorch, so TE loads its cuDNN before NCCL
    # or anything else in torch loads torch's copy).
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_batch_on_this_cp_rank

    if layer_spec is None:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    if args.poison and not cuda:
        raise SystemExit("--poison needs CUDA")

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        dist_backend,
        device_id=torch.device("cuda", local_rank) if cuda else None,
        timeout=datetime.timedelta(seconds=300),
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = args.cp or world
    if world % cp:
        raise SystemExit(f"world size {world} is not a multiple of --cp {cp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp
    )
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    cp_group = parallel_state.get_context_parallel_group()
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if args.micro_batches % dp:
        raise SystemExit(f"--micro-batches {args.micro_batches} must be a multiple of dp {dp}")
    torch.manual_seed(args.seed)
    if cuda:
        model_parallel_cuda_manual_seed(args.seed)
    dtype = torch.bfloat16 if half else torch.float32

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        kv_channels=args.hidden // args.heads,
        ffn_hidden_size=args.ffn,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bf16=half,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        context_parallel_size=cp,
        cp_comm_type=args.cp_comm,
        calculate_per_token_loss=True,
        attention_backend=AttnBackend.fused,
        use_cpu_initialization=not cuda,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.vocab,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    if cuda:
        model.cuda(torch.cuda.current_device())
    if half:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=0.0,
            bf16=half,
            params_dtype=dtype,
            clip_grad=args.clip_grad,
            use_distributed_optimizer=False,
        ),
        [model],
    )
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]

    if args.poison:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        poison = make_poison(
            args.poison_log2,
            64,
            lambda: (
                [torch.cuda.current_stream()]
                + ([TEDotProductAttention.cp_stream] if TEDotProductAttention.cp_stream else [])
            ),
        )

        def attach(module, inputs, output):
            t = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g: poison())

        hooked = 0
        for m in model.modules():
            if isinstance(m, TEDotProductAttention):
                m.register_forward_hook(attach)
                hooked += 1
        if rank == 0:
            print(f"[megatron_core] poison: hooked {hooked} attention modules", flush=True)

    pad_multiple = pad_multiple_for(cp, args.pad_multiple)
    dataset = make_dataset(args.seed, args.num_bins, args.seq_length, args.vocab, pad_multiple)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(device)

    def to_batch(sample: Dict[str, Any]) -> Dict[str, Any]:
        """A Megatron batch dict on the GPU, then this CP rank's share of it."""
        batch = {
            "tokens": torch.tensor([sample["tokens"]], dtype=torch.long, device=dev),
            "labels": torch.tensor([sample["labels"]], dtype=torch.long, device=dev),
            "loss_mask": torch.tensor([sample["loss_mask"]], dtype=torch.float, device=dev),
            "position_ids": torch.tensor([sample["position_ids"]], dtype=torch.long, device=dev),
            "attention_mask": None,
            "cu_seqlens": torch.tensor([sample["cu_seqlens"]], dtype=torch.int32, device=dev),
            "cu_seqlens_padded": torch.tensor(
                [sample["cu_seqlens_padded"]], dtype=torch.int32, device=dev
            ),
            "max_seqlen": torch.tensor([sample["max_seqlen"]], dtype=torch.int32, device=dev),
            "local_cp_size": None,
            "hybrid_cp_group": None,
        }
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
        cu = batch["cu_seqlens"][0]
        cu_pad = batch["cu_seqlens_padded"][0]
        batch["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_pad,
            cu_seqlens_kv_padded=cu_pad,
            max_seqlen_q=sample["max_seqlen"],
            max_seqlen_kv=sample["max_seqlen"],
        )
        return batch

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        losses = output_tensor.view(-1).float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().detach().to(torch.int)
        report = torch.stack([loss.detach(), num_tokens.float()])
        return loss, num_tokens, {"lm loss": report}

    def forward_step(data_iterator: Iterator[Dict[str, Any]], model_):
        batch = next(data_iterator)
        output = model_(
            batch["tokens"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            packed_seq_params=batch["packed_seq_params"],
        )
        return output, partial(loss_func, batch["loss_mask"])

    forward_backward = get_forward_backward_func()
    init_sum = checksum(params)
    stack = stack_info(args, world, cp)
    header = {
        "example": "examples/megatron_core.py",
        "config": {**vars(args), "cp": cp, "dp": dp, "pad_multiple": pad_multiple},
        "stack": stack,
        "dataset": {
            "bins": len(dataset),
            "docs_per_bin": [len(b["cu_seqlens"]) - 1 for b in dataset],
            "loss_tokens_per_bin": [int(sum(b["loss_mask"])) for b in dataset],
        },
        "init_checksum": init_sum,
        "poison": bool(args.poison),
        "steps": [],
    }
    if rank == 0:
        print(f"[megatron_core] stack: {json.dumps(stack, default=str)}", flush=True)
        print("step  loss        grad_norm    attn_grad_norm  nan", flush=True)

    def write(final: bool = False) -> None:
        if rank == 0 and args.out:
            header["complete"] = final
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(finite(header), f, indent=1, default=str)
            os.replace(tmp, args.out)

    g = args.micro_batches
    for step in range(args.steps):
        t0 = time.time()
        start = step * g
        samples = [dataset[(start + i) % len(dataset)] for i in range(g)][dp_rank::dp]
        batches = iter([to_batch(s) for s in samples])
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=len(samples),
            seq_length=args.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        lm = torch.stack([r["lm loss"] for r in reports]).sum(0)
        dist.all_reduce(lm, group=dp_cp_group)
        loss = (lm[0] / lm[1].clamp(min=1)).item()
        grads = [(n, p.main_grad) for n, p in named if getattr(p, "main_grad", None) is not None]
        stats = grad_stats(grads)
        ok, grad_norm, _ = optimizer.step()
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        attn = math.sqrt(
            sum(stats.get(k, {"norm": 0.0})["norm"] ** 2 for k in ("attn_qkv", "attn_proj"))
        )
        nan = (
            not math.isfinite(loss)
            or not math.isfinite(grad_norm)
            or stats.get("all", {}).get("nonfinite", 0) > 0
        )
        rec = {
            "step": step,
            "loss": loss,
            "loss_tokens": int(lm[1].item()),
            "grad_norm": grad_norm,
            "attn_grad_norm": attn,
            "update_ok": bool(ok),
            "nan": bool(nan),
            "groups": stats,
            "seconds": round(time.time() - t0, 3),
        }
        header["steps"].append(rec)
        if rank == 0:
            print(
                f"{step:>4}  {loss:<10.6g}  {grad_norm:<11.6g}  {attn:<14.6g}  {int(nan)}",
                flush=True,
            )
        write()
    header["final_checksum"] = checksum(params)
    header["fused_attn_bwd_wrapped_end"] = te_sites_wrapped()
    write(final=True)
    if rank == 0 and args.out:
        print(f"[megatron_core] wrote {args.out}", flush=True)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
