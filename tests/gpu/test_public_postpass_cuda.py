"""On the GPU: the public ``zero_dead_rows`` on CUDA tensors, both implementations.

* Against the brute-force oracle (``tests/fakes/oracle.py``) with q and kv padded offsets
  that differ and an explicit ``bottom_right_diagonal``: a launch that swaps the padded
  offsets or drops the flag fails here.
* Impossible offsets: the call zeroes nothing, records the argument on the device, and the
  next call raises ``OffsetsError`` naming it; no host sync anywhere (sync debug mode
  "error"); the record works through a CUDA-graph replay (the pinned word the kernel
  writes is device-accessible at a fixed address: this also proves Triton accepts it).

Needs CUDA (and Triton for ``impl="triton"``); not Transformer Engine.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import te_gqa_fix
from fakes.cuda_checks import capture, no_host_sync
from fakes.oracle import assert_rows, bits, expected_keep, make_ragged
from te_gqa_fix import OffsetsError, postpass, zero_dead_rows
from te_gqa_fix.checks import ARGUMENT_BITS
from te_gqa_fix.masks import key_span

pytestmark = pytest.mark.gpu

IMPLS = ("torch", "triton")


def _need(impl: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if impl == "triton":
        pytest.importorskip("triton")
        kernel, why = postpass.implementation()
        assert kernel == "triton", f"Triton imports but CUDA calls get PyTorch: {why}"


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    pairs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=6),
    gq=st.lists(st.integers(0, 4), min_size=6, max_size=6),
    gk=st.lists(st.integers(0, 4), min_size=6, max_size=6),
    lead=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    tail=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    mask=st.sampled_from(
        ["padding_causal", "padding_causal_bottom_right", "padding", "no_mask", "arbitrary"]
    ),
    window=st.tuples(st.integers(-1, 5), st.integers(-1, 5)),
    brd=st.sampled_from([None, True, False]),
    with_q=st.booleans(),
    packed=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_public_post_pass_on_cuda_matches_the_oracle(
    impl: str, pairs, gq, gk, lead, tail, mask, window, brd, with_q, packed, dtype
) -> None:
    _need(impl)
    n = len(pairs)
    if "causal" in mask and window[1] > 0:  # TE leaves right in {-1, 0} for causal masks
        window = (window[0], 0)
    ragged = make_ragged(pairs, gaps_q=gq[:n], gaps_kv=gk[:n], lead_q=lead[0],
                         lead_kv=lead[1], tail_q=tail[0], tail_kv=tail[1])  # fmt: skip
    keep_q, keep_kv = expected_keep(ragged, mask, window, brd)
    gen = torch.Generator().manual_seed(n)
    dq = torch.randn(ragged.rows_q, 8, 16, generator=gen).to(dtype).cuda()
    if packed:
        buf = torch.randn(ragged.rows_kv, 2, 2, 16, generator=gen).to(dtype).cuda()
        dk, dv = buf[:, 0], buf[:, 1]
    else:
        dk = torch.randn(ragged.rows_kv, 2, 16, generator=gen).to(dtype).cuda()
        dv = torch.randn(ragged.rows_kv, 2, 16, generator=gen).to(dtype).cuda()
    before = [t.cpu() for t in (dq, dk, dv)]
    launches = []
    real = postpass.KernelLaunch.run
    postpass.KernelLaunch.run = lambda *a: (launches.append(1), real(*a))  # type: ignore[method-assign]
    try:
        zero_dead_rows(dq if with_q else None, dk, dv, *ragged.tensors("cuda"),
                       attn_mask_type=mask, window_size=window, bottom_right_diagonal=brd,
                       impl=impl)  # fmt: skip
    finally:
        postpass.KernelLaunch.run = real  # type: ignore[method-assign]
    torch.cuda.synchronize()
    assert bool(launches) == (impl == "triton"), "the implementation asked for did not run"
    if with_q:
        assert_rows(dq.cpu(), before[0], keep_q, "dq")
    else:
        assert torch.equal(bits(dq.cpu()), bits(before[0]))
    assert_rows(dk.cpu(), before[1], keep_kv, "dk")
    assert_rows(dv.cpu(), before[2], keep_kv, "dv")
    te_gqa_fix.check_offset_errors(synchronize=True)  # good offsets record nothing


def _case(device: str = "cuda"):
    ragged = make_ragged([(3, 5), (0, 4), (2, 2)], gaps_q=[1, 0, 1], gaps_kv=[0, 2, 1])
    gen = torch.Generator().manual_seed(0)
    dq = torch.randn(ragged.rows_q, 4, 8, generator=gen).to(device)
    dk = torch.randn(ragged.rows_kv, 2, 8, generator=gen).to(device)
    dv = torch.randn(ragged.rows_kv, 2, 8, generator=gen).to(device)
    return ragged, dq, dk, dv


BAD = {
    "negative": ("cu_seqlens_kv", lambda o: o[1].copy_(torch.tensor([0, -3, 5, 6]))),
    "decreasing_padded": ("cu_seqlens_q_padded", lambda o: o[2].copy_(torch.tensor([0, 5, 4, 8]))),
    "past_buffer": ("cu_seqlens_kv_padded", lambda o: o[3].copy_(torch.tensor([0, 5, 11, 99]))),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(BAD))
def test_impossible_offsets_zero_nothing_and_surface_at_the_next_call(impl: str, case: str) -> None:
    _need(impl)
    name, spoil = BAD[case]
    ragged, dq, dk, dv = _case()
    offs = list(ragged.tensors("cuda"))
    good = [o.clone() for o in offs]
    zero_dead_rows(dq, dk, dv, *good, impl=impl)  # warm-up (compiles, allocates the word)
    torch.cuda.synchronize()
    spoil(offs)
    dq.fill_(float("nan"))  # stale values: they must survive the refused call
    before = [t.clone() for t in (dq, dk, dv)]
    with no_host_sync():
        zero_dead_rows(dq, dk, dv, *offs, impl=impl)  # no error yet, and no sync
    torch.cuda.synchronize()
    for t, b in zip((dq, dk, dv), before):
        assert torch.equal(bits(t), bits(b)), "a call with impossible offsets stored zeros"
    with no_host_sync():
        with pytest.raises(OffsetsError, match=rf"\b{name}\b.*impossible offsets in an earlier"):
            zero_dead_rows(dq, dk, dv, *good, impl=impl)
    zero_dead_rows(dq, dk, dv, *good, impl=impl)  # cleared: goes through
    te_gqa_fix.check_offset_errors(synchronize=True)
    assert postpass._no_kernel is None, postpass._no_kernel  # the kernel failed? (pinned word)


def test_check_offset_errors_sees_the_last_call() -> None:
    _need("triton")
    ragged, dq, dk, dv = _case()
    offs = list(ragged.tensors("cuda"))
    offs[0] = torch.tensor([0, 3, 1, 5], dtype=torch.int32, device="cuda")
    zero_dead_rows(dq, dk, dv, *offs)
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_q"):
        te_gqa_fix.check_offset_errors(synchronize=True)
    te_gqa_fix.check_offset_errors(synchronize=True)


def test_cuda_graph_replay_records_bad_offsets() -> None:
    """Captured with good offsets; offsets spoiled in place, replayed: nothing zeroed,
    the record names the argument; good offsets again: the replay zeroes again."""
    _need("triton")
    ragged, dq, dk, dv = _case()
    offs = list(ragged.tensors("cuda"))
    good = [o.clone() for o in offs]
    graph, _ = capture(lambda: zero_dead_rows(dq, dk, dv, *offs, impl="triton"))
    torch.cuda.synchronize()
    te_gqa_fix.check_offset_errors()
    offs[1].copy_(torch.tensor([0, 9, 5, 6], dtype=torch.int32))
    for t in (dq, dk, dv):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for t in (dq, dk, dv):
        assert bool(t.isnan().all()), "the replay with impossible offsets stored zeros"
    with pytest.raises(OffsetsError, match=r"\bcu_seqlens_kv\b"):
        te_gqa_fix.check_offset_errors()  # host read only: the replay has finished
    for o, g in zip(offs, good):
        o.copy_(g)
    graph.replay()
    torch.cuda.synchronize()
    _, keep_kv = expected_keep(ragged, "padding_causal")
    assert [not bool(r.isnan().all()) for r in dk.cpu()] == [not k for k in keep_kv]


def test_pinned_word_is_written_by_triton_directly() -> None:
    """Triton takes the pinned pointer and the kernel writes the error bits into it."""
    _need("triton")
    ragged, dq, dk, dv = _case()
    offs: List[torch.Tensor] = list(ragged.tensors("cuda"))
    offs[3] = torch.tensor([0, 5, 11, 99], dtype=torch.int32, device="cuda")
    plan = postpass.prepare(dq, dk, dv, tuple(offs), key_span("padding_causal"))
    assert plan is not None
    word = plan.err  # the device's record: slot 0 is the kernel's
    assert word.is_pinned() and word.device.type == "cpu"
    plan.run(dq, dk, dv, tuple(offs))
    torch.cuda.synchronize()
    assert int(word[0]) == ARGUMENT_BITS["cu_seqlens_kv_padded"]
