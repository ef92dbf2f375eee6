"""Bad input never becomes a silently wrong gradient or a raw traceback (issues #13, #26,
#34 and #51): the input gate, ``te_gqa_fix.checks``, across every entry point.

:data:`BAD` is the one table: each row names the entry points it applies to, the bad
argument (an edit of a good call), the error type and the start of its message, which names
the argument. Each message is stated once; ``{dq}``, ``{dk}`` and ``{dv}`` in it are the
gradients' names as the entry point says them (``q``, ``k`` and ``v`` in the wrapper),
``{of}`` what the offsets' device belongs to. The entry points:

``zero``      ``zero_dead_rows``: nothing written before it raises (every gradient's bits)
``validate``  ``zero_dead_rows`` with ``TE_GQA_FIX_VALIDATE=on`` (offset values read first)
``masks``     ``dead_row_masks``
``wrapper``   the input check of ``wrapper_for`` of a function with TE 2.20's signature:
              TE is not called (impossible offsets: TE ran, its output is left as it was)
``plan``      ``cli.plan.build_plan`` (its own parsing errors: tests/test_cli.py)
``device``    ``check_offset_errors``

After every refusal nothing is left recorded: a good call of the same entry point goes
through. The property test at the end draws random, mostly malformed calls: an entry point
either raises naming an argument (and writes nothing) or gives exactly the oracle's rows.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

import te_gqa_fix
from fakes.cuda_metadata import OnCuda
from fakes.oracle import KNOWN, Ragged, assert_rows, bits, expected_keep
from fakes.te_outputs import FakeFloat8, FakeTE, assert_untouched, call_arguments
from te_gqa_fix import InputError, OffsetsError, dead_row_masks, zero_dead_rows
from te_gqa_fix._te import OFFSET_NAMES
from te_gqa_fix.cli.plan import PlanInput, build_plan

I32 = torch.int32
META = torch.device("meta")


def _t(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


# ------------------------------------------------------------------ the good call
#: Three sequences (lq, lk) = (2, 3), (0, 2), (3, 1); dK/dV padded (a row before the first
#: sequence, gaps, a tail row), dQ not: 5 dQ rows, 10 dK/dV rows.
RAGGED = Ragged((2, 0, 3), (3, 2, 1), None, (1, 5, 7, 9), 5, 10)
OFFS = dict(zip(OFFSET_NAMES, RAGGED.tensors()))
GRADS = ("dq", "dk", "dv")


def _good_call() -> Dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    shapes = ((5, 4, 2), (10, 2, 2), (10, 2, 2))
    grads = {n: torch.randn(s, generator=gen) for n, s in zip(GRADS, shapes)}
    return dict(grads, **OFFS)


# ------------------------------------------------------------------ the entry points
def _rows(a: Dict[str, Any], name: str, grad: str) -> Any:
    return a[name] if name in a else a[grad].shape[0]


def _mask(a: Dict[str, Any]) -> Dict[str, Any]:
    names = ("attn_mask_type", "window_size", "bottom_right_diagonal")
    return {n: a[n] for n in names if n in a}


def _offsets(a: Dict[str, Any]) -> List[Any]:
    return [a[n] for n in OFFSET_NAMES]


def _zero(a: Dict[str, Any]) -> None:
    zero_dead_rows(*(a[n] for n in GRADS), *_offsets(a), **_mask(a), impl=a.get("impl", "auto"))


def _masks(a: Dict[str, Any]) -> None:
    rows = dict(rows_q=_rows(a, "rows_q", "dq"), rows_kv=_rows(a, "rows_kv", "dk"))
    dead_row_masks(*_offsets(a), **rows, **_mask(a))


def _plan(a: Dict[str, Any]) -> None:
    offsets = [None if o is None else tuple(o.tolist()) for o in _offsets(a)]
    rows = (_rows(a, "rows_q", "dq"), _rows(a, "rows_kv", "dk"))
    build_plan(PlanInput(*offsets, **_mask(a), rows_q=rows[0], rows_kv=rows[1]))  # type: ignore[arg-type]


class _Wrapper:
    """The wrapper of a fake TE 2.20 ``fused_attn_bwd``, called with the call's tensors as
    q, k and v."""

    def __init__(self) -> None:
        self.fake, self.fn = FakeTE.with_wrapper("2.20")

    def __call__(self, a: Dict[str, Any]) -> None:
        args = call_arguments("2.20", RAGGED, head_dim=2)
        args.update(q=a["dq"], k=a["dk"], v=a["dv"], **{n: a[n] for n in OFFSET_NAMES})
        self.fn(**args)


#: How each entry point names the gradients.
NAMES = {"wrapper": dict(dq="q", dk="k", dv="v")}
#: What the offsets' device belongs to, as each entry point's messages say.
DEVICE_OF = {"zero": "dk", "validate": "dk", "wrapper": "k", "masks": "cu_seqlens_q"}


# ------------------------------------------------------------------ the table
Edit = Callable[[Dict[str, Any]], Any]


def _set(**values: Any) -> Edit:
    """An edit of the call's arguments; a callable value is called with them first."""
    return lambda a: a.update({k: v(a) if callable(v) else v for k, v in values.items()})


