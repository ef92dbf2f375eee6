"""``row_moves.move_rows``: the PyTorch path against the rule written out row by row, and the
Triton kernel against the PyTorch path, byte for byte.

On CPU the kernel runs under Triton's interpreter in one child process (this file run as a
script, as ``test_triton_postpass.py`` does); the ``gpu`` test runs it compiled.
"""

from __future__ import annotations

import random
from typing import List

import pytest
import torch

from fakes.interpreter import results, start_checks, worker_main
from te_gqa_fix.row_moves import move_rows


def _case(seed: int, device: str = "cpu"):
    """Random sides: zero-length sequences, gaps, more or fewer rows on either side, a tail;
    two tensors of different head dims, the second a strided view (heads not adjacent)."""
    rnd = random.Random(seed)
    nseq = rnd.randint(1, 6)
    lens = [[rnd.choice([0, 1, 3, 5, 8]) for _ in range(nseq)] for _ in range(2)]
    sides, rows = [], []
    for side in range(2):
        cu, pad = [0], [rnd.randint(0, 2)]
        for n in lens[side]:
            cu.append(cu[-1] + n)
            pad.append(pad[-1] + n + rnd.randint(0, 3))
        padded = rnd.random() < 0.7 or pad[0] != 0
        i32 = dict(dtype=torch.int32, device=device)
        cu_t = torch.tensor(cu, **i32).repeat_interleave(2)[::2]  # a strided view
        sides.append((cu_t, torch.tensor(pad, **i32) if padded else None))
        rows.append((pad[-1] if padded else cu[-1]) + rnd.randint(0, 3))
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rows[1], 3, 5, generator=gen)
    b = torch.randn(rows[1], 3, 2, 4, generator=gen)[:, :, 1]  # head stride 8, dim 4
    return [a.to(device), b.to(device)], rows[0], sides[0], sides[1]


def _by_the_rule(tensors, rows: int, to, source) -> List[torch.Tensor]:
    """The docstring's rule, one row at a time in Python."""
    (cu_t, pad_t), (cu_s, pad_s) = to, source
    pad_t = cu_t if pad_t is None else pad_t
    pad_s = cu_s if pad_s is None else pad_s
    outs = [torch.zeros((rows, *t.shape[1:]), dtype=t.dtype) for t in tensors]
    for b in range(cu_t.numel() - 1):
        n = min(int(cu_t[b + 1] - cu_t[b]), int(cu_s[b + 1] - cu_s[b]))
        for p in range(n):
            for out, t in zip(outs, tensors):
                out[int(pad_t[b]) + p] = t[int(pad_s[b]) + p]
    return outs


@pytest.mark.parametrize("seed", range(12))
def test_torch_path_follows_the_rule(seed: int) -> None:
    tensors, rows, to, source = _case(seed)
    got = move_rows(tensors, rows, to, source, impl="torch")
    want = _by_the_rule(tensors, rows, to, source)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), seed


def _impossible_offsets(impl: str) -> None:
    """Offsets no batch has: 2 rows of an empty buffer give zeros; descending and
    out-of-buffer offsets read and write inside the buffers."""
    i32 = dict(dtype=torch.int32)
    to, source = (torch.tensor([0, 3], **i32), None), (torch.tensor([0, 2], **i32), None)
    got = move_rows([torch.randn(0, 2, 3), torch.randn(0, 2, 3)], 4, to, source, impl=impl)
    assert all(g.shape == (4, 2, 3) and not g.any() for g in got)
    to = (torch.tensor([0, 9, 4], **i32), torch.tensor([0, -5, 2], **i32))
    source = (torch.tensor([0, 30, 31], **i32), torch.tensor([3, 20, 1], **i32))
    got = move_rows([torch.randn(6, 2, 3), torch.randn(6, 1, 2)], 5, to, source, impl=impl)
    assert [tuple(g.shape) for g in got] == [(5, 2, 3), (5, 1, 2)]


def test_torch_path_on_impossible_offsets() -> None:
    _impossible_offsets("torch")


def _kernel_matches_torch(device: str, seeds: range) -> None:
    for seed in seeds:
        tensors, rows, to, source = _case(seed, device)
        got = move_rows(tensors, rows, to, source, impl="triton")
        want = move_rows(tensors, rows, to, source, impl="torch")
        assert all(torch.equal(g, w) for g, w in zip(got, want)), seed


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    return results(start_checks(__file__, tmp_path_factory.mktemp("row_moves")))


WORKER_CHECKS = {
    "matches_torch": lambda: _kernel_matches_torch("cpu", range(12)),
    "impossible_offsets": lambda: _impossible_offsets("triton"),
}


@pytest.mark.parametrize("check", list(WORKER_CHECKS))
def test_kernel_under_the_interpreter(interpreted: dict, check: str) -> None:
    assert interpreted[check]["ok"], interpreted[check]["error"]


@pytest.mark.gpu
def test_compiled_kernel_matches_torch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    _kernel_matches_torch("cuda", range(40))


if __name__ == "__main__":
    worker_main(WORKER_CHECKS)
