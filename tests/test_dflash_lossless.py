"""DFlash with the shipped drafter is lossless: greedy fp32 outputs with --spec dflash equal
--spec none token for token, in-process (single and batched) and through the PD stack, and the
acceptance histogram's invariants hold for every request."""
from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.dflash.drafter import SHIPPED, Drafter
from common.dflash.proposer import DFlashProposer
from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams

QUESTIONS = [
    "What is 7 times 8?", "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
    "Sara had 24 stickers. She gave 9 to her friend. How many are left?",
    "What is 15% of 200?", "If a pencil costs $0.35, how much do 12 pencils cost?",
    "A rectangle is 7 cm long and 4 cm wide. What is its area?", "What is 1000 divided by 8?",
    "John is twice as old as Mary. Mary is 9. How old is John?",
    "A baker makes 48 cookies and packs them in boxes of 6. How many boxes?",
    "Write one sentence about the ocean.", "Name three fruits.", "Explain what a prime number is.",
    "Translate 'good morning' to French.", "What is the capital of Japan?",
    "Give a synonym for 'happy'.",
]
RAW = [
    "The quick brown fox", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The three laws of thermodynamics are", "1, 2, 3, 5, 8, 13,", "Paris is the capital of",
    "In 1969, the first", "A recipe for pancakes:", "The mitochondria is", "Q: What is 2+2?\nA:",
    "Dear Sir or Madam,", "import numpy as np\n", "Monday, Tuesday,", "The sun rises in the",
    "Water boils at", "Roses are red,",
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer) -> list[list[int]]:
    tok = embedded_tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS] + [tok.encode(t) for t in RAW]


@pytest.fixture(scope="module")
def runner(make_embedded_runner):
    return make_embedded_runner(page_size=16, num_pages=512)


@pytest.fixture(scope="module")
def proposer(runner):
    return DFlashProposer(Drafter.load(SHIPPED), runner, runner.pool.num_pages)


def run_all(engine: Engine, prompts: list[list[int]], concurrency: int) -> list[Request]:
    reqs = [Request(uuid.uuid4().hex, ids, SamplingParams(max_new_tokens=MAX_NEW)) for ids in prompts]
    engine.run_all(reqs, concurrency)
    return reqs


def check_invariants(meta: dict, block: int) -> None:
    hist = meta["spec_accept_histogram"]
    assert len(hist) == block
    assert sum(hist) == meta["spec_verify_ct"]
    assert sum(k * n for k, n in enumerate(hist)) == meta["spec_accepted_drafts"]
    assert meta["spec_proposed_drafts"] == (block - 1) * meta["spec_verify_ct"]


@pytest.fixture(scope="module")
def plain_outputs(runner, embedded_tokenizer, prompts) -> list[list[int]]:
    return [r.output_ids for r in run_all(Engine(runner, embedded_tokenizer.eos_token_ids), prompts, 8)]


def test_drafter_predicts_something(runner, proposer, embedded_tokenizer, prompts):
    """A lossless test with a drafter that never hits would prove little: the shipped one must
    accept drafts, so the accept path (k > 0, truncation, draft KV append) is exercised."""
    reqs = run_all(Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer), prompts[:4], 4)
    assert sum(r.spec.accepted_drafts for r in reqs) > 0


@pytest.mark.parametrize("concurrency,count", [(8, 32), (1, 8)])
def test_in_process_lossless(runner, proposer, embedded_tokenizer, prompts, plain_outputs, concurrency, count):
    """All 32 prompts batched (requests join and leave the batch at different steps), and a
    subset one at a time."""
    from common.engine.meta import meta_info

    engine = Engine(runner, embedded_tokenizer.eos_token_ids, chunk_size=37, proposer=proposer)
    reqs = run_all(engine, prompts[:count], concurrency)
    assert len(reqs) == count
    for req, plain in zip(reqs, plain_outputs):
        assert req.output_ids == plain, f"speculative output differs for prompt {req.prompt_ids[:8]}..."
        check_invariants(meta_info(req), proposer.block_size)
    assert runner.pool.num_free == runner.pool.num_pages
    assert proposer.pool.num_free == proposer.pool.num_pages


def test_small_block_lossless(runner, embedded_tokenizer, prompts, plain_outputs):
    """--spec-block smaller than the drafter was trained with still verifies exactly."""
    proposer = DFlashProposer(Drafter.load(SHIPPED), runner, 64, block_size=4)
    reqs = run_all(Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer), prompts[:6], 3)
    assert [r.output_ids for r in reqs] == plain_outputs[:6]


@pytest.mark.slow
def test_pd_stack_lossless(prompts, plain_outputs):
    from tests.pd_stack import Stack

    stack = Stack("--mode", "pd", "--spec", "dflash", "--page-size", "16", "--verify-transfer")
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda ids: stack.generate(ids, max_new_tokens=MAX_NEW), prompts))
        single = stack.generate(prompts[0], max_new_tokens=MAX_NEW)
        for res, plain in zip(results + [single], plain_outputs + [plain_outputs[0]]):
            assert res["output_ids"] == plain
            meta = res["meta_info"]
            check_invariants(meta, 16)
            assert meta["spec_accept_length_weighted"] == pytest.approx(
                1 + meta["spec_accepted_drafts"] / meta["spec_verify_ct"])
            assert meta["verified_pages"] > 0  # target KV and draft KV pages checked after transfer
        stack.wait_all_pages_free()
    finally:
        stack.stop()
