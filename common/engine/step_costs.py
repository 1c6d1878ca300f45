"""What plain and speculative steps cost on this device, measured at start-up and kept per model,
drafter and device, so that a restart does not measure again.

Each batch size that steps run at (the CUDA-graph sizes on a GPU; a few on a CPU, where a
step's cost grows with its tokens, though not in proportion) runs a plain step and a step of
each block with synthetic requests at SHORT tokens of context (a block only a choice from the
drafter's confidence takes: at the batch sizes that draft ahead); the same at LONG tokens, for one
batch size, gives what each extra token of context costs a row (interpolated between blocks for
those). Seconds to a few tens of
seconds on either device, once per model, drafter and device; the fastest of a few runs on a CPU
(another process's load only ever slows a run down), the median of more on a GPU.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
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
from common.engine.spec_policy import SpecConfig, StepCosts, between_blocks
from common.engine.spec_stats import SpecStats
from common.kv.seq_cache import SeqCache
from common.model.cache import building, write_json

logger = logging.getLogger(__name__)

SHORT, LONG = 128, 4096
# Where a CPU's costs bend, and they bend with the CPU and its products. On a 2-core VM, earlier, a
# block of 4 took 1.8-2.0 plain steps at 1 row, 3.0-3.2 at 4, 2.4-2.8 at 8 and 2.9 at 32: fewer
# points priced it at 3.8 at 8 rows (extrapolated from 1 and 4) or 2.3 at 4 (interpolated from 1
# and 8). On a 2-core Intel VM with packed products (common.model.cpu_packed) 1.55 at 1 and 4
# rows, 1.65 at 8 and 2.1 at 32. Up to the batch size at most, where that is smaller.
CPU_ROWS = (1, 4, 8, 32)
SLOPE_ROWS = {"cuda": 4, "cpu": 1}
STEP_CODE = ("common.engine.decoder", "common.engine.step_costs", "common.engine.sampling",
             "common.engine.sampler", "common.engine.step_inputs", "common.engine.verdict",
             "common.model.transformer", "common.model.static_attention", "common.model.attention",
             "common.model.fused", "common.model.gemv", "common.model.cpu_packed", "common.model.paged_runs",
             "common.runner.model_runner")


def step_costs(decoder: Decoder, config: SpecConfig, blocks: list[int], confident: list[int] = ()) -> StepCosts:
    """The cached costs for this model, drafter and device, or new measurements (then cached).
    `confident`: blocks only a choice from the drafter's confidence takes, measured only at the
    batch sizes that draft ahead. Processes that start together measure one after another (the
    cache's lock): at once, each would time the others' work too, and the second finds the
    first's costs if they match."""
    if not config.cache_dir:
        return _measured(decoder, blocks, confident, None)
    path = os.path.join(config.cache_dir, "step-costs", f"{_signature(decoder, blocks, confident)}.json")
    with building(path):
        if os.path.isfile(path):
            with open(path) as f:
                return StepCosts.from_json(json.load(f))
        costs = _measured(decoder, blocks, confident, path)
        write_json(path, costs.to_json())
    return costs


def _measured(decoder: Decoder, blocks: list[int], confident: list[int], path: str | None) -> StepCosts:
    start = time.perf_counter()
    costs = measure(decoder, blocks, confident)
    logger.info("measured step costs in %.1f s%s", time.perf_counter() - start, f" (kept in {path})" if path else "")
    return costs


def measure(decoder: Decoder, blocks: list[int], confident: list[int] = ()) -> StepCosts:
    runner = decoder.runner
    graphs = decoder.graphs.enabled
    rows_list = measured_rows(decoder)
    short = min(SHORT, runner.cfg.max_position // 4)
    long = min(LONG, runner.cfg.max_position // 2, runner.pool.num_pages * runner.page_size // 2)
    repeats = 7 if graphs else 3
    steps = [0, *blocks]
    base = {}
    for rows in rows_list:
        extra = [b for b in confident if decoder.may_draft_ahead(rows, b)]
        base |= {(rows, b): t for b, t in _times(decoder, rows, steps + extra, short, repeats).items()}
    rows = max((r for r in rows_list if r <= SLOPE_ROWS.get(runner.device.type, 1)), default=rows_list[0])
    at_long = _times(decoder, rows, steps, long, repeats)
    slope = {b: max(0.0, (at_long[b] - base[(rows, b)]) / (rows * (long - short))) for b in steps}
    # A speculative step reads all the context a plain one reads (and the draft's): whatever
    # the timing noise says, a longer context never makes it relatively cheaper.
    slope = {b: max(s, slope[0]) for b, s in slope.items()}
    # A block only confidence chooses runs only where steps draft ahead, which may be fewer rows
    # than the slope's: its neighbours' slope, interpolated.
    slope |= {b: between_blocks(slope, b) for b in confident}
    return StepCosts(short, base, slope, padded=graphs)


def measured_rows(decoder: Decoder) -> list[int]:
    """The batch sizes whose steps are measured."""
    if decoder.graphs.enabled:
        return decoder.step_sizes
    return sorted({r for r in CPU_ROWS if r < decoder.max_rows} | {min(decoder.max_rows, CPU_ROWS[-1])})


def _times(decoder: Decoder, rows: int, blocks: list[int], context: int, repeats: int) -> dict[int, float]:
    with synthetic_requests(decoder, rows, max(blocks), context) as reqs:
        return step_times(decoder, reqs, blocks, repeats)


def step_times(decoder: Decoder, reqs: list[Request], blocks: list[int], repeats: int) -> dict[int, float]:
    """Seconds of one step of these requests with each block (0: plain), host synchronisation
    included; the requests do not advance. The blocks take turns run by run, so that a machine
    whose speed drifts (other processes, clocks) slows them alike; the first run of each, which
    may capture a graph, is not timed. The median of `repeats` with CUDA graphs; on a CPU the
    fastest, since load from elsewhere only ever slows a run down."""
    with torch.inference_mode():
        for block in blocks:
            decoder.run(reqs, block)
        times: dict[int, list[float]] = {b: [] for b in blocks}
        for _ in range(repeats):
            for block in blocks:
                t0 = time.perf_counter()
                decoder.run(reqs, block)
                times[block].append(time.perf_counter() - t0)
    pick = statistics.median if decoder.graphs.enabled else min
    return {b: pick(ts) for b, ts in times.items()}


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
                if decoder.ahead:  # steps verify drafts kept ahead, as a draft-ahead engine's mostly do
                    req.spec.ahead = [0.0] * (proposer.block_size - 1)
            reqs.append(req)
        yield reqs
    finally:
        if proposer is not None:
            for req in reqs:  # its pending row (the pages, maybe shared, return below)
                req.draft_cache.pages = []
                proposer.release(req.draft_cache)
        for pool, pages in zip(pools, held):
            for p in pages:
                pool.free(p)


def _signature(decoder: Decoder, blocks: list[int], confident: list[int]) -> str:
    """What the costs depend on: the model, drafter, device, software, settings, and the code of
    the step itself (a change to it measures again)."""
    runner, proposer = decoder.runner, decoder.proposer
    code = hashlib.sha256()
    for module in (*STEP_CODE, *([type(proposer).__module__] if proposer is not None else [])):
        with open(importlib.import_module(module).__file__, "rb") as f:
            code.update(f.read())
    device = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else \
        f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"
    facts = {"model": asdict(runner.cfg), "proposer": proposer.name if proposer is not None else None,
             "dtype": str(runner.dtype), "device": device, "torch": torch.__version__, "graphs": decoder.graphs.enabled,
             "rows": measured_rows(decoder), "page_size": runner.page_size, "blocks": blocks, "confident": list(confident),
             "layout": asdict(runner.layout), "short": SHORT, "long": LONG,
             "ahead_rows": decoder.ahead_rows if decoder.ahead else 0,
             "code": code.hexdigest()}
    text = json.dumps(facts, sort_keys=True, default=lambda o: asdict(o) if is_dataclass(o) else str(o))
    return f"{runner.cfg.name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
