"""What a fake ``fused_attn_bwd`` returns, and the arguments TE would pass it.

The fake returns what TE returns (a list ``[dq, dk, dv, extra]``), with stale values in
every row (random, NaN, +-Inf, 1000.0), so any row the wrapper fails to zero is visible,
and keeps bit-exact copies of what it returned so a test can tell kept rows from zeroed
ones. Packed layouts return views of one buffer, as TE does.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .oracle import Ragged, assert_rows, bits, expected_keep
from .te_signatures import build_fake

FAKE_BACKEND = "F16_arbitrary_seqlen (fake)"
FAKE_DQKV_DTYPE = "kBFloat16 (fake tex.DType)"


class FakeQuantizer:
    """Stands in for TE's dQKV quantizer: the fake then returns FP8-like outputs."""

    def __init__(self, *, columnwise: bool = False, with_shape: bool = True) -> None:
        self.columnwise = columnwise
        self.with_shape = with_shape


class FakeFloat8Storage:
    """Like TE's ``Float8TensorStorage``: raw bytes in ``_data`` (logical shape), an
    optional cached transpose, ``size()`` and ``device`` but no ``shape`` attribute."""

    def __init__(self, data: torch.Tensor, transpose: Optional[torch.Tensor] = None) -> None:
        self._data = data
        self._transpose = transpose

    def size(self, *args: Any) -> Any:
        return self._data.size(*args)

    @property
    def device(self) -> torch.device:
        return self._data.device


class FakeFloat8(FakeFloat8Storage):
    """Like TE's ``Float8Tensor``: the storage plus a ``shape``."""

    @property
    def shape(self) -> torch.Size:
        return self._data.shape


