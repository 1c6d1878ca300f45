"""What plain and speculative steps cost on this device, measured at start-up and kept per model,
drafter and device, so that a restart does not measure again.

Each batch size (the CUDA-graph sizes on a GPU; 1 and 4 on a CPU, where a step costs about
linearly in its tokens) runs a plain step and a step of each block with synthetic requests at
SHORT tokens of context; the same at LONG tokens, for one batch size, gives what each extra
token of context costs a row. A few seconds on either device; the fastest of a few runs on a
CPU (another process's load only ever slows a run down), the median of more on a GPU.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, is_dataclass

import torch

from common.engine.decoder import Decoder
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig, StepCosts
from common.engine.spec_stats import SpecStats
from common.kv.seq_cache import SeqCache

logger = logging.getLogger(__name__)

SHORT, LONG = 128, 4096
CPU_ROWS = (1, 4)
SLOPE_ROWS = {"cuda": 4, "cpu": 1}


def step_costs(decoder: Decoder, config: SpecConfig, blocks: list[int]) -> StepCosts:
    """The cached costs for this model, drafter and device, or new measurements (then cached)."""
    path = None
    if config.cache_dir:
        path = os.path.join(config.cache_dir, "step-costs", f"{_signature(decoder, blocks)}.json")
        if os.path.isfile(path):
            with open(path) as f:
                return StepCosts.from_json(json.load(f))
    start = time.perf_counter()
    costs = measure(decoder, blocks)
    logger.info("measured step costs in %.1f s%s", time.perf_counter() - start, f" (kept in {path})" if path else "")
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(costs.to_json(), f)
        os.replace(tmp, path)
    return costs


def measure(decoder: Decoder, blocks: list[int]) -> StepCosts:
    runner = decoder.runner
    graphs = decoder.graphs.enabled
    rows_list = [r for r in (decoder.sizes if graphs else CPU_ROWS) if r <= decoder.max_rows]
    short = min(SHORT, runner.cfg.max_position // 4)
    long = min(LONG, runner.cfg.max_position // 2, runner.pool.num_pages * runner.page_size // 2)
    repeats = 7 if graphs else 2
    base, slope = {}, {}
    for block in [0, *blocks]:
        for rows in rows_list:
            base[(rows, block)] = _time(decoder, rows, block, short, repeats)
        rows = min(SLOPE_ROWS.get(runner.device.type, 1), rows_list[-1])
        slope[block] = max(0.0, (_time(decoder, rows, block, long, repeats) - base[(rows, block)])
                           / (rows * (long - short)))
        # A speculative step reads all the context a plain one reads (and the draft's): whatever
        # the timing noise says, a longer context never makes it relatively cheaper.
        slope[block] = max(slope[block], slope[0])
    return StepCosts(short, base, slope)


def _time(decoder: Decoder, rows: int, block: int, context: int, repeats: int) -> float:
    with synthetic_requests(decoder, rows, block, context) as reqs:
        return time_step(decoder, reqs, block, repeats)


def time_step(decoder: Decoder, reqs: list[Request], block: int, repeats: int) -> float:
    """Seconds of one step of these requests (block 0: plain), host synchronisation included:
    the median of `repeats` runs with CUDA graphs, else the fastest; the first run, which may
    capture a graph, untimed. The requests do not advance."""
    with torch.inference_mode():
        decoder.run(reqs, block)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            decoder.run(reqs, block)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if decoder.graphs.enabled else min(times)


@contextlib.contextmanager
def synthetic_requests(decoder: Decoder, rows: int, block: int, context: int) -> Iterator[list[Request]]:
    """`rows` requests at `context` tokens of context (what their pages hold does not matter),
    able to take a step of `block`. Each has pages of its own while the pools hold enough, else
    they share pages: what they compute is never read. The pages return at the end."""
    runner, proposer = decoder.runner, decoder.proposer
    pools = [runner.pool] + ([proposer.pool] if proposer is not None else [])
    per = runner.pool.pages_for(context + max(block, 1))
    own = max(1, min(rows, min(p.num_free for p in pools) // per))
    held = [[p.alloc(per) for _ in range(own)] for p in pools]
    try:
        reqs = []
        for i in range(rows):
            req = Request(f"synthetic{i}", [0] * context, SamplingParams(max_new_tokens=1 << 20), output_ids=[1])
            req.cache = SeqCache(list(held[0][i % own]), context)
            if proposer is not None:
                req.draft_cache = SeqCache(list(held[1][i % own]), context)
                req.spec = SpecStats(max(proposer.block_size, block))
            reqs.append(req)
        yield reqs
    finally:
        for pool, pages in zip(pools, held):
            for p in pages:
                pool.free(p)


def _signature(decoder: Decoder, blocks: list[int]) -> str:
    runner, proposer = decoder.runner, decoder.proposer
    device = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else \
        f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"
    facts = {"model": asdict(runner.cfg), "proposer": proposer.name if proposer is not None else None,
             "dtype": str(runner.dtype), "device": device, "torch": torch.__version__, "graphs": decoder.graphs.enabled,
             "sizes": decoder.sizes, "page_size": runner.page_size, "blocks": blocks, "layout": asdict(runner.layout),
             "short": SHORT, "long": LONG}
    text = json.dumps(facts, sort_keys=True, default=lambda o: asdict(o) if is_dataclass(o) else str(o))
    return f"{runner.cfg.name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