def _offs(q: Any, kv: Any, pad_q: Any = None, pad_kv: Any = None) -> Edit:
    return _set(cu_seqlens_q=q, cu_seqlens_kv=kv, cu_seqlens_q_padded=pad_q,
                cu_seqlens_kv_padded=pad_kv)  # fmt: skip


def _views(shape: Tuple[int, ...], pick: Callable[[torch.Tensor], Dict[str, Any]]) -> Edit:
    """Gradients picked from one new buffer of ``shape`` (the others stay separate)."""
    return lambda a: a.update(pick(torch.randn(shape)))


def _interleaved(n: int) -> Edit:
    """dq's n heads on even elements, dk's n-wide head dim on odd ones of one buffer: no
    element shared, but telling so walks n steps of the overlap search."""
    return _views((20 * n + 1,), lambda b: dict(
        dq=b.as_strided((5, n, 1), (2 * n, 2, 1)), dk=b.as_strided((10, 1, n), (2 * n, 1, 2), 1),
        dv=torch.randn(10, 1, n)))  # fmt: skip


class _Dispatching(torch.Tensor):
    """A wrapper subclass (as TE's Float8Tensor is): its data lives elsewhere."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _Dispatching:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)  # type: ignore[attr-defined]

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        unwrap = lambda x: x.elem if isinstance(x, cls) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class _Plain(torch.Tensor):
    """A subclass without its own dispatch (as Megatron's and others' wrappers are)."""


def _inference(a: Dict[str, Any]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.randn(a["dv"].shape)


def _nested(rows: Sequence[int], heads: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype"
        return torch.nested.nested_tensor([torch.randn(n, heads, 2) for n in rows])


def _misaligned(a: Dict[str, Any]) -> None:
    """dk and dv float32 views of one byte buffer, dv 2 bytes after dk: every element of
    one overlaps two of the other, though no element offset is shared."""
    raw = bytearray(4 * 40 + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the buffer is not writable" (it is)
        a["dk"] = torch.frombuffer(raw, dtype=torch.float32, count=40).view(10, 2, 2)
        a["dv"] = torch.frombuffer(raw, dtype=torch.float32, count=40, offset=2).view(10, 2, 2)
    a["dk"].normal_()
    a["dv"][:, :, 1].normal_()


def _one_element(a: Dict[str, Any]) -> None:
    """dK and dV the same tensor: one row of one element, every stride 0."""
    one = torch.randn(1).as_strided((1, 1, 1), (0, 0, 0))
    a.update(cu_seqlens_kv=_t([0, 1, 1, 1]), cu_seqlens_kv_padded=None, dk=one, dv=one)


_CUDA_OFFSETS = OnCuda((4,), I32)  # offsets on a CUDA device, without a GPU: metadata only


class _AllocatorLimit(TorchFunctionMode):
    """Factory calls of more than ``limit`` elements fail as the allocator fails them, with
    ``error``: a mask of 2**31 - 1 rows, deterministically and without touching memory.
    (A function mode, not a dispatch mode: entering one of those imports torch._dynamo.)"""

    FACTORIES = ("arange", "empty", "empty_strided", "full", "ones", "zeros", "new_empty",
                 "new_full", "new_ones", "new_zeros", "scalar_tensor")  # fmt: skip

    def __init__(self, error: BaseException, limit: int = 1 << 30) -> None:
        super().__init__()
        self.error, self.limit = error, limit

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in self.FACTORIES:
            sizes = [x for x in args if isinstance(x, (list, tuple, torch.Size))]
            numbers = [x for x in args if isinstance(x, (int, float)) and not isinstance(x, bool)]
            if name == "arange":  # (end) or (start, end[, step])
                start, end = (0, numbers[0]) if len(numbers) == 1 else numbers[:2]
                count = math.ceil((end - start) / (numbers[2] if len(numbers) > 2 else 1))
            else:  # (sizes) or (*sizes)
                count = math.prod(sizes[0] if sizes else numbers)
            if count > self.limit:
                raise self.error
        return func(*args, **(kwargs or {}))


_CPU_ALLOC = RuntimeError(
    "DefaultCPUAllocator: can't allocate memory: you tried to allocate 17179869176 bytes. "
    "Error code 12 (Cannot allocate memory)"
)
_CUDA_OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")


@dataclass(frozen=True)
class Bad:
    """A row of :data:`BAD`."""

    at: str  # the entry points, space-separated
    edit: Edit
    error: type
    text: str  # the message starts with this ({dq}, {dk}, {dv}, {of}: see the docstring)
    #: a context the call runs in (e.g. an allocator that fails)
    within: Callable[[], Any] = contextlib.nullcontext


_RANGE = "expected a non-negative int, at most 2**31 - 1 (TE's int32 offsets), got"
_NOT_A_TENSOR = "expected a 1-D torch.int32 tensor of batch_size + 1 offsets, got"
_APART = "{dv}: expected memory separate from {dk}'s"
_NO_GRAD = "{dv}: expected a gradient that does not require grad"
_IN_PLACE = "{dk}: expected a torch.Tensor whose rows can be zeroed in place"
_NESTED = "expected a strided torch.Tensor of shape [tokens, heads, head_dim], got a nested tensor"
_ALLOC = "the masks for 2147483647 rows need about 69631 MiB on cpu, which could not be allocated"
ALL = "zero masks wrapper"  # where the offsets' checks apply

#: Impossible offset values (the device judges them; on CPU the call raises at once):
#: (edit, the arguments the recorded error names, the message when the values are read on
#: the host, as ``plan`` and ``TE_GQA_FIX_VALIDATE=on`` read them).
IMPOSSIBLE: Dict[str, Tuple[Edit, str, str]] = {
    "negative_kv": (_set(cu_seqlens_kv=_t([0, -3, 5, 6])), "cu_seqlens_kv, cu_seqlens_kv_padded",
                    "cu_seqlens_kv: expected non-decreasing offsets, got 0 then -3 at index 1"),
    "negative_first": (_set(cu_seqlens_kv_padded=_t([-1, 5, 7, 9])), "cu_seqlens_kv_padded",
                       "cu_seqlens_kv_padded: expected offsets >= 0, got -1 first"),
    "decreasing_q": (_set(cu_seqlens_q=_t([0, 2, 1, 5])), "cu_seqlens_q",
                     "cu_seqlens_q: expected non-decreasing offsets, got 2 then 1 at index 2"),
    "negative_q": (_set(cu_seqlens_q=_t([-1, 2, 2, 5])), "cu_seqlens_q",
                   "cu_seqlens_q: expected offsets >= 0, got -1 first"),
    "decreasing_kv_unpadded": (_set(cu_seqlens_kv=_t([0, 3, 2, 6]), cu_seqlens_kv_padded=None),
                               "cu_seqlens_kv", "cu_seqlens_kv: expected non-decreasing offsets, "
                               "got 3 then 2 at index 2"),
    "decreasing_padded": (_set(cu_seqlens_kv_padded=_t([1, 5, 4, 9])),
                          "cu_seqlens_kv, cu_seqlens_kv_padded", "cu_seqlens_kv_padded: expected "
                          "non-decreasing offsets, got 5 then 4 at index 2"),
    "past_buffer_padded": (_set(cu_seqlens_kv_padded=_t([1, 5, 7, 12])), "cu_seqlens_kv_padded",
                           "cu_seqlens_kv_padded: last offset 12 is past the 10 kv rows of the "
                           "buffer"),
    "padded_shorter_values": (_set(cu_seqlens_kv=_t([0, 3, 7, 8])),
                              "cu_seqlens_kv, cu_seqlens_kv_padded", "cu_seqlens_kv: sequence 1 "
                              "has 4 tokens but cu_seqlens_kv_padded gives it only 2 rows"),
    "one_row_short": (_set(cu_seqlens_kv=_t([0, 3, 6, 7])), "cu_seqlens_kv, cu_seqlens_kv_padded",
                      "cu_seqlens_kv: sequence 1 has 3 tokens but cu_seqlens_kv_padded gives it "
                      "only 2 rows"),
    "valid_past_buffer": (_set(cu_seqlens_q=_t([0, 2, 2, 6])), "cu_seqlens_q",
                          "cu_seqlens_q: last offset 6 is past the 5 q rows of the buffer"),
}  # fmt: skip

BAD: Dict[str, Bad] = {
    # ---- offsets: metadata
    "kv_longer": Bad(f"{ALL} plan", _offs(_t([0, 3]), _t([0, 3, 6])), InputError,
                     "cu_seqlens_kv: expected 2 offsets (batch_size + 1, as cu_seqlens_q), got 3"),
    "kv_shorter": Bad(f"{ALL} plan", _offs(_t([0, 3, 6]), _t([0, 3])), InputError,
                      "cu_seqlens_kv: expected 3 offsets (batch_size + 1, as cu_seqlens_q), got 2"),
    "padded_shorter": Bad(f"{ALL} plan", _offs(_t([0, 2, 5]), _t([0, 3, 6]), None, _t([0, 3])),
                          InputError, "cu_seqlens_kv_padded: expected 3 offsets (batch_size + 1, "
                          "as cu_seqlens_q), got 2"),
    "empty": Bad(f"{ALL} plan", _offs(_t([]), _t([])), InputError,
                 "cu_seqlens_q: expected at least one offset (batch_size + 1 >= 1), got none"),
    "float": Bad(ALL, _offs(torch.tensor([0, 2.5, 5]), _t([0, 3, 6])), InputError,
                 "cu_seqlens_q: expected dtype torch.int32 (as TE requires), got torch.float32"),
    "int64": Bad(ALL, _offs(_t([0, 2, 5]), torch.tensor([0, 3, 6])), InputError,
                 "cu_seqlens_kv: expected dtype torch.int32 (as TE requires), got torch.int64"),
    "2-D": Bad(ALL, _offs(_t([[0, 2, 5]]), _t([0, 3, 6])), InputError,
               "cu_seqlens_q: expected a 1-D tensor of batch_size + 1 offsets, got shape (1, 3)"),
    "meta": Bad(ALL, _offs(_t([0, 2, 5]), _t([0, 3, 6]), torch.empty(3, dtype=I32, device=META)),
                InputError, "cu_seqlens_q_padded: expected a tensor with data, got a meta tensor"),
    "list": Bad(ALL, _set(cu_seqlens_q=[0, 2, 2, 5]), InputError, f"cu_seqlens_q: {_NOT_A_TENSOR} list"),
    "kv_none": Bad(ALL, _set(cu_seqlens_kv=None), InputError, f"cu_seqlens_kv: {_NOT_A_TENSOR} NoneType"),
    # Before: "the attention tensors' device", in dead_row_masks too, where there are none.
    "kv_other_device": Bad("zero masks wrapper", _set(cu_seqlens_kv=_CUDA_OFFSETS), InputError,
                           "cu_seqlens_kv: expected it on {of}'s device cpu, got cuda:0"),
    "offsets_device": Bad("zero wrapper", _set(**{n: lambda a, n=n: a[n].to(META) for n in GRADS}),
                          InputError, "cu_seqlens_q: expected it on {dk}'s device meta, got cpu"),
    # ---- offsets: impossible values (two rows each: recorded, and read on the host)
    **{name: Bad("zero masks wrapper", edit, OffsetsError,
                 f"{names}: impossible offsets in this te-gqa-fix post-pass call on cpu")
       for name, (edit, names, _) in IMPOSSIBLE.items()},
    **{f"{name}_read": Bad("validate plan", edit, OffsetsError, message)
       for name, (edit, _, message) in IMPOSSIBLE.items()},
    # ---- row counts (dead_row_masks' own arguments)
    **{f"{name}={rows!r}": Bad("masks", _set(**{name: rows}), InputError, f"{name}: {_RANGE} {rows!r}")
       for name in ("rows_q", "rows_kv") for rows in (-1, 2.5, True, "10", 2**31, 10**13)},
    "rows_kv=None": Bad("masks", _set(rows_kv=None), InputError, f"rows_kv: {_RANGE} None"),
    # Inside the range but too many for the device: before, the allocator's raw error.
    **{f"{name}=2**31-1 ({type(error).__name__})": Bad(
        "masks", _set(**{name: 2**31 - 1}), InputError, f"{name}: {_ALLOC}",
        within=lambda error=error: _AllocatorLimit(error)) for name in ("rows_q", "rows_kv")
       for error in (_CPU_ALLOC, _CUDA_OOM)},
    # ---- mask arguments
    "mask_typo": Bad("zero masks plan", _set(attn_mask_type="padding_casual"), InputError,
                     "attn_mask_type: expected one of padding, no_mask, padding_causal, causal, "
                     "padding_causal_bottom_right, causal_bottom_right, arbitrary (TE's names; "
                     "'arbitrary' keeps every valid key of a sequence with queries), got "
                     "'padding_casual'"),
    "mask_none": Bad("zero masks plan", _set(attn_mask_type=None), InputError,
                     "attn_mask_type: expected one of"),
    **{f"window_{name}": Bad("zero masks plan", _set(window_size=w), InputError,
                             "window_size: expected None or (left, right), two integers from -1 "
                             f"to 2**31 - 1 (-1 = unbounded), got {w!r}") for name, w in (
        ("below", (-5, 0)), ("right_below", (0, -5)), ("one", (1,)), ("three", (1, 2, 3)),
        ("string", "wide"), ("float", (1.5, 0)), ("float_int", (2.0, 0)), ("bool_right", (2, True)),
        ("bool_left", (True, 2)), ("2**63", (2**63, 0)), ("2**31", (0, 2**31)))},
    "brd_string": Bad("zero masks plan", _set(bottom_right_diagonal="false"), InputError,
                      "bottom_right_diagonal: expected True, False or None (by mask name), got "
                      "'false'"),
    "brd_int": Bad("zero masks plan", _set(bottom_right_diagonal=1), InputError,
                   "bottom_right_diagonal: expected True, False or None"),
    # Mask arguments refused with dK/dV views of one packed buffer (nothing written either).
    "window_one_packed": Bad("zero", _views((10, 2, 2, 2), lambda b: dict(
        dk=b[:, 0], dv=b[:, 1], window_size=(1,))), InputError, "window_size: expected"),
    "impl": Bad("zero", _set(impl="gpu"), InputError,
                "impl: expected 'auto', 'torch' or 'triton', got 'gpu'"),
    # ---- the gradients (q, k, v in the wrapper): shapes and devices
    "heads_not_dividing": Bad("zero wrapper", _set(dq=torch.randn(5, 3, 2), impl="triton"),
                              InputError, "{dk}: expected a number of KV heads that divides the "
                              "query heads (3), got 2"),
    "dq_no_heads": Bad("zero wrapper", _set(dq=torch.randn(5, 0, 2)), InputError,
                       "{dk}: expected a number of KV heads that divides the query heads (0), got 2"),
    "dq_not_thd": Bad("zero wrapper", _set(dq=torch.zeros(2, 5, 2, 2)), InputError,
                      "{dq}: expected a THD tensor of shape [tokens, heads, head_dim], got (2, 5, 2, 2)"),
    "dk_not_thd": Bad("zero wrapper", _set(dk=torch.zeros(10, 2, 2, 1)), InputError,
                      "{dk}: expected a THD tensor of shape [tokens, heads, head_dim], got (10, 2, 2, 1)"),
    "dk_dv_rows": Bad("zero wrapper", _set(dv=torch.zeros(9, 2, 2)), InputError,
                      "{dv}: expected the same number of token rows as {dk} (10), got 9"),
    "dk_dv_heads": Bad("zero wrapper", _set(dv=torch.zeros(10, 1, 2)), InputError,
                       "{dv}: expected the same number of heads as {dk} (2), got 1"),
    "dq_meta": Bad("zero wrapper", _set(dq=torch.empty(5, 4, 2, device=META)), InputError,
                   "{dq}: expected it on {dk}'s device cpu, got meta"),
    "dv_meta": Bad("zero wrapper", _set(dv=torch.empty(10, 2, 2, device=META)), InputError,
                   "{dv}: expected it on {dk}'s device cpu, got meta"),
    "numpy_dk": Bad("zero wrapper", _set(dk=lambda a: a["dk"].numpy()), InputError,
                    "{dk}: expected a torch.Tensor of shape [tokens, heads, head_dim], got ndarray"),
    "numpy_dq": Bad("zero wrapper", _set(dq=lambda a: a["dq"].numpy()), InputError,
                    "{dq}: expected a torch.Tensor of shape"),
    # Before: torch's "NestedTensorImpl doesn't support sizes" from zero_dead_rows.
    "dk_nested": Bad("zero wrapper", _set(dk=_nested([3, 7], 2)), InputError, f"{{dk}}: {_NESTED}"),
    "dq_nested": Bad("zero wrapper", _set(dq=_nested([2, 3], 4)), InputError, f"{{dq}}: {_NESTED}"),
    # ---- the gradients: memory the post-pass cannot zero row by row
    "rows_expanded": Bad("zero", _set(cu_seqlens_q=_t([0, 1, 1, 2]), dq=torch.randn(1, 4, 2).expand(2, 4, 2)),
                         InputError, "dq: expected token rows that do not share memory, got shape "
                         "(2, 4, 2) with strides (0, 2, 1)"),
    "rows_overlap": Bad("zero", _set(dk=torch.randn(10, 1, 2), dv=torch.randn(40).as_strided((10, 1, 2), (2, 1, 2))),
                        InputError, "dv: expected token rows that do not share memory"),
    "rows_lattice_overlap": Bad("zero", _set(dv=torch.randn(40).as_strided((10, 2, 2), (2, 3, 1))),
                                InputError, "dv: expected token rows that do not share memory"),
    "dv_is_dk": Bad("zero", _one_element, InputError, _APART),
    "dv_shifted_right": Bad("zero", _views((10, 2, 3), lambda b: dict(dk=b[..., :2], dv=b[..., 1:])), InputError, _APART),
    "dv_shifted_left": Bad("zero", _views((10, 2, 3), lambda b: dict(dk=b[..., 1:], dv=b[..., :2])), InputError, _APART),
    "dq_dk_overlap": Bad("zero", _views((10, 6, 2), lambda b: dict(dq=b[:5, :4], dk=b[:, 3:5])), InputError,
                         "{dk}: expected memory separate from {dq}'s"),
    "dq_dk_column": Bad("zero", _views((10, 4, 2), lambda b: dict(dq=b[:5, :, :1], dk=b[:, :1],
                                                                  dv=torch.randn(10, 1, 2))),
                        InputError, "{dk}: expected memory separate from {dq}'s"),  # one column
    # Past 4096 search steps (4096 steps: accepted, tests/test_postpass.py).
    "dq_dk_interleaved_4097": Bad("zero", _interleaved(4097), InputError, "{dk}: expected memory separate"),
    # Overlaps only an exact range test, the stride check or the dtype check catches.
    "dv_shares_one_element": Bad("zero", _views((120,), lambda b: dict(
        dk=b[:40].view(10, 2, 2), dv=b.as_strided((10, 2, 2), (4, 1, 2), 39))), InputError, _APART),
    "dv_other_row_stride": Bad("zero", _views((120,), lambda b: dict(
        dk=b.as_strided((10, 2, 2), (8, 2, 1), 0), dv=b.as_strided((10, 2, 2), (12, 2, 1), 4))),
        InputError, _APART),
    "dv_other_dtype": Bad("zero", _views((120,), lambda b: dict(
        dk=b.as_strided((10, 2, 2), (8, 2, 1), 0),
        dv=b.view(torch.float16).as_strided((10, 2, 2), (8, 2, 1), 8))), InputError, _APART),
    # Element offsets 2 bytes apart: no common element offset, but shared bytes.
    "dv_misaligned": Bad("zero", _misaligned, InputError, _APART),
    "dv_requires_grad": Bad("zero", _set(dv=lambda a: a["dv"].requires_grad_()), InputError, _NO_GRAD),
    "dv_parameter": Bad("zero", _set(dv=lambda a: torch.nn.Parameter(a["dv"])), InputError, _NO_GRAD),
    "dv_view_of_leaf": Bad("zero", _set(dv=lambda a: torch.randn(10, 4, 2, requires_grad=True)[:, :2]),
                           InputError, _NO_GRAD),
    "dv_inference": Bad("zero", _set(dv=_inference), InputError,
                        "{dv}: expected a normal tensor, got an inference tensor outside inference"),
    "dk_fp8_live_transpose": Bad("zero", _set(dk=lambda a: FakeFloat8(
        torch.zeros(10, 2, 2, dtype=torch.uint8), torch.zeros(1))), InputError, _IN_PLACE),
    "dk_fp8_not_bytes": Bad("zero", _set(dk=lambda a: FakeFloat8(a["dk"])), InputError, _IN_PLACE),
    "dk_dispatching_subclass": Bad("zero", _set(dk=lambda a: _Dispatching(a["dk"])), InputError, _IN_PLACE),
    "dk_sparse_subclass": Bad("zero", _set(dk=lambda a: torch.Tensor._make_subclass(_Plain, a["dk"].to_sparse())),
                              InputError, _IN_PLACE),
    "dk_sparse": Bad("zero", _set(dk=lambda a: a["dk"].to_sparse()), InputError, _IN_PLACE),
    # ---- check_offset_errors
    **{f"device={device!r}": Bad("device", _set(device=device), InputError,
                                 "device: expected None (every device), a torch.device or a "
                                 f"device string such as 'cuda', 'cuda:1' or 'cpu', got {device!r}")
       for device in (5, 1.5, "cuda:x", "gpu", b"cpu")},
}  # fmt: skip

CASES = [
    pytest.param(case, at, id=f"{case}-{at}")
    for case, row in BAD.items() for at in row.at.split()
]  # fmt: skip


def _memory(t: Any) -> List[torch.Tensor]:
    """The bits of a gradient's memory (subclasses and FP8 storages through their data)."""
    t = getattr(t, "elem", getattr(t, "_data", t))
    if isinstance(t, np.ndarray):
        return [torch.from_numpy(t.copy())]
    if not isinstance(t, torch.Tensor) or t.device == META:
        return []
    with torch._C.DisableTorchFunctionSubclass():
        if t.is_nested:
            return [bits(x).clone() for x in t.unbind()]
        if t.layout is not torch.strided:
            return [t.coalesce().values().clone()]
        return [bits(t.detach()).clone()]


