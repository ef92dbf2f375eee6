"""The two CUDA properties the GPU tests check, written once: no host sync, and a call
captured into a CUDA graph that replays.

Not a fake: shared test code that needs a CUDA device (callers skip without one).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Tuple

import torch


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, any host sync raises (PyTorch's sync debug mode ``"error"``): what TE's
    calls inside CUDA-graph capture need of the post-pass."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def capture(fn: Callable[[], Any]) -> Tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` called once on a side stream (Triton compiles and allocations settle outside
    capture), then once more captured into a graph on that stream: ``(graph, what the
    captured call returned)``. The current stream waits for the side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out
