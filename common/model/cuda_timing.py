"""Microseconds per op on CUDA: many ops in one launch sequence (captured in a CUDA graph, or
launched plainly), timed with CUDA events over several replays."""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

REPLAYS = 20


def us_per_op(run: Callable[[], None], ops: int, graph: bool = True, replays: int = REPLAYS) -> float:
    """Median microseconds per op over `replays` runs of `run`, which launches `ops` ops. Runs it
    once first (Triton compiles, cuBLAS and flashinfer set up), then, with `graph`, captures it
    on a side stream's warm-up as torch.cuda.graph expects and times the replays."""
    run()
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        # thread_local: a service's other threads (KV transfers, checksums) may use CUDA meanwhile
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            run()
        run = g.replay
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ops)
    return statistics.median(times)


def cycled_us_per_op(ops: list[Callable[[], object]], at_least: int = 50) -> float:
    """Microseconds per op of one CUDA graph that runs the ops in turn, at least `at_least` of
    them (inputs cycled so that each op reads what the one before did not)."""
    n = max(at_least, len(ops))

    def run() -> None:
        for i in range(n):
            ops[i % len(ops)]()

    return us_per_op(run, n)
