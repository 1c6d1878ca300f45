"""CUDA graphs of step functions, captured once per key and replayed.

A step function reads only static input tensors (filled before each replay) and returns its
output tensors; `run(key, fn)` captures fn the first time a key is seen (or `capture(key, fn)`
did, over other inputs) and replays it, returning the same output tensors each time (read them
before the next replay of that key). Capturing runs fn once eagerly (a warm-up) and not again:
its effects are those of one run over the inputs as they were then.
Every graph draws its activations from one memory pool: steps run one at a time, so they can
share it. Without CUDA (or with graphs turned off) `run` just calls fn: the same code runs
eagerly, which is how the CPU and the tests run it.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

Out = TypeVar("Out")


class GraphCache:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[Hashable, object] = {}
        self._pool = None
        self.captures = 0  # graphs captured so far, cleared ones included

    def clear(self) -> None:
        """Drop every graph (their static inputs are being replaced); the next run captures anew."""
        self._graphs.clear()
        self._outputs.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def run(self, key: Hashable, fn: Callable[[], Out]) -> Out:
        if not self.enabled:
            return fn()
        if key not in self._graphs:
            self.capture(key, fn)
        self._graphs[key].replay()
        return self._outputs[key]  # type: ignore[return-value]

    def capture(self, key: Hashable, fn: Callable[[], Out]) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            # Warm up on a side stream (cuBLAS handles, Triton compilation), as capture requires.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: service threads (KV transfers, checksums) may use CUDA meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = fn()
        torch.cuda.synchronize()
        # Published only once captured: a capture that fails leaves no half-made entry.
        self._graphs[key], self._outputs[key] = graph, out
        self.captures += 1
