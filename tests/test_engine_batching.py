"""Continuous batching: requests of different lengths joining at different steps produce exactly
what each produces alone; pages all return; aborts free pages at once."""
from __future__ import annotations

import pytest

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import InvalidRequest, SamplingParams
from common.model.tokenizer import IncrementalDecoder

_TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a "
         "notebook and a flask of tea. From the top he could see the whole bay: fishing boats "
         "returning, gulls circling the harbour wall, and far out, the dark line of the islands. "
         "On stormy nights he stayed awake until morning, writing down the wind, the height of the "
         "waves and the name of every ship that passed.")

# (prompt length, SamplingParams): odd lengths, prompts that span several 7-token chunks, and
# two seeded sampled requests (their tokens depend only on seed and position, not the batch).
SPECS = [
    (5, SamplingParams(max_new_tokens=12)),
    (13, SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.9, seed=7)),
    (29, SamplingParams(max_new_tokens=15)),
    (51, SamplingParams(max_new_tokens=7)),
    (3, SamplingParams(max_new_tokens=11, temperature=1.3, top_k=20, seed=1234)),
    (22, SamplingParams(max_new_tokens=10, ignore_eos=True)),
]


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    ids = embedded_tokenizer.encode(_TEXT)
    assert len(ids) >= max(5 * i + n for i, (n, _) in enumerate(SPECS))
    return [ids[5 * i:5 * i + n] for i, (n, _) in enumerate(SPECS)]  # different starts


@pytest.fixture(scope="module")
def small_page_runner(make_embedded_runner):
    # Page size 4 and a pool too small for all requests at once: some wait for pages.
    return make_embedded_runner(page_size=4, num_pages=40)


def _request(i: int, prompt: list[int], tok) -> Request:
    params = SPECS[i][1]
    return Request(f"r{i}", prompt, params, IncrementalDecoder(tok, params.stop))


def _drain(engine: Engine, texts: dict[str, str]) -> None:
    while engine.has_work:
        _step(engine, texts)


def _step(engine: Engine, texts: dict[str, str]) -> None:
    for out in engine.step():
        texts[out.req.rid] = texts.get(out.req.rid, "") + out.text


@pytest.fixture(scope="module")
def alone(embedded_runner, embedded_tokenizer, prompts) -> list[list[int]]:
    """Each request run by itself: page size 16, no chunking."""
    outs = []
    for i, p in enumerate(prompts):
        engine = Engine(embedded_runner, embedded_tokenizer.eos_token_ids)
        req = _request(i, p, embedded_tokenizer)
        engine.add(req)
        _drain(engine, {})
        outs.append(req.output_ids)
    assert embedded_runner.pool.num_free == embedded_runner.pool.num_pages
    return outs


def test_joining_at_different_steps_matches_alone(small_page_runner, embedded_tokenizer, prompts, alone):
    runner, tok = small_page_runner, embedded_tokenizer
    engine = Engine(runner, tok.eos_token_ids, chunk_size=7)
    reqs = [_request(i, p, tok) for i, p in enumerate(prompts)]
    texts: dict[str, str] = {}
    max_running = 0
    # join: two at once, one after 3 steps, two more after 2 more, the last after 1 more
    for joining, steps in (([0, 1], 3), ([2], 2), ([3, 4], 1), ([5], 0)):
        for i in joining:
            engine.add(reqs[i])
        for _ in range(steps):
            _step(engine, texts)
            max_running = max(max_running, len(engine.running))
    while engine.has_work:
        _step(engine, texts)
        max_running = max(max_running, len(engine.running))
        active = [r for r in reqs if r.cache.pages]
        assert runner.pool.num_used == sum(len(r.cache.pages) for r in active)
        runner.pool.check_integrity()

    assert max_running >= 3  # requests really decoded together, at different lengths
    for i, req in enumerate(reqs):
        assert req.output_ids == alone[i], f"r{i} differs when batched"
        assert req.finish_reason in ("stop", "length")
        if req.finish_reason == "length":
            assert len(req.output_ids) == req.params.max_new_tokens
        # Streamed text deltas add up to the decoded output.
        assert texts[req.rid] == tok.decode(req.output_ids)
    assert runner.pool.num_free == runner.pool.num_pages
    runner.pool.check_integrity()


def test_abort_frees_pages(small_page_runner, embedded_tokenizer, prompts, alone):
    runner, tok = small_page_runner, embedded_tokenizer
    engine = Engine(runner, tok.eos_token_ids, chunk_size=7)
    reqs = [_request(i, p, tok) for i, p in enumerate(prompts)]
    # r0, r1, r2, r5 take 5 + 6 + 11 + 8 = 30 of the 40 pages; r3 (51 + 7 tokens: 15 pages) waits.
    for i in (0, 1, 2, 5, 3):
        engine.add(reqs[i])
    engine.step()
    assert reqs[3] in engine.waiting and not reqs[3].cache.pages
    assert runner.pool.num_used == 30
    assert engine.abort("r3") is reqs[3]
    assert runner.pool.num_used == 30

    def abort(i: int) -> None:
        used, held = runner.pool.num_used, len(reqs[i].cache.pages)
        assert held > 0
        assert engine.abort(f"r{i}") is reqs[i]
        assert reqs[i].finish_reason == "abort" and reqs[i].cache.pages == []
        assert runner.pool.num_used == used - held

    while reqs[2].cache.length == 0:
        engine.step()
    assert reqs[2] in engine.prefilling and reqs[2].cache.length < reqs[2].prompt_len
    abort(2)  # in the middle of its chunked prefill
    while len(reqs[0].output_ids) < 4:
        engine.step()
    assert reqs[0] in engine.running
    abort(0)  # in the middle of decoding
    assert engine.abort("r0") is None and engine.abort("nobody") is None
    _drain(engine, {})
    for i in (1, 5):
        assert reqs[i].output_ids == alone[i]
    assert runner.pool.num_free == runner.pool.num_pages
    runner.pool.check_integrity()


def test_request_bigger_than_the_pool_is_refused(small_page_runner, embedded_tokenizer):
    engine = Engine(small_page_runner, embedded_tokenizer.eos_token_ids)
    with pytest.raises(InvalidRequest, match="KV cache"):
        engine.add(Request("big", [1] * 100, SamplingParams(max_new_tokens=100)))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add(Request("empty", [], SamplingParams()))
    assert not engine.has_work


def test_hand_offs_past_max_running_wait_for_a_place(tmp_path):
    """D's engine takes every hand-off (its KV is already in place) but decodes at most
    max_running of them at a time; the others wait, first come first decoded, and all finish.
    The negative control: without the limit every step decodes all of them."""
    from common.runner.model_runner import ModelRunner
    from tiny_models import random_model

    cfg, tensors = random_model(num_layers=2)

    def batch_sizes(max_running: int) -> tuple[list[int], list[Request]]:
        engine = Engine(ModelRunner(cfg, tensors, num_pages=64, page_size=16), (), max_running=max_running)
        reqs = [Request(f"r{i}", list(range(1, 10 + i)), SamplingParams(max_new_tokens=4 + 2 * i, ignore_eos=True))
                for i in range(5)]
        for req in reqs:
            engine.reserve(req)
            req.cache.length = req.prompt_len  # whatever the pages hold: only the scheduling is looked at
            engine.add_prefilled(req, 7)
        sizes = []
        while engine.has_work:
            sizes.append(len(engine.step()))
        return sizes, reqs

    sizes, reqs = batch_sizes(2)
    assert max(sizes) == 2 and all(len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    assert batch_sizes(256)[0][0] == 5
