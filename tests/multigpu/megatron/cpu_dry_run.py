"""CPU dry run of examples/megatron_core.py: the same ``main`` with Megatron-Core's local
(non-TE) layer spec, gloo, bf16 on the CPU, world size 1, or 2 ranks (``--cp 1``: DP 2;
``--cp 2``: CP 2).

    PYTHONPATH=/path/to/megatron-core python3 tests/multigpu/megatron/cpu_dry_run.py \\
        --steps 3 --layers 2 --hidden 256 --ffn 512 --seq-length 1024 --out /tmp/dry.json

or under ``torchrun --nproc-per-node 2`` with ``--cp 1`` or ``--cp 2``. Everything of the example runs
(data packing, ``get_batch_on_this_cp_rank``, ``PackedSeqParams`` / RoPE on THD,
``GPTModel`` forward with labels, the per-token loss through ``forward_backward_func``,
Megatron's DDP, ``finalize_model_grads``, ``get_megatron_optimizer`` step, the JSON) except
TE: the core attention is the small THD reference below (per-document causal attention over
``cu_seqlens_q_padded`` starts and ``cu_seqlens_q`` lengths, GQA by head repetition; under CP it all-gathers the
sequence and keeps its rows), since Megatron's local ``DotProductAttention`` refuses packed
sequences; TE's ``thd_get_partitioned_indices`` is replaced by a Python copy. Stubs, CPU only:
``device="cuda"`` allocations go to the CPU, CUDA streams are no-ops, and ``Tensor.type()``
names ``torch.cuda.*`` (Megatron's fp16 optimizer checks it). A correct run gives the same
loss curve for world 1, DP 2 and CP 2 (bf16 rounding aside). Needs Megatron-Core on the path;
it is not a pytest test.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[3]


def load_example():
    spec = importlib.util.spec_from_file_location(
        "megatron_core_example", ROOT / "examples" / "megatron_core.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def partitioned_indices(cu_seqlens_padded, total: int, cp_size: int, cp_rank: int):
    """TE's ``thd_get_partitioned_indices`` in Python: per document, chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of its 2 * cp_size equal chunks, in order."""
    cu = [int(x) for x in cu_seqlens_padded.tolist()]
    out = []
    for a, b in zip(cu, cu[1:]):
        c = (b - a) // (2 * cp_size)
        for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out += range(a + j * c, a + (j + 1) * c)
    return torch.tensor(out, dtype=torch.long, device=cu_seqlens_padded.device)


class _FakeTex:
    thd_get_partitioned_indices = staticmethod(partitioned_indices)


def thd_core_attention_class():
    from megatron.core.transformer.module import MegatronModule

    class ThdCoreAttention(MegatronModule):
        """fp32 THD attention: what TE's fused attention computes for padding_causal."""

        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout: Optional[float] = None,
            softmax_scale: Optional[float] = None,
            cp_comm_type: Optional[str] = None,
            pg_collection=None,
        ):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.cp_group = pg_collection.cp if pg_collection is not None else None

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            **_,
        ):
            p = packed_seq_params
            assert p is not None and p.qkv_format == "thd", "the example always packs"
            assert query.dim() == 3, f"THD query must be [t, heads, dim], got {tuple(query.shape)}"
            assert p.cu_seqlens_q.dtype == torch.int32 and p.cu_seqlens_q.dim() == 1
            assert isinstance(p.max_seqlen_q, int)
            cp = torch.distributed.get_world_size(self.cp_group) if self.cp_group else 1
            if cp > 1:  # gather the whole packed sequence, attend, keep this rank's rows
                from torch.distributed.nn.functional import all_gather

                total = int(p.cu_seqlens_q_padded[-1])
                idx = [partitioned_indices(p.cu_seqlens_q_padded, total, cp, r) for r in range(cp)]
                order = torch.argsort(torch.cat(idx))
                full = [
                    torch.cat(all_gather(x.contiguous(), group=self.cp_group))[order]
                    for x in (query, key, value)
                ]
                mine = idx[torch.distributed.get_rank(self.cp_group)]
                p1 = type(p)(
                    qkv_format="thd",
                    cu_seqlens_q=p.cu_seqlens_q,
                    cu_seqlens_kv=p.cu_seqlens_kv,
                    cu_seqlens_q_padded=p.cu_seqlens_q_padded,
                    cu_seqlens_kv_padded=p.cu_seqlens_kv_padded,
                    max_seqlen_q=p.max_seqlen_q,
                    max_seqlen_kv=p.max_seqlen_kv,
                )
                saved, self.cp_group = self.cp_group, None
                try:
                    out = self.forward(*full, None, packed_seq_params=p1)
                finally:
                    self.cp_group = saved
                return out[mine]
            t, nq, d = query.shape
            nk = key.shape[1]
            assert nq % nk == 0
            cu = p.cu_seqlens_q.tolist()
            cu_pad = p.cu_seqlens_q_padded.tolist()
            assert cu_pad[-1] == t, (cu_pad[-1], t)
            assert max(b - a for a, b in zip(cu_pad, cu_pad[1:])) <= p.max_seqlen_q
            out = torch.zeros_like(query)
            k = key.repeat_interleave(nq // nk, dim=1)
            v = value.repeat_interleave(nq // nk, dim=1)
            for i in range(len(cu) - 1):
                s, n = cu_pad[i], cu[i + 1] - cu[i]
                q_i = query[s : s + n].transpose(0, 1)
                o = torch.nn.functional.scaled_dot_product_attention(
                    q_i,
                    k[s : s + n].transpose(0, 1),
                    v[s : s + n].transpose(0, 1),
                    is_causal=True,
                    scale=self.softmax_scale,
                )
                out = out.index_copy(0, torch.arange(s, s + n), o.transpose(0, 1))
            return out.reshape(t, nq * d)

    return ThdCoreAttention


class _NoStream:
    def wait_event(self, *_):
        pass

    def wait_stream(self, *_):
        pass


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def main(argv=None) -> int:
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = thd_core_attention_class()
    # Stubs (CPU only): Megatron's DDP, optimizer, clip_grads and schedules allocate small
    # tensors on device="cuda" / torch.cuda.current_device(); send those to the CPU.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.overrides.TorchFunctionMode.__enter__(_CudaToCpu())
    # Float16OptimizerWithFloat16Params accepts only tensors whose type() names torch.cuda.*.
    orig_type = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        out = orig_type(self, *args, **kwargs)
        if not args and not kwargs and out.startswith("torch.") and ".cuda." not in out:
            return "torch.cuda." + out[len("torch.") :]
        return out

    torch.Tensor.type = cuda_named_type
    import megatron.core.utils as mcore_utils

    if mcore_utils.tex is None:
        mcore_utils.tex = _FakeTex  # per-document CP split without TE
    ex = load_example()
    return ex.main(argv, device="cpu", dist_backend="gloo", layer_spec=spec, half=True)


if __name__ == "__main__":
    sys.exit(main())
