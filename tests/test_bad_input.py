"""Bad input never becomes a silently wrong gradient (issues #13, #26 and #34).

One table per entry point of the post-pass: the bad input, then the exception and the start
of its message, which names the argument (``zero_dead_rows``, ``dead_row_masks``,
``check_offset_errors``); the other entry points' tables are ``REFUSED`` in test_cli.py
(``plan``) and ``BAD`` in test_hot_path.py (the wrapper's call path). The Triton kernel's side
of impossible offsets (its verdict, nothing stored, raised at the next call) runs under the
Triton interpreter in tests/test_triton_postpass.py.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

import te_gqa_fix
from fakes.oracle import assert_rows, bits, expected_keep, make_ragged
from fakes.te_outputs import FakeFloat8, FakeTE, call_arguments
from te_gqa_fix import postpass, validation, zero_dead_rows
from te_gqa_fix.postpass import dead_row_masks, launch, offset_errors
from te_gqa_fix.postpass.offset_errors import OffsetsError

I32 = torch.int32


def _t(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


# ------------------------------------------------------------- the bad-input tables
# One table per public entry point: the bad input, then the exception and the start of its
# message (which names the argument). zero_dead_rows must also write nothing before it
# raises, and a good call right after must go through (nothing stale left recorded).


def _grads(rows_q: int = 5, rows_kv: int = 10, h_q: int = 4, h_kv: int = 2, d: int = 2):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(rows_q, h_q, d, generator=gen),
        torch.randn(rows_kv, h_kv, d, generator=gen),
        torch.randn(rows_kv, h_kv, d, generator=gen),
    )


OFFS = dict(
    cu_seqlens_q=_t([0, 2, 2, 5]),
    cu_seqlens_kv=_t([0, 3, 5, 6]),
    cu_seqlens_q_padded=None,
    cu_seqlens_kv_padded=_t([1, 5, 7, 9]),
)
META = torch.device("meta")
Edit = Callable[[Dict[str, Any]], Any]


def _set(**values: Any) -> Edit:
    """An edit of the call's arguments; a callable value is called with them first."""
    return lambda a: a.update({k: v(a) if callable(v) else v for k, v in values.items()})


def _offsets(q: Any, kv: Any, pad_q: Any = None, pad_kv: Any = None) -> Edit:
    return _set(cu_seqlens_q=q, cu_seqlens_kv=kv, cu_seqlens_q_padded=pad_q,
                cu_seqlens_kv_padded=pad_kv)  # fmt: skip


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


