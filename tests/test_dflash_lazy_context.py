"""A plain step under --spec dflash only keeps its token's captured target states; the draft KV of
those tokens is written when the request next speculates (or when its pending features are
full). A request that decodes plainly for a while and then speculates must draft exactly as one
whose whole context was written at once (a prefill of the same tokens): same draft KV, same
drafts. Negative control: before that speculative step, the draft KV of the pending tokens is
not there yet, and the comparison sees it. A small random model and drafter (block 4): what is
compared is the bookkeeping, not what the drafts are worth."""
from __future__ import annotations

import uuid

import pytest
import torch

from common.engine.decoder import Decoder
from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig
from tiny_models import speculating_engine

BLOCK = 4
PLAIN = 11  # more plain steps than a request's pending features hold (2 x 4): one catch-up among them


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return speculating_engine(str(tmp_path_factory.mktemp("drafter")), num_layers=4, seed=3, capture_layers=(0, 2),
                              num_pages=16, page_size=8, spec=SpecConfig(block=4))


def draft_kv(engine: Engine, req: Request, length: int) -> torch.Tensor:
    """The request's draft K/V of its first `length` tokens, [layer, k/v, token, head, dim]."""
    kv = engine.proposer.read_pages(req.draft_cache.pages)
    return kv.flatten(2, 3)[:, :, :length]


def speculate_after(engine: Engine, prompt: list[int], plain: int) -> tuple[Request, list[torch.Tensor], list[torch.Tensor]]:
    """Prefill, `plain` plain steps, then one step of BLOCK. Returns the request (aborted after
    that step), the drafts of that step, and its draft K/V of the context just before and just
    after it caught up."""
    choices = iter([0] * plain + [BLOCK])
    drafts, kv = [], []

    def choose(reqs: list[Request]) -> int:
        block = next(choices)
        if block:
            kv.append(draft_kv(engine, reqs[0], reqs[0].cache.length))
        return block

    draft = engine.proposer.draft

    def record(*args) -> torch.Tensor:
        drafts.append(draft(*args).clone())
        kv.append(draft_kv(engine, req, req.cache.length))  # caught up by now: the block reads it
        return drafts[-1]

    engine.policy.choose, engine.proposer.draft = choose, record
    try:
        req = Request(uuid.uuid4().hex, prompt, SamplingParams(max_new_tokens=plain + 2 * BLOCK, ignore_eos=True))
        engine.add(req)
        while not drafts:
            engine.step()
    finally:
        del engine.policy.choose, engine.proposer.draft
    engine.abort(req.rid)
    return req, drafts, kv


@pytest.mark.parametrize("wide", [False, True], ids=["as-needed", "whole-buffer"])
def test_plain_steps_then_speculation_draft_as_if_written_at_once(engine, monkeypatch, wide):
    """`whole-buffer` catches up as CUDA graphs do (a fixed width past each row's pending
    tokens, whose garbage lands past the committed length), on the CPU."""
    if wide:
        width = engine.proposer.pending_width
        narrow = Decoder.catch_up
        monkeypatch.setattr(Decoder, "catch_up",
                            lambda self, reqs, block, ahead=0: width if narrow(self, reqs, block, ahead) else 0)
    engine.proposer.kv.zero_()  # no draft K/V left in these pages by an earlier request
    prompt = list(range(7, 20))
    lazy, lazy_drafts, (before, after) = speculate_after(engine, prompt, PLAIN)
    n = before.shape[2]  # context when it speculated
    assert lazy.spec.plain_steps == PLAIN and n == len(prompt) + PLAIN
    # The same context written at once: prompt + every token committed before that step.
    fresh, fresh_drafts, (fresh_kv, _) = speculate_after(engine, prompt + lazy.output_ids[:PLAIN], 0)
    assert fresh.output_ids[0] == lazy.output_ids[PLAIN]  # the same last token goes into the block
    torch.testing.assert_close(after, fresh_kv, atol=1e-4, rtol=1e-4)
    assert torch.equal(lazy_drafts[0], fresh_drafts[0])
    # Negative control: the tokens since the catch-up among the plain steps were still pending.
    pending = PLAIN % engine.proposer.pending_width
    assert torch.allclose(before[:, :, :n - pending], fresh_kv[:, :, :n - pending], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(before[:, :, n - pending:], fresh_kv[:, :, n - pending:], atol=1e-2)
    assert engine.runner.pool.num_free == engine.runner.pool.num_pages
    assert engine.proposer.pool.num_free == engine.proposer.pool.num_pages