def _snapshot(a: Dict[str, Any]) -> List[torch.Tensor]:
    return [x for name in GRADS for x in _memory(a.get(name))]


@pytest.mark.parametrize("case, at", CASES)
def test_bad_input_is_refused_naming_the_argument(
    case: str, at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = BAD[case]
    names = {**dict(zip(GRADS, GRADS)), **NAMES.get(at, {}), "of": DEVICE_OF.get(at, "")}
    want = row.text.format(**names)
    call = _good_call()
    row.edit(call)
    if at == "validate":
        monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "on")
    enter: Dict[str, Callable[[Dict[str, Any]], Any]] = dict(
        zero=_zero, validate=_zero, masks=_masks, plan=_plan,
        device=lambda a: te_gqa_fix.check_offset_errors(a["device"]),
    )  # fmt: skip
    wrapper = None
    if at == "wrapper":  # a fake TE only for the rows that call it
        wrapper = enter["wrapper"] = _Wrapper()
    before = _snapshot(call)
    with pytest.raises(row.error) as info, row.within():
        enter[at](call)
    assert str(info.value).startswith(want), str(info.value)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(call))), "a gradient changed"
    if wrapper is not None:
        if row.error is OffsetsError:  # judged after TE ran: its output left as TE gave it
            assert_untouched(wrapper.fake.backend.outputs)
        else:
            assert wrapper.fake.backend.calls == [], "TE ran with bad input"
    te_gqa_fix.check_offset_errors()  # nothing left recorded
    good = _good_call()
    if at != "device":
        enter[at](good)  # the same entry point takes a good call right after
    if at in ("zero", "validate"):
        assert bool((good["dk"][0] == 0).all()), "the good call zeroed nothing"