def _inference(a: Dict[str, Any]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.randn(a["dv"].shape)


def _views(shape: Tuple[int, ...], pick: Callable[[torch.Tensor], Dict[str, Any]]) -> Edit:
    """Gradients picked from one new buffer of ``shape`` (the others stay separate)."""
    return lambda g: g.update(pick(torch.randn(shape)))


def _interleaved(n: int) -> Edit:
    """dq's n heads on even elements, dk's n-wide head dim on odd ones of one buffer: no
    element shared, but telling so walks n steps of the overlap search."""
    return _views((20 * n + 1,), lambda b: dict(
        dq=b.as_strided((5, n, 1), (2 * n, 2, 1)), dk=b.as_strided((10, 1, n), (2 * n, 1, 2), 1),
        dv=torch.randn(10, 1, n)))  # fmt: skip


_BASE = torch.randn(120)
_ONE = torch.randn(1).as_strided((1, 1, 1), (0, 0, 0))  # one element, every stride 0
with FakeTensorMode():  # offsets on a device without data here: no GPU needed
    _CUDA_OFFSETS = torch.empty(4, dtype=I32, device="cuda")
_RANGE = "expected a non-negative int, at most 2**31 - 1 (TE's int32 offsets)"
#: Bad input shared by zero_dead_rows and dead_row_masks (the same gate: the same error).
SHARED = {
    "kv_longer": (_offsets(_t([0, 3]), _t([0, 3, 6])), ValueError,
                  "cu_seqlens_kv: expected 2 offsets (batch_size + 1, as cu_seqlens_q), got 3"),
    "kv_shorter": (_offsets(_t([0, 3, 6]), _t([0, 3])), ValueError,
                   "cu_seqlens_kv: expected 3 offsets (batch_size + 1, as cu_seqlens_q), got 2"),
    "padded_shorter": (_offsets(_t([0, 2, 5]), _t([0, 3, 6]), None, _t([0, 3])), ValueError,
                       "cu_seqlens_kv_padded: expected 3 offsets (batch_size + 1, as "
                       "cu_seqlens_q), got 2"),
    "float": (_offsets(torch.tensor([0, 2.5, 5]), _t([0, 3, 6])), ValueError,
              "cu_seqlens_q: expected dtype torch.int32 (as TE requires), got torch.float32"),
    "int64": (_offsets(_t([0, 2, 5]), torch.tensor([0, 3, 6])), ValueError,
              "cu_seqlens_kv: expected dtype torch.int32 (as TE requires), got torch.int64"),
    "2-D": (_offsets(_t([[0, 2, 5]]), _t([0, 3, 6])), ValueError,
            "cu_seqlens_q: expected a 1-D tensor of batch_size + 1 offsets, got shape (1, 3)"),
    "meta": (_offsets(_t([0, 2, 5]), _t([0, 3, 6]), torch.empty(3, dtype=I32, device=META)),
             ValueError, "cu_seqlens_q_padded: expected a tensor with data, got a meta tensor"),
    "empty": (_offsets(_t([]), _t([])), ValueError,
              "cu_seqlens_q: expected at least one offset (batch_size + 1 >= 1), got none"),
    "list": (_set(cu_seqlens_q=[0, 2, 2, 5]), ValueError,
             "cu_seqlens_q: expected a 1-D torch.int32 tensor of batch_size + 1 offsets, got list"),
    "kv_none": (_set(cu_seqlens_kv=None), ValueError,
                "cu_seqlens_kv: expected a 1-D torch.int32 tensor of batch_size + 1 offsets, "
                "got NoneType"),
    # Impossible offset values (judged on the device, raised at once on CPU).
    "negative_kv": (_set(cu_seqlens_kv=_t([0, -3, 5, 6])), OffsetsError,
                    "cu_seqlens_kv, cu_seqlens_kv_padded: imp"),
    "negative_first": (_set(cu_seqlens_kv_padded=_t([-1, 5, 7, 9])), OffsetsError,
                       "cu_seqlens_kv_padded: imp"),
    "decreasing_q": (_set(cu_seqlens_q=_t([0, 2, 1, 5])), OffsetsError, "cu_seqlens_q: imp"),
    "negative_q": (_set(cu_seqlens_q=_t([-1, 2, 2, 5])), OffsetsError, "cu_seqlens_q: imp"),
    "decreasing_kv_unpadded": (_set(cu_seqlens_kv=_t([0, 3, 2, 6]), cu_seqlens_kv_padded=None),
                               OffsetsError, "cu_seqlens_kv: imp"),
    "decreasing_padded": (_set(cu_seqlens_kv_padded=_t([1, 5, 4, 9])), OffsetsError,
                          "cu_seqlens_kv, cu_seqlens_kv_padded: imp"),
    "past_buffer_padded": (_set(cu_seqlens_kv_padded=_t([1, 5, 7, 12])), OffsetsError,
                           "cu_seqlens_kv_padded: imp"),
    "padded_shorter_values": (_set(cu_seqlens_kv=_t([0, 3, 7, 8])), OffsetsError,
                              "cu_seqlens_kv, cu_seqlens_kv_padded: imp"),
    "one_row_short": (_set(cu_seqlens_kv=_t([0, 3, 6, 7])), OffsetsError,
                      "cu_seqlens_kv, cu_seqlens_kv_padded: imp"),
    "valid_past_buffer": (_set(cu_seqlens_q=_t([0, 2, 2, 6])), OffsetsError, "cu_seqlens_q: imp"),
    # Mask arguments.
    "mask_typo": (_set(attn_mask_type="padding_casual"), ValueError, "attn_mask_type: expected"),
    "mask_none": (_set(attn_mask_type=None), ValueError, "attn_mask_type: expected"),
    **{f"window_{name}": (_set(window_size=w), ValueError, "window_size: expected") for name, w in (
        ("below", (-5, 0)), ("right_below", (0, -5)), ("one", (1,)), ("three", (1, 2, 3)),
        ("string", "wide"), ("float", (1.5, 0)), ("float_int", (2.0, 0)),
        ("bool_right", (2, True)), ("bool_left", (True, 2)), ("2**63", (2**63, 0)), ("2**31", (0, 2**31)))},
    "brd_string": (_set(bottom_right_diagonal="false"), ValueError, "bottom_right_diagonal: exp"),
    "brd_int": (_set(bottom_right_diagonal=1), ValueError, "bottom_right_diagonal: expected"),
}  # fmt: skip

_DV_APART = "dv: expected memory separate from dk's"
_NO_GRAD = "dv: expected a gradient that does not require grad"
_IN_PLACE = "dk: expected a torch.Tensor whose rows can be zeroed in place"
ZERO_DEAD_ROWS = {
    **SHARED,
    "impl": (_set(impl="gpu"), ValueError, "impl: expected 'auto', 'torch' or 'triton', got 'gpu'"),
    "heads_not_dividing": (_set(dq=torch.randn(5, 3, 2), impl="triton"), ValueError,
                           "dk: expected a number of KV heads that divides"),
    "dq_not_thd": (_set(dq=torch.zeros(2, 5, 2, 2)), ValueError, "dq: expected a THD tensor of "
                   "shape [tokens, heads, head_dim], got (2, 5, 2, 2)"),
    "dk_not_thd": (_set(dk=torch.zeros(10, 2, 2, 1)), ValueError, "dk: expected a THD tensor"),
    "dk_dv_rows": (_set(dv=torch.zeros(9, 2, 2)), ValueError,
                   "dv: expected the same number of token rows as dk (10), got 9"),
    "offsets_device": (_set(**{n: torch.zeros(r, h, 2, device=META)
                               for n, r, h in (("dq", 5, 4), ("dk", 10, 2), ("dv", 10, 2))}),
                       ValueError, "cu_seqlens_q: expected it on the attention tensors' device "
                       "meta, got cpu"),
    "dk_dv_heads": (_set(dv=torch.zeros(10, 1, 2)), ValueError,
                    "dv: expected the same number of heads as dk"),
    "dq_meta": (_set(dq=torch.empty(5, 4, 2, device=META)), ValueError,
                "dq: expected it on dk's device cpu, got meta"),
    "dv_meta": (_set(dv=torch.empty(10, 2, 2, device=META)), ValueError,
                "dv: expected it on dk's device cpu, got meta"),
    "numpy_dk": (_set(dk=lambda a: a["dk"].numpy()), ValueError,
                 "dk: expected a torch.Tensor of shape [tokens, heads, head_dim], got ndarray"),
    "numpy_dq": (_set(dq=lambda a: a["dq"].numpy()), ValueError, "dq: expected a torch.Tensor"),
    "dq_no_heads": (_set(dq=torch.randn(5, 0, 2)), ValueError,
                    "dk: expected a number of KV heads that divides the query heads (0), got 2"),
    "rows_expanded": (_set(cu_seqlens_q=_t([0, 1, 1, 2]), dq=torch.randn(1, 4, 2).expand(2, 4, 2)),
                      ValueError, "dq: expected token rows that do not share memory"),
    "rows_overlap": (_set(dk=torch.randn(10, 1, 2), dv=torch.randn(40).as_strided((10, 1, 2), (2, 1, 2))),
                     ValueError, "dv: expected token rows that do not share memory"),
    "dv_is_dk": (_set(cu_seqlens_kv=_t([0, 1, 1, 1]), cu_seqlens_kv_padded=None, dk=_ONE, dv=_ONE),
                 ValueError, _DV_APART),
    "dv_shifted_right": (_views((10, 2, 3), lambda b: dict(dk=b[..., :2], dv=b[..., 1:])), ValueError, _DV_APART),
    "dv_shifted_left": (_views((10, 2, 3), lambda b: dict(dk=b[..., 1:], dv=b[..., :2])), ValueError, _DV_APART),
    "dq_dk_overlap": (_views((10, 6, 2), lambda b: dict(dq=b[:5, :4], dk=b[:, 3:5])), ValueError,
                      "dk: expected memory separate from dq's"),
    "dq_dk_column": (_views((10, 4, 2), lambda b: dict(dq=b[:5, :, :1], dk=b[:, :1],
                                                       dv=torch.randn(10, 1, 2))),
                     ValueError, "dk: expected memory separate from dq's"),  # one column
    # Past 4096 search steps (test_zero_dead_rows_zeroes_what_torch_can_write: 4096 pass).
    "dq_dk_interleaved_4097": (_interleaved(4097), ValueError, "dk: expected memory separate"),
    # Overlaps only an exact range test, the stride check or the dtype check catches.
    "dv_shares_one_element": (_set(dk=_BASE[:40].view(10, 2, 2),
                                   dv=_BASE.as_strided((10, 2, 2), (4, 1, 2), 39)),
                              ValueError, _DV_APART),
    "dv_other_row_stride": (_set(dk=_BASE.as_strided((10, 2, 2), (8, 2, 1), 0),
                                 dv=_BASE.as_strided((10, 2, 2), (12, 2, 1), 4)),
                            ValueError, _DV_APART),
    "dv_other_dtype": (_set(dk=_BASE.as_strided((10, 2, 2), (8, 2, 1), 0),
                            dv=_BASE.view(torch.float16).as_strided((10, 2, 2), (8, 2, 1), 8)),
                       ValueError, _DV_APART),
    "dv_requires_grad": (_set(dv=lambda a: a["dv"].requires_grad_()), ValueError, _NO_GRAD),
    "dv_parameter": (_set(dv=lambda a: torch.nn.Parameter(a["dv"])), ValueError, _NO_GRAD),
    "dv_view_of_leaf": (_set(dv=lambda a: torch.randn(10, 4, 2, requires_grad=True)[:, :2]),
                        ValueError, _NO_GRAD),
    "dv_inference": (_set(dv=_inference), ValueError,
                     "dv: expected a normal tensor, got an inference tensor outside inference"),
    "dk_fp8_live_transpose": (_set(dk=lambda a: FakeFloat8(torch.zeros(10, 2, 2, dtype=torch.uint8),
                                                           torch.zeros(1))), ValueError, _IN_PLACE),
    "dk_fp8_not_bytes": (_set(dk=lambda a: FakeFloat8(a["dk"])), ValueError, _IN_PLACE),
    "dk_dispatching_subclass": (_set(dk=lambda a: _Dispatching(a["dk"])), ValueError, _IN_PLACE),
    "dk_sparse_subclass": (_set(dk=lambda a: torch.Tensor._make_subclass(_Plain, a["dk"].to_sparse())),
                           ValueError, _IN_PLACE),
    "dk_sparse": (_set(dk=lambda a: a["dk"].to_sparse()), ValueError, _IN_PLACE),
    # Mask arguments refused with dK/dV views of one packed buffer (nothing written either).
    "window_one_packed": (_views((10, 2, 2, 2), lambda b: dict(dk=b[:, 0], dv=b[:, 1], window_size=(1,))),
                          ValueError, "window_size: expected"),
}  # fmt: skip


_GRADS = ("dq", "dk", "dv")


def _good_call() -> Dict[str, Any]:
    return dict(zip(_GRADS, _grads()), **OFFS)


def _snapshot(a: Dict[str, Any]) -> List[torch.Tensor]:
    """The bits of every gradient's memory (subclasses and FP8 through their data)."""
    out = []
    for name in _GRADS:
        t = a[name]
        t = getattr(t, "_data", t)
        if isinstance(t, torch.Tensor) and t.layout is torch.strided and t.device != META:
            out.append(bits(t.detach().as_subclass(torch.Tensor)).clone())
    return out


@pytest.mark.parametrize("case", list(ZERO_DEAD_ROWS))
def test_zero_dead_rows_bad_input(case: str) -> None:
    edit, error, message = ZERO_DEAD_ROWS[case]
    a = _good_call()
    edit(a)
    before = _snapshot(a)
    with pytest.raises(error) as info:
        zero_dead_rows(**a)
    assert str(info.value).startswith(message), str(info.value)
    after = _snapshot(a)
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "bad input changed a gradient"
    zero_dead_rows(**_good_call())  # nothing stale recorded


DEAD_ROW_MASKS = {
    **{f"{name}={rows!r}": (_set(**{name: rows}), ValueError, f"{name}: {_RANGE}, got {rows!r}")
       for name in ("rows_q", "rows_kv") for rows in (-1, 2.5, True, "10", 2**31, 10**13)},
    "rows_kv=None": (_set(rows_kv=None), ValueError, f"rows_kv: {_RANGE}, got None"),
    "kv_other_device": (_set(cu_seqlens_kv=_CUDA_OFFSETS), ValueError,
                        "cu_seqlens_kv: expected it on the attention tensors' device cpu, got cuda"),
}  # fmt: skip


@pytest.mark.parametrize("case", [*DEAD_ROW_MASKS, *SHARED])
def test_dead_row_masks_bad_input(case: str) -> None:
    """Its own cases, and the shared ones with exactly zero_dead_rows' error."""
    edit, error, message = DEAD_ROW_MASKS.get(case) or SHARED[case]
    a = dict(OFFS, rows_q=5, rows_kv=10)
    edit(a)
    with pytest.raises(error) as info:
        dead_row_masks(**a)
    assert str(info.value).startswith(message), str(info.value)
    if case in SHARED:
        call = _good_call()
        edit(call)
        with pytest.raises(error) as again:
            zero_dead_rows(**call)
        assert str(again.value) == str(info.value)


def test_rows_up_to_the_int32_limit_are_accepted() -> None:
    assert validation.check_rows("rows_kv", 2**31 - 1) == 2**31 - 1  # masks that big: 2 GiB


@pytest.mark.parametrize("device", [5, 1.5, "cuda:x", "gpu", b"cpu"])
def test_check_offset_errors_bad_input(device: Any) -> None:
    with pytest.raises(ValueError, match=r"^device: expected None \(every device\), a torch"):
        te_gqa_fix.check_offset_errors(device)


# ------------------------------------------------------------- what the public API zeroes


class _Plain(torch.Tensor):
    """A subclass that behaves as a tensor (as Megatron's and others' wrappers do)."""


NONE, NO_GRAD, INFERENCE = contextlib.nullcontext, torch.no_grad, torch.inference_mode
#: name -> (edit of the gradients, the context to call in)
ACCEPTED = {
    "t2hd_long": (_views((5000, 2, 2, 2), lambda b: dict(dk=b[:, 0], dv=b[:, 1])), NONE),
    "th2d": (_views((10, 2, 2, 2), lambda b: dict(dk=b[:, :, 0], dv=b[:, :, 1])), NONE),
    "t3hd": (_views((10, 3, 2, 2), lambda b: dict(dq=b[:5, 0], dk=b[:, 1], dv=b[:, 2])), NONE),
    "th3d": (_views((10, 2, 3, 2), lambda b: dict(dq=b[:5, :, 0], dk=b[:, :, 1],
                                                   dv=b[:, :, 2])), NONE),
    "heads_of_one_buffer": (_views((10, 8, 2), lambda b: dict(dq=b[:5, :4], dk=b[:, 4:6],
                                                              dv=b[:, 6:])), NONE),
    "adjacent": (_views((30, 2, 2), lambda b: dict(dk=b[:10].transpose(1, 2),
                                                   dq=b[10:20].view(5, 4, 2), dv=b[20:])), NONE),
    "heads_major_long": (_views((2, 2, 5000, 2), lambda b: dict(dk=b[:, 0].transpose(0, 1),
                                                                dv=b[:, 1].transpose(0, 1))), NONE),
    "mixed_live_dims": (_views((10, 4, 3), lambda b: dict(dq=b[:5, :, 2:3], dk=b[:, :1, :2],
                                                          dv=b[:, 1:2, :2])), NONE),
    "interleaved_4096": (_interleaved(4096), NONE),
    "empty_dq": (_set(cu_seqlens_q=_t([0, 0, 0, 0]), dq=torch.empty(0, 4, 2).as_strided(
        (0, 4, 2), (8, 2**45, 1))), NONE),  # no address, but a byte range over all others
    "one_row_overlapping_heads": (_set(cu_seqlens_q=_t([0, 1, 1, 1]),
                                       dq=torch.randn(8).as_strided((1, 4, 2), (8, 1, 1))), NONE),
    "size_one_dim_any_stride": (_set(dk=torch.randn(40).as_strided((10, 1, 3), (4, 2, 1)),
                                     dv=torch.randn(10, 1, 3), dq=torch.randn(5, 1, 3)), NONE),
    "expanded_heads": (_set(dk=torch.randn(10, 1, 2).expand(10, 2, 2),
                            dq=torch.randn(5, 4, 1).expand(5, 4, 2)), NONE),
    "subclass": (_set(dk=lambda g: g["dk"].as_subclass(_Plain)), NONE),
    "parameter_no_grad": (_set(dv=lambda g: torch.nn.Parameter(g["dv"])), NO_GRAD),
    "leaf_no_grad": (_set(dq=lambda g: g["dq"].requires_grad_()), NO_GRAD),
    "nonleaf_no_grad": (_set(dk=lambda g: g["dk"].requires_grad_() * 1), NO_GRAD),
    "inference": (_set(dk=_inference), INFERENCE),
    "fp8": (_set(dk=FakeFloat8(torch.randint(1, 255, (10, 2, 2), dtype=torch.uint8))), NONE),
}  # fmt: skip


def _plain(t: Any) -> torch.Tensor:
    return getattr(t, "_data", t).detach().as_subclass(torch.Tensor)


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_zero_dead_rows_zeroes_what_torch_can_write(case: str) -> None:
    """Each accepted form gets exactly the rows plain contiguous copies get."""
    edit, context = ACCEPTED[case]
    g = _good_call()
    edit(g)
    want = {n: _plain(g[n]).clone(memory_format=torch.contiguous_format) for n in _GRADS}
    zero_dead_rows(**{**g, **want})
    with context(), warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "masked_fill_ on expanded tensors"
        zero_dead_rows(**g)
    for name in _GRADS:
        assert torch.equal(bits(_plain(g[name])), bits(want[name])), name
    kept = g["cu_seqlens_q"][-1] == 0 or bool((want["dk"][1] != 0).any())  # no queries: none
    assert bool((want["dk"][0] == 0).all()) and kept


# ------------------------------------------------------------- impossible offsets, later


#: What TE_GQA_FIX_VALIDATE=1 says about each impossible-offsets case of SHARED.
VALIDATE_MESSAGES = {
    "negative_kv": "cu_seqlens_kv: expected non-decreasing offsets, got 0 then -3 at index 1",
    "negative_first": "cu_seqlens_kv_padded: expected offsets >= 0, got -1 first",
    "decreasing_q": "cu_seqlens_q: expected non-decreasing offsets, got 2 then 1 at index 2",
    "negative_q": "cu_seqlens_q: expected offsets >= 0, got -1 first",
    "decreasing_kv_unpadded": "cu_seqlens_kv: expected non-decreasing offsets, got 3 then 2 at "
    "index 2",
    "decreasing_padded": "cu_seqlens_kv_padded: expected non-decreasing offsets, got 5 then 4 "
    "at index 2",
    "past_buffer_padded": "cu_seqlens_kv_padded: last offset 12 is past the 10 kv rows of the "
    "buffer",
    "padded_shorter_values": "cu_seqlens_kv: sequence 1 has 4 tokens but cu_seqlens_kv_padded "
    "gives it only 2 rows",
    "one_row_short": "cu_seqlens_kv: sequence 1 has 3 tokens but cu_seqlens_kv_padded gives it "
    "only 2 rows",
    "valid_past_buffer": "cu_seqlens_q: last offset 6 is past the 5 q rows of the buffer",
}


@pytest.mark.parametrize("case", sorted(VALIDATE_MESSAGES))
def test_validate_keeps_its_immediate_check(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel judges offsets on the device (on CUDA: raised at the next call), and so
    # does the PyTorch path (SHARED's rows: no host read unless asked for);
    # TE_GQA_FIX_VALIDATE=1 reads them first and raises in the call, before the launch.
    launches: List[int] = []
    monkeypatch.setattr(postpass, "prepare_kernel", lambda *args: object())  # as on CUDA
    monkeypatch.setattr(launch, "run_kernel", lambda *args: launches.append(1))
    bad = _good_call()
    SHARED[case][0](bad)
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "0")
    zero_dead_rows(**bad)
    assert launches == [1]
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "on")  # "1": test_hot_path.py
    with pytest.raises(OffsetsError) as info:
        zero_dead_rows(**bad)
    assert str(info.value) == VALIDATE_MESSAGES[case] and launches == [1]
    zero_dead_rows(**_good_call())  # good offsets pass the host check
    assert launches == [1, 1]


