"""gpu-check part `spec-overhead`: what a plain decode step costs under `--spec none` and under
`--spec dflash` (a step the policy decided to take without speculating), at batch 1 and 8 and
about 100 and 2000 tokens of context.

Both go through the engine's decoder (`Decoder.step`: the policy's choice, the step's inputs, the
graph replay, the one host read and the bookkeeping), over the embedded shape with random weights
and the shipped drafter's shape, fp32 (the drafter in bf16, as --draft-dtype auto runs it on CUDA;
numbers from before that option had it in fp32). The speculative decoder's policy has seen its drafts miss
and prices a speculative step a little above a plain one, so it takes every step plainly while
weighing the choice at every step, as it does at long context when the choice is close. The two
take turns step by step on their own requests, which advance as they would in service; the
median of each. Also counted (CUDA's sync debug mode): host synchronisations per plain step of
either, and of a speculative step (block 4) of the speculative decoder's requests.
"""
from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from common.engine.decoder import Decoder
from common.engine.request import Request
from common.engine.spec_policy import SpecConfig, SpecPolicy, StepCosts
from common.engine.spec_stats import SpecStats
from common.engine.step_costs import synthetic_requests
from common.model.shapes import SHAPES, random_weights
from common.runner.model_runner import ModelRunner

CASES = ((1, 100), (1, 2000), (8, 100), (8, 2000))  # (batch, context)
STEPS = 64
SPEC_PRICE = 1.2  # a speculative step's cost in plain steps: slower per token when drafts miss
Out = TypeVar("Out")


def _plain_policy(max_block: int, rows: tuple[int, ...]) -> SpecPolicy:
    policy = SpecPolicy(max_block, SpecConfig(timed=False), StepCosts(
        100, {(r, b): 1e-3 * (SPEC_PRICE if b else 1.0) for r in rows for b in (0, *SpecConfig().blocks)}))
    for _ in range(100):  # drafts that never hit: one plain token beats 1 / SPEC_PRICE
        policy.observe(0, max_block)
    return policy


def _decoders(device: str) -> tuple[Decoder, Decoder]:
    from common.dflash.drafter import SHIPPED, Drafter, draft_dtype
    from common.dflash.proposer import DFlashProposer

    cfg = SHAPES["embedded"]
    rows = sorted({b for b, _ in CASES})
    per_row = max(c for _, c in CASES) + STEPS + 16
    pages = 2 * sum(rows) * -(-per_row // 64) + 8  # every case's requests, for both decoders
    runner = ModelRunner(cfg, random_weights(cfg, torch.float32, device), dtype="fp32", device=device,
                         num_pages=pages, page_size=64)
    drafter = Drafter.load(SHIPPED, device=device, dtype=draft_dtype("auto", runner.dtype, device))
    proposer = DFlashProposer(drafter, runner, runner.pool.num_pages)
    sizes = tuple(rows)
    plain = Decoder(runner, cfg.eos_token_ids, batch_sizes=sizes)
    spec = Decoder(runner, cfg.eos_token_ids, proposer, _plain_policy(proposer.block_size, sizes), batch_sizes=sizes)
    return plain, spec


def _counted(fn: Callable[[], Out], cuda: bool) -> tuple[Out, float, int]:
    """fn's result, its seconds, and the host synchronisations it made (CUDA)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    return out, seconds, sum("synchroniz" in str(w.message) for w in caught)


def _timed_step(decoder: Decoder, reqs: list[Request]) -> tuple[float, int]:
    """Seconds of one Decoder.step, and the host synchronisations it made."""
    committed, seconds, syncs = _counted(lambda: decoder.step(reqs), decoder.runner.device.type == "cuda")
    if any(len(c) != 1 for c in committed):
        raise RuntimeError("the speculative decoder speculated: this part times plain steps only")
    return seconds, syncs


def spec_overhead(device: str = "cuda", steps: int = STEPS) -> list[dict]:
    plain, spec = _decoders(device)
    rows = []
    for batch, context in CASES:
        with synthetic_requests(plain, batch, steps + 1, context) as a, synthetic_requests(spec, batch, steps + 1, context) as b:
            for r in b:  # room for `steps` tokens came by asking for a block that long; verify blocks are smaller
                r.spec = SpecStats(spec.policy.max_block)
            with torch.inference_mode():
                plain.step(a), spec.step(b)  # capture the graphs
                times, syncs = {"none": [], "dflash": []}, {"none": [], "dflash": []}
                for _ in range(steps - 1):
                    for name, decoder, reqs in (("none", plain, a), ("dflash", spec, b)):
                        t, s = _timed_step(decoder, reqs)
                        times[name].append(t)
                        syncs[name].append(s)
                # A speculative step (block 4) of the same requests, once captured: one host read too.
                spec.run(b, 4)
                spec_syncs = _counted(lambda: spec.run(b, 4), device == "cuda")[2]
        none_ms, spec_ms = (1e3 * statistics.median(times[k]) for k in ("none", "dflash"))
        rows.append({"batch": batch, "context": context, "none_ms": none_ms, "dflash_plain_ms": spec_ms,
                     "ratio": spec_ms / none_ms, "syncs_per_step": {k: max(v) for k, v in syncs.items()},
                     "syncs_per_speculative_step": spec_syncs})
    return rows


def summary_lines(rows: list[dict]) -> list[str]:
    return [f"spec-overhead batch {r['batch']} context {r['context']:4}: plain step {r['none_ms']:.3f} ms "
            f"(--spec none), {r['dflash_plain_ms']:.3f} ms (--spec dflash, plain), x{r['ratio']:.3f}; host syncs "
            f"per step {r['syncs_per_step']['none']} / {r['syncs_per_step']['dflash']} (speculative step: "
            f"{r['syncs_per_speculative_step']})" for r in rows]