# ------------------------------------------------------------ the fuzz of malformed calls
#: What an error may name first: the arguments of both entry points.
ARGUMENTS = (*GRADS, *OFFSET_NAMES, "attn_mask_type", "window_size", "bottom_right_diagonal",
             "rows_q", "rows_kv")  # fmt: skip
#: Mask arguments: (accepted, refused). A refused one mostly ends a draw at the first check
#: (each refusal's message is in :data:`BAD`), so accepted ones are drawn thrice as often:
#: most draws reach the offsets and gradients.
MASKS = ((*KNOWN, "arbitrary"), ("padding_casual", "", None, 3))
WINDOWS = (((-1, -1), (0, 0), (2, 0), (1, 3), None), ((-5, 0), (1,), (1, 2, 3), "wide", (1.5, 0)))
BRDS = ((None, True, False), ("false", 1))
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _mostly_accepted(values: Tuple[tuple, tuple]) -> st.SearchStrategy:
    accepted, refused = values
    return st.sampled_from([*accepted * 3, *refused])


@st.composite
def offset_lists(draw: Any, n: int) -> List[int]:
    if draw(st.integers(0, 3)) == 0:  # plain random: mostly malformed
        return draw(st.lists(st.integers(-3, 16), min_size=n, max_size=n))
    out = [draw(st.integers(0, 2))]
    for _ in range(n - 1):
        out.append(out[-1] + draw(st.integers(0, 4)))
    return out