def test_a_recorded_error_surfaces_at_the_next_call_and_is_cleared() -> None:
    # What the CUDA kernel does (store the argument bits into the device's pinned word),
    # simulated on the CPU record: the next call raises naming the argument, before it
    # touches anything, and the record is cleared.
    word = offset_errors.kernel_flag(torch.device("cpu"))
    word[0] = offset_errors.ARGUMENT_BITS["cu_seqlens_kv_padded"]
    call = _good_call()
    before = _snapshot(call)
    with pytest.raises(
        OffsetsError, match=r"^cu_seqlens_kv_padded: impossible offsets in an earlier"
    ):
        zero_dead_rows(**call, impl="torch")
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(call)))
    zero_dead_rows(**call, impl="torch")
    word[0] = offset_errors.ARGUMENT_BITS["cu_seqlens_q"]
    # On a CPU-only torch nothing can have been recorded on CUDA: a quiet return.
    for device in ("cuda", torch.device("cuda"), "meta"):
        te_gqa_fix.check_offset_errors(device, synchronize=True)
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_q: impossible offsets in a te-gqa-fix"):
        te_gqa_fix.check_offset_errors("cpu")
    word[0] = offset_errors.ARGUMENT_BITS["cu_seqlens_q"]
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_q: "):  # and for every device
        te_gqa_fix.check_offset_errors()
    te_gqa_fix.check_offset_errors()  # cleared


