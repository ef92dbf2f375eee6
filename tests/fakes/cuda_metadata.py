"""Tensors that say they are on a CUDA device, on a machine without one: shape, dtype,
strides and device, and no data (any op on them fails). For what reads metadata alone: the
input gate's device checks, the post-pass's choice of kernel.

(torch's FakeTensorMode does the same, but its first use imports torch._dynamo: seconds.)
"""

from __future__ import annotations

from typing import Any, Tuple

import torch


class OnCuda(torch.Tensor):
    """A tensor of ``shape`` and ``dtype`` on ``cuda:0``, without data."""

    @staticmethod
    def __new__(cls, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32) -> OnCuda:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape, dtype=dtype, device=torch.device("cuda", 0)
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AssertionError(f"{func} ran on a tensor that has no data (metadata only)")