@st.composite
def metadata(draw: Any) -> Dict[str, Any]:
    n = draw(st.integers(1, 5))
    lengths = [n] * 4
    if draw(st.integers(0, 9)) == 0:
        lengths[draw(st.integers(0, 3))] = draw(st.integers(0, 6))
    h_kv = draw(st.integers(0, 3))
    return dict(
        offs=[draw(offset_lists(k)) for k in lengths],
        pad_q=draw(st.booleans()),
        pad_kv=draw(st.booleans()),
        offs_dtype=draw(st.sampled_from([torch.int32] * 6 + [torch.int64, torch.float32])),
        rows_q=draw(st.integers(0, 16)),
        rows_kv=draw(st.integers(0, 16)),
        with_q=draw(st.booleans()),
        h_kv=h_kv,
        h_q=draw(st.sampled_from([h_kv, 2 * h_kv, 3 * h_kv, h_kv + 1])),
        h_v=draw(st.sampled_from([h_kv] * 4 + [h_kv + 1])),
        rows_v_delta=draw(st.sampled_from([0] * 8 + [1])),
        overlap=draw(st.sampled_from([None] * 6 + ["dq", "dk", "dv"])),
        mask=draw(_mostly_accepted(MASKS)),
        window=draw(_mostly_accepted(WINDOWS)),
        brd=draw(_mostly_accepted(BRDS)),
        seed=draw(st.integers(0, 2**16)),
    )