def test_the_wrapper_surfaces_a_recorded_error() -> None:
    _, wrapped = FakeTE.with_wrapper("2.20")
    ragged = make_ragged([(2, 3), (0, 2)], gaps_kv=[1, 0])
    offset_errors.kernel_flag(torch.device("cpu"))[0] = 2
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_kv: impossible offsets"):
        wrapped(**call_arguments("2.20", ragged))
    wrapped(**call_arguments("2.20", ragged))


# ------------------------------------------------------------- mask arguments


def test_arbitrary_mask_is_the_explicit_conservative_set() -> None:
    ragged = make_ragged([(2, 4), (0, 3)], gaps_kv=[1, 0])
    dq, dk, dv = _grads(ragged.rows_q, ragged.rows_kv)
    before = dk.clone()
    zero_dead_rows(dq, dk, dv, *ragged.tensors(), attn_mask_type="arbitrary")
    _, keep_kv = expected_keep(ragged, "arbitrary")
    assert keep_kv[:4] == [True] * 4
    assert_rows(dk, before, keep_kv, "dk")


def test_wrapper_keeps_conservative_set_for_unknown_masks_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, wrapped = FakeTE.with_wrapper("2.20")
    ragged = make_ragged([(2, 3), (0, 2)], gaps_kv=[1, 0])
    for mask, window in (("padding_casual", (-1, -1)), ("padding", (2**40, 0))):
        arguments = call_arguments("2.20", ragged, attn_mask_type=mask)
        arguments["window_size"] = window  # past int32: not understood either
        with caplog.at_level(logging.DEBUG, logger="te_gqa_fix"):
            wrapped(**arguments)
            wrapped(**arguments)
    records = [r for r in caplog.records if "not understood" in r.getMessage()]
    assert len(records) == 2 and records[0].levelno == logging.WARNING
    assert te_gqa_fix.call_counts()["fixed"] == 4