def stale(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values with whole rows (dim 0) of NaN, +Inf, -Inf and 1000.0 mixed in."""
    t = (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * 10).to(dtype)
    fills = {1: float("nan"), 3: float("inf"), 4: float("-inf"), 5: 1000.0}  # by row % 7
    for r in range(t.shape[0] if t.dim() else 0):
        if r % 7 in fills:
            t[r] = fills[r % 7]
    return t


def _stale_bytes(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(1, 256, tuple(shape), generator=gen, dtype=torch.uint8)


class FakeBackend:
    """The body of a fake ``fused_attn_bwd``: make outputs, remember them bit-exactly."""

    def __init__(self, seed: int = 1234) -> None:
        self.seed = seed
        self.calls: List[Dict[str, Any]] = []
        self.returned: Optional[list] = None
        # name -> (tensor as returned (or its raw bytes), clone before the wrapper ran)
        self.outputs: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}

    def reset(self) -> None:
        self.calls.clear()
        self.returned = None
        self.outputs.clear()

    def __call__(self, args: Dict[str, Any]) -> list:
        self.calls.append(args)
        gen = torch.Generator().manual_seed(self.seed + len(self.calls))
        layout = args["dqkv_layout"] if "dqkv_layout" in args else args["qkv_layout"]
        q, k, v = args["q"], args["k"], args["v"]
        dtype = q.dtype
        buffers: Dict[str, torch.Tensor] = {}
        if layout in ("thd_t2hd", "thd_th2d"):
            t, h, d = k.shape
            if layout == "thd_t2hd":
                buf = stale((t, 2, h, d), dtype, gen)
                dk, dv = buf[:, 0], buf[:, 1]
            else:
                buf = stale((t, h, 2, d), dtype, gen)
                dk, dv = buf[:, :, 0], buf[:, :, 1]
            buffers["dkv"] = buf
            dq = stale(q.shape, dtype, gen)
        elif layout in ("t3hd", "th3d"):
            t, h, d = q.shape
            if layout == "t3hd":
                buf = stale((t, 3, h, d), dtype, gen)
                dq, dk, dv = buf[:, 0], buf[:, 1], buf[:, 2]
            else:
                buf = stale((t, h, 3, d), dtype, gen)
                dq, dk, dv = buf[:, :, 0], buf[:, :, 1], buf[:, :, 2]
            buffers["dqkv"] = buf
        else:
            dq = stale(q.shape, dtype, gen)
            dk = stale(k.shape, dtype, gen)
            dv = stale(v.shape, dtype, gen)
        quantizer = args.get("dqkv_quantizer")
        grads: List[Any] = [dq, dk, dv]
        if isinstance(quantizer, FakeQuantizer):
            cls = FakeFloat8 if quantizer.with_shape else FakeFloat8Storage
            grads = []
            for name, g in zip(("dq", "dk", "dv"), (dq, dk, dv)):
                data = _stale_bytes(g.shape, gen)
                transpose = (
                    _stale_bytes(tuple(g.shape)[::-1], gen) if quantizer.columnwise else None
                )
                grads.append(cls(data, transpose))
                buffers[name] = data
                if transpose is not None:
                    buffers[name + "_transpose"] = transpose
        else:
            buffers.update(dq=dq, dk=dk, dv=dv)
        extra = stale((5,), dtype, gen)
        buffers["extra"] = extra
        self.outputs = {name: (t, t.clone()) for name, t in buffers.items()}
        out = [*grads, extra]
        self.returned = out
        return out


class FakeTE:
    """A fake TE ``fused_attn_bwd`` of one version (exact signature) and its backend."""

    def __init__(self, version: str, seed: int = 1234) -> None:
        self.version = version
        self.backend = FakeBackend(seed)
        self.fn: Callable[..., Any] = build_fake(version, self.backend)

    @property
    def names(self) -> List[str]:
        return list(inspect.signature(self.fn).parameters)

    @classmethod
    def with_wrapper(cls, version: str) -> Tuple[FakeTE, Callable[..., Any]]:
        """A fake of ``version`` and te-gqa-fix's wrapper of its ``fused_attn_bwd``."""
        from te_gqa_fix.wrapper import wrapper_for

        fake = cls(version)
        return fake, wrapper_for(fake.fn)


def call_arguments(
    version: str,
    ragged: Ragged,
    *,
    heads_q: int = 4,
    heads_kv: int = 2,
    head_dim: int = 3,
    layout: str = "thd_thd_thd",
    attn_mask_type: str = "padding_causal",
    window_size: Tuple[int, int] = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
    dtype: torch.dtype = torch.float32,
    offsets_dtype: torch.dtype = torch.int32,
    backend: object = FAKE_BACKEND,
    dqkv_quantizer: object = None,
) -> Dict[str, Any]:
    """Every parameter of TE ``version``'s ``fused_attn_bwd``, by name, as TE passes it."""
    cu_q, cu_kv, pad_q, pad_kv = ragged.tensors()
    cu_q, cu_kv = cu_q.to(offsets_dtype), cu_kv.to(offsets_dtype)
    gen = torch.Generator().manual_seed(7)
    if layout.startswith("thd") or layout in ("t3hd", "th3d"):
        q = torch.randn(ragged.rows_q, heads_q, head_dim, generator=gen).to(dtype)
        k = torch.randn(ragged.rows_kv, heads_kv, head_dim, generator=gen).to(dtype)
    else:  # a 4-D layout: [b, s, h, d] (the post-pass must not touch it)
        q = torch.randn(2, 5, heads_q, head_dim, generator=gen).to(dtype)
        k = torch.randn(2, 5, heads_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    args: Dict[str, Any] = dict(
        max_seqlen_q=max(ragged.lq, default=0),
        max_seqlen_kv=max(ragged.lk, default=0),
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        q=q,
        k=k,
        v=v,
        o=torch.randn(q.shape, generator=gen).to(dtype),
        d_o=torch.randn(q.shape, generator=gen).to(dtype),
        fake_dtype=dtype,
        aux_ctx_tensors=[torch.zeros(2)],
        fused_attention_backend=backend,
        cu_seqlens_q_padded=pad_q,
        cu_seqlens_kv_padded=pad_kv,
        s_quantizer=None,
        dp_quantizer=None,
        dqkv_quantizer=dqkv_quantizer,
        attn_scale=None,
        dropout=0.0,
        fast_zero_fill=True,
        qkv_layout=layout,
        attn_bias_type="no_bias",
        attn_mask_type=attn_mask_type,
        softmax_type="vanilla",
        window_size=window_size,
        deterministic=False,
    )
    if version == "2.8":
        args["dqkv_dtype"] = FAKE_DQKV_DTYPE
    else:
        fmt = "thd" if layout.startswith("thd") or layout in ("t3hd", "th3d") else "bshd"
        args.update(
            o_format=fmt,
            do_format=fmt,
            dqkv_layout=layout,
            qkv_scale_inv_format=None,
            do_scale_inv_format=None,
            bottom_right_diagonal=bottom_right_diagonal,
            cuda_graph=False,
        )
    return args


def split_call(
    names: Sequence[str], arguments: Dict[str, Any], n_positional: int
) -> Tuple[List[Any], Dict[str, Any]]:
    """The first ``n_positional`` parameters positionally, the rest by keyword."""
    n = min(n_positional, len(names))
    return [arguments[x] for x in names[:n]], {x: arguments[x] for x in names[n:]}


def assert_untouched(outputs: Dict[str, Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every output of a :class:`FakeBackend` (``name -> (after, before)``) bit for bit as
    TE returned it: what a pass-through (or a call with nothing to do) must leave."""
    for name, (after, before) in outputs.items():
        assert torch.equal(bits(after), bits(before)), f"{name} was modified"


def assert_post_pass(
    outputs: Dict[str, Tuple[torch.Tensor, torch.Tensor]],
    ragged: Ragged,
    mask: object,
    window: object,
    brd: object,
    fix_q: bool = True,
) -> None:
    """The wrapper's effect on a :class:`FakeBackend`'s outputs (``name -> (after, before)``):
    dK/dV (and a packed dKV buffer) zeroed exactly where the oracle says, dQ too when
    ``fix_q``, else untouched bit for bit."""
    keep_q, keep_kv = expected_keep(ragged, mask, window, brd)
    if "dkv" in outputs:
        after, before = outputs["dkv"]
        assert_rows(after, before, keep_kv, "dkv buffer")
    for name in ("dk", "dv"):
        after, before = outputs[name]
        assert_rows(after, before, keep_kv, name)
    after, before = outputs["dq"]
    if fix_q:
        assert_rows(after, before, keep_q, "dq")
    else:
        assert torch.equal(bits(after), bits(before)), "dq must be untouched"