def _offsets_valid(cu: Sequence[int], pad: Optional[Sequence[int]], rows: Optional[int]) -> bool:
    """TE's contract for one side, from the definition (independent of the library)."""
    buf = cu if pad is None else pad
    for seq in (cu, buf):
        if any(x < 0 for x in seq) or any(b < a for a, b in zip(seq, seq[1:])):
            return False
    if any(buf[i + 1] - buf[i] < cu[i + 1] - cu[i] for i in range(len(cu) - 1)):
        return False
    return rows is None or buf[-1] <= rows


def _mask_valid(mask: object, window: object, brd: object) -> bool:
    mask_ok = isinstance(mask, str) and (mask in KNOWN or mask == "arbitrary")
    window_ok = window is None or (
        isinstance(window, tuple)
        and len(window) == 2
        and all(type(w) is int and w >= -1 for w in window)
    )
    return mask_ok and window_ok and (brd is None or isinstance(brd, bool))


def _oracle_ragged(cu_q: List[int], cu_kv: List[int], pad_q, pad_kv, rows_q: int, rows_kv: int):
    """The batch the offsets describe (padded offsets None: the valid ones, TE's rule)."""
    lengths = [tuple(b - a for a, b in zip(cu, cu[1:])) for cu in (cu_q, cu_kv)]
    pads = [tuple(cu if pad is None else pad) for cu, pad in ((cu_q, pad_q), (cu_kv, pad_kv))]
    return Ragged(*lengths, *pads, rows_q, rows_kv)


