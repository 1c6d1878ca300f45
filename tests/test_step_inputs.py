"""A decode step's inputs: a row rewrites only the columns a step moves while its request stays,
and every fill reads exactly as a fill from scratch would."""
from __future__ import annotations

import random

import torch

from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.step_inputs import StepInputs
from common.kv.seq_cache import SeqCache

EOS = (2,)


def inputs() -> StepInputs:
    return StepInputs(max_rows=8, width=6, scratch_page=99, draft_scratch_page=98, device=torch.device("cpu"))


def request(i: int, rng: random.Random) -> Request:
    params = SamplingParams(max_new_tokens=64, temperature=rng.choice([0.0, 0.7]), top_p=rng.choice([1.0, 0.9]),
                            top_k=rng.choice([0, 20]), seed=i, stop_token_ids=(7,) * (i % 3))
    req = Request(f"r{i}", [1] * 5, params, output_ids=[3])
    req.cache = SeqCache([10 * i + j for j in range(rng.randint(1, 5))], 5 + rng.randint(0, 3), state_slot=i % 3)
    req.draft_cache = SeqCache([50 + 10 * i + j for j in range(rng.randint(1, 5))], 5, state_slot=i + 1)
    return req


def test_every_fill_reads_as_a_fill_from_scratch():
    """Requests come and go, change rows, decode, and get new pages or slots (a released cache,
    a reserve that extends one); after each fill the rows equal a fresh fill of the same batch."""
    rng = random.Random(0)
    reqs = [request(i, rng) for i in range(6)]
    kept = inputs()
    rewrites = 0
    for step in range(300):
        batch = rng.sample(reqs, rng.randint(0, 5))
        rows = next(s for s in (1, 2, 4, 8) if s >= max(len(batch), 1))
        for req in batch:  # what decode steps move
            req.output_ids.append(rng.randint(0, 50))
            req.cache.length += 1
            req.draft_cache.length = req.cache.length - rng.randint(0, 3)
        event = rng.random()
        if event < 0.05:  # released and reserved again: a new page list
            victim = rng.choice(reqs)
            victim.cache.pages = [200 + step, 201 + step]
        elif event < 0.1:  # a reserve that extends the same list
            victim = rng.choice(reqs)
            victim.draft_cache.pages.append(300 + step)
        elif event < 0.15:
            rng.choice(reqs).cache.state_slot += 1
        before = kept.host.clone()
        kept.fill(batch, rows, EOS)
        rewrites += int(not torch.equal(before[len(batch):rows], kept.host[len(batch):rows]))
        fresh = inputs()
        fresh.fill(batch, rows, EOS)
        assert torch.equal(kept.host[:rows], fresh.host[:rows]), step
        assert torch.equal(kept.device[:rows], fresh.device[:rows]), step
    assert rewrites > 0  # rows that held a request turned padding again