# ------------------------------------------------------------- Triton failure


def test_a_failing_kernel_falls_back_to_the_pytorch_post_pass(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: no test proved the fallback runs (a mutant skipping it survived).
    launches: List[int] = []

    def boom(*args: Any) -> None:
        launches.append(1)
        raise RuntimeError("compile failed")

    monkeypatch.setattr(postpass, "_broken", False)
    monkeypatch.setattr(postpass, "prepare_kernel", lambda *args: object())  # as on CUDA
    monkeypatch.setattr(launch, "run_kernel", boom)
    ragged = make_ragged([(3, 5), (0, 4), (2, 2)], gaps_q=[1, 0, 1], gaps_kv=[0, 2, 1], tail_kv=1)
    keep_q, keep_kv = expected_keep(ragged, "padding_causal")
    for _ in range(2):  # the second call goes straight to PyTorch
        dq, dk, dv = _grads(ragged.rows_q, ragged.rows_kv)
        before = [t.clone() for t in (dq, dk, dv)]
        with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
            zero_dead_rows(dq, dk, dv, *ragged.tensors(), impl="triton")
        assert_rows(dq, before[0], keep_q, "dq")
        assert_rows(dk, before[1], keep_kv, "dk")
        assert_rows(dv, before[2], keep_kv, "dv")
    assert postpass._broken is True and launches == [1]
    assert any("Triton post-pass failed" in r.getMessage() for r in caplog.records)


def test_impl_torch_never_asks_for_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args: Any) -> None:
        raise AssertionError("impl='torch' asked for a kernel plan")

    monkeypatch.setattr(postpass, "prepare_kernel", no_kernel)
    dq, dk, dv = _grads()
    zero_dead_rows(dq, dk, dv, **OFFS, impl="torch")  # type: ignore[arg-type]
    assert bool((dk[0] == 0).all())