def _names_an_argument(exc: BaseException) -> bool:
    head = str(exc).split(":")[0]
    return any(name in [part.strip() for part in head.split(",")] for name in ARGUMENTS)


def _superset_only(case: Dict[str, Any]) -> bool:
    """A causal mask with a right window > 0: the library keeps the declared window (a
    documented superset, tests/test_postpass.py), which the oracle does not model."""
    mask = case["mask"]
    return mask in KNOWN and KNOWN[mask][0] and (case["window"] or (0, 0))[1] > 0


@FUZZ
@given(case=metadata(), rows_given=st.booleans())
def test_malformed_calls_raise_naming_an_argument_or_match_the_oracle(
    case: Dict[str, Any], rows_given: bool
) -> None:
    """One draw, two entry points: ``zero_dead_rows``, then ``build_plan`` (with the buffer
    sizes, or without: the last offsets). Validity is decided here from the definition: a
    valid call must not raise, an invalid one must, so "always raise" and "never check"
    both fail."""
    _zero_dead_rows_verdict(case)
    _plan_verdict(case, rows_given)


def _zero_dead_rows_verdict(case: Dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    rows_q, rows_kv = case["rows_q"], case["rows_kv"]
    rows_v = rows_kv + case["rows_v_delta"]

    def grad(name: str, rows: int, heads: int) -> torch.Tensor:
        if case["overlap"] == name and rows > 1:  # every row the same memory
            return torch.randn(1, heads, 2, generator=gen).expand(rows, heads, 2)
        return torch.randn(rows, heads, 2, generator=gen)

    dq = grad("dq", rows_q, case["h_q"]) if case["with_q"] else None
    dk = grad("dk", rows_kv, case["h_kv"])
    dv = grad("dv", rows_v, case["h_v"])
    cu_q, cu_kv, pq, pk = case["offs"]
    pad_q = pq if case["pad_q"] else None
    pad_kv = pk if case["pad_kv"] else None

    def t(values: Optional[List[int]]) -> Optional[torch.Tensor]:
        return None if values is None else torch.tensor(values, dtype=case["offs_dtype"])

    before = [None if x is None else x.clone() for x in (dq, dk, dv)]
    n = len(cu_q)
    overlap = case["overlap"] is not None and (case["overlap"] != "dq" or case["with_q"])
    overlap = overlap and {"dq": rows_q, "dk": rows_kv, "dv": rows_v}[case["overlap"]] > 1
    valid = (
        case["offs_dtype"] == torch.int32
        and all(len(x) == n for x in (cu_kv, *(p for p in (pad_q, pad_kv) if p is not None)))
        and rows_v == rows_kv
        and case["h_kv"] > 0
        and case["h_v"] == case["h_kv"]
        and (not case["with_q"] or (case["h_q"] > 0 and case["h_q"] % case["h_kv"] == 0))
        and not overlap
        and _mask_valid(case["mask"], case["window"], case["brd"])
        and _offsets_valid(cu_q, pad_q, rows_q if case["with_q"] else None)
        and _offsets_valid(cu_kv, pad_kv, rows_kv)
    )
    try:
        zero_dead_rows(dq, dk, dv, *map(t, (cu_q, cu_kv, pad_q, pad_kv)),  # type: ignore[arg-type]
                       attn_mask_type=case["mask"], window_size=case["window"],
                       bottom_right_diagonal=case["brd"], impl="torch")  # fmt: skip
    except InputError as exc:
        assert not valid, f"valid input refused: {exc}"
        assert _names_an_argument(exc), f"error names no argument: {exc}"
        for x, b in zip((dq, dk, dv), before):
            assert x is None or torch.equal(bits(x), bits(b)), "refused call changed a gradient"
        return
    assert valid, "malformed input accepted"
    if _superset_only(case):
        return
    ragged = _oracle_ragged(cu_q, cu_kv, pad_q, pad_kv, rows_q, rows_kv)
    keep_q, keep_kv = expected_keep(ragged, case["mask"], case["window"], case["brd"])
    for name, x, b, keep in (("dk", dk, before[1], keep_kv), ("dv", dv, before[2], keep_kv),
                             ("dq", dq, before[0], keep_q)):  # fmt: skip
        if x is not None:
            assert_rows(x, b, keep, name)  # kept rows unchanged, dead rows zeroed


def _plan_verdict(case: Dict[str, Any], rows_given: bool) -> None:
    cu_q, cu_kv, pq, pk = case["offs"]
    pad_q = pq if case["pad_q"] else None
    pad_kv = pk if case["pad_kv"] else None
    rows_q = case["rows_q"] if rows_given else None
    rows_kv = case["rows_kv"] if rows_given else None
    offsets = [None if x is None else tuple(x) for x in (cu_q, cu_kv, pad_q, pad_kv)]
    inp = PlanInput(*offsets, case["mask"], case["window"], case["brd"], rows_q, rows_kv)
    n = len(cu_q)
    lengths_ok = n >= 1 and all(
        len(x) == n for x in (cu_kv, *(p for p in (pad_q, pad_kv) if p is not None))
    )
    eff_rows_q = rows_q if rows_q is not None else (pad_q or cu_q or [0])[-1]
    eff_rows_kv = rows_kv if rows_kv is not None else (pad_kv or cu_kv or [0])[-1]
    valid = (
        lengths_ok
        and _mask_valid(case["mask"], case["window"], case["brd"])
        and _offsets_valid(cu_q, pad_q, eff_rows_q)
        and _offsets_valid(cu_kv, pad_kv, eff_rows_kv)
    )
    try:
        plan = build_plan(inp)
    except ValueError as exc:
        assert not valid, f"valid input refused: {exc}"
        assert _names_an_argument(exc), f"error names no field: {exc}"
        return
    assert valid, "malformed input accepted"
    assert plan.consistent
    if _superset_only(case):
        return
    ragged = _oracle_ragged(cu_q, cu_kv, pad_q, pad_kv, eff_rows_q, eff_rows_kv)
    keep_q, keep_kv = expected_keep(ragged, case["mask"], case["window"], case["brd"])
    assert [not z for z in plan.kv_zeroed] == keep_kv
    assert [not z for z in plan.q_zeroed] == keep_q
