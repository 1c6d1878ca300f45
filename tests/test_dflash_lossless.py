"""DFlash with the shipped drafter is lossless: greedy fp32 outputs with --spec dflash equal
--spec none token for token, in-process (single and batched) and through the PD stack (under the
soak's load: tests/test_soak.py), and the acceptance histogram's invariants hold for every request.
In-process the drafter runs in bf16 beside the fp32 target (as --draft-dtype auto runs it on CUDA
and on CPUs with native bf16), and in fp32 in a test of its own; the PD stack pins bf16 too."""
from __future__ import annotations

import itertools
import uuid

import pytest
import torch
from conftest import once_per_run

from common.dflash.drafter import SHIPPED, Drafter
from common.dflash.proposer import DFlashProposer
from common.engine.confidence import PRIOR
from common.engine.engine import Engine
from common.engine.meta import meta_info
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig, StepCosts
from common.model import gemv
from common.model.tokenizer import IncrementalDecoder, Tokenizer
from common.tools.bench import stats

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
MAX_NEW = 12
RUNNER = {"page_size": 16, "num_pages": 512}  # the in-process runner (test_soak.py makes the same one)
PERIOD = 30  # "." in SmolLM2's vocabulary: a stop token that shows up inside blocks


def lossless_prompts(tok: Tokenizer) -> list[list[int]]:
    """Chat and raw prompts alternating, so that any first few have both."""
    chat = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [ids for pair in zip(chat, (tok.encode(t) for t in RAW)) for ids in pair]


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer) -> list[list[int]]:
    return lossless_prompts(embedded_tokenizer)


@pytest.fixture(scope="module")
def runner(make_embedded_runner):
    return make_embedded_runner(**RUNNER)


@pytest.fixture(scope="module")
def proposer(runner):
    return DFlashProposer(Drafter.load(SHIPPED, dtype=torch.bfloat16), runner, runner.pool.num_pages)


# Greedy; seeded sampling (temperature alone, and with top-k and top-p); and requests that stop
# inside a block (a stop token, or a budget that ends mid-block).
CASES = {
    "greedy": lambda i: SamplingParams(max_new_tokens=MAX_NEW),
    "seeded": lambda i: SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=i),
    "nucleus": lambda i: SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, top_k=50, seed=i),
    "stops": lambda i: SamplingParams(max_new_tokens=3 + i % 11, stop_token_ids=(PERIOD,)),
    # Stop strings end a request on the host, after a step that may have committed tokens past
    # them: those must be dropped, as plain decoding never makes them.
    "stop-strings": lambda i: SamplingParams(max_new_tokens=2 * MAX_NEW, stop=(" the", ",")),
}
# (concurrency, prompts, case, block): all 32 prompts batched greedily (the bar); the stop
# cases on enough prompts that some stop on the period inside a block (of the first 16, none
# does); and a few one at a time. Batched runs verify blocks of 4 (and 8), as the policy mostly
# chooses on a GPU: on this CPU a verify step costs about its rows x block tokens, and eight rows
# of 16 took most of the suite's in-process time. One at a time, the drafter's whole block of 16.
RUNS = [(8, 32, "greedy", 4), (8, 12, "seeded", 8), (8, 24, "stops", 4), (8, 16, "stop-strings", 4),
        (1, 6, "greedy", 16), (1, 4, "nucleus", 16), (1, 3, "stops", 16), (1, 3, "stop-strings", 16)]


def run_all(engine: Engine, prompts: list[list[int]], concurrency: int, case: str = "greedy",
            tok: Tokenizer | None = None) -> list[Request]:
    params = [CASES[case](i) for i in range(len(prompts))]
    reqs = [Request(uuid.uuid4().hex, ids, p, decoder=IncrementalDecoder(tok, p.stop) if p.stop else None)
            for ids, p in zip(prompts, params)]
    engine.run_all(reqs, concurrency)
    return reqs


def check_invariants(meta: dict) -> None:
    assert stats.check_invariants(meta) == [], meta


class PlainOutputs(dict):
    """case -> the plain engine's outputs for as many prompts as any run of that case uses,
    computed when first asked for (a worker that runs only the stack's test needs only greedy),
    once per run: the stack's test may run on the other worker."""

    def __init__(self, runner, tok: Tokenizer, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory):
        super().__init__()
        self.engine, self.tok, self.prompts, self.tmp = Engine(runner, tok.eos_token_ids), tok, prompts, tmp_path_factory

    def __missing__(self, case: str) -> list[list[int]]:
        count = max(n for _, n, c, _ in RUNS if c == case)
        self[case] = once_per_run(self.tmp, f"lossless-plain-{case}", lambda: [
            r.output_ids for r in run_all(self.engine, self.prompts[:count], 8, case, self.tok)])
        return self[case]


@pytest.fixture(scope="module")
def plain_outputs(runner, embedded_tokenizer, prompts, tmp_path_factory) -> PlainOutputs:
    return PlainOutputs(runner, embedded_tokenizer, prompts, tmp_path_factory)


def test_drafter_predicts_something(runner, proposer, embedded_tokenizer, prompts):
    """A lossless test with a drafter that never hits would prove little: the shipped one must
    accept drafts, so the accept path (k > 0, the draft KV of accepted tokens) is exercised."""
    reqs = run_all(Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=16)),
                   prompts[:4], 4)
    assert sum(r.spec.accepted_drafts for r in reqs) > 0
    assert proposer.kv.dtype == proposer.lm_head.dtype == torch.bfloat16 != runner.dtype


@pytest.mark.parametrize("concurrency,count,case,block", RUNS)
def test_in_process_lossless(runner, proposer, embedded_tokenizer, prompts, plain_outputs, concurrency, count, case,
                             block):
    """The prompts batched (requests join and leave the batch at different steps), and a subset
    one at a time, with the block pinned."""
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, chunk_size=37, proposer=proposer, spec=SpecConfig(block=block))
    reqs = run_all(engine, prompts[:count], concurrency, case, embedded_tokenizer)
    assert len(reqs) == count
    for req, plain in zip(reqs, plain_outputs[case]):
        assert req.output_ids == plain, f"speculative output differs for prompt {req.prompt_ids[:8]}..."
        check_invariants(meta_info(req))
    if case == "stops" and count > 8:
        assert any(r.matched_stop == PERIOD for r in reqs)  # some stopped on the token, inside a block
    if case == "stop-strings" and count > 8:
        assert any(isinstance(r.matched_stop, str) for r in reqs)
    assert runner.pool.num_free == runner.pool.num_pages
    assert proposer.pool.num_free == proposer.pool.num_pages


@pytest.mark.parametrize("concurrency,count,case,block", [(8, 16, "greedy", 8), (1, 3, "stops", 16)])
def test_fp32_drafter_lossless(runner, embedded_tokenizer, prompts, plain_outputs, concurrency, count, case, block):
    """The drafter in the target's fp32 (--draft-dtype fp32): its own KV and LM head dtype."""
    proposer = DFlashProposer(Drafter.load(SHIPPED, dtype=torch.float32), runner, runner.pool.num_pages)
    assert proposer.kv.dtype == proposer.lm_head.dtype == torch.float32
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=block))
    reqs = run_all(engine, prompts[:count], concurrency, case, embedded_tokenizer)
    assert [r.output_ids for r in reqs] == plain_outputs[case][:count]
    assert sum(r.spec.accepted_drafts for r in reqs) > 0
    assert runner.pool.num_free == runner.pool.num_pages and proposer.pool.num_free == proposer.pool.num_pages


def test_refining_drafter_lossless(runner, embedded_tokenizer, prompts, plain_outputs):
    """Refine passes (common.dflash.drafter) change what is drafted, never what is output."""
    drafter = Drafter.load(SHIPPED, dtype=torch.bfloat16)
    drafter.set_refine({"refine_passes": 2, "refine_threshold": 0.5})
    proposer = DFlashProposer(drafter, runner, runner.pool.num_pages)
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=16))
    reqs = run_all(engine, prompts[:8], 4)
    assert [r.output_ids for r in reqs] == plain_outputs["greedy"][:8]
    assert sum(r.spec.accepted_drafts for r in reqs) > 0
    assert runner.pool.num_free == runner.pool.num_pages and proposer.pool.num_free == proposer.pool.num_pages


def test_mixed_blocks_and_plain_steps_lossless(runner, proposer, embedded_tokenizer, prompts, plain_outputs):
    """Steps that alternate between plain decoding and blocks of 4, 16 and 8 (as the policy may
    choose them) keep the outputs, the draft context (appended by plain steps too) and the
    counters right."""
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=16))
    choices = itertools.cycle([0, 4, 16, 0, 8])
    engine.policy.choose = lambda reqs: next(choices)
    reqs = run_all(engine, prompts[:8], 4)
    assert [r.output_ids for r in reqs] == plain_outputs["greedy"][:8]
    for r in reqs:
        meta = meta_info(r)
        check_invariants(meta)
    assert sum(r.spec.plain_steps for r in reqs) > 0
    assert sum(1 for b in (4, 8, 16) if sum(r.spec.block_histogram[b] for r in reqs)) == 3


def test_policy_turns_speculation_off_when_it_does_not_pay(runner, proposer, embedded_tokenizer, prompts,
                                                          plain_outputs):
    """With costs where a verify step is much dearer than a plain one, the policy decodes plainly
    (exploring once in a while): outputs unchanged, and meta_info says how many steps were plain."""
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=16))
    engine.policy.pinned = None
    engine.policy.costs = StepCosts(128, {(1, 0): 1.0, **{(1, b): 50.0 for b in (4, 8, 16)}})
    reqs = run_all(engine, prompts[:4], 1)
    assert [r.output_ids for r in reqs] == plain_outputs["greedy"][:4]
    meta = meta_info(reqs[0])
    check_invariants(meta)
    assert meta["spec_plain_steps"] > 0 and meta["spec_verify_ct"] == 0


@pytest.mark.parametrize("case", ["greedy", "seeded", "stops"])
def test_draft_ahead_lossless(runner, proposer, embedded_tokenizer, prompts, plain_outputs, case):
    """Draft-ahead (each speculative step drafts the next block at its end): steps that cycle
    through plain decoding and blocks of 4, 16 and 8 — so that a step verifies drafts kept
    ahead, drafts first after a plain step, or does both in a batch where requests joined since —
    keep the outputs and the counters right, and leave the draft context where plain steps
    expect it."""
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=16, ahead=True))
    assert engine.decoder.ahead
    engine.decoder.ahead_rows = 4  # batches draft ahead too (by default only single requests do)
    choices = itertools.cycle([4, 16, 0, 8, 8, 4, 16, 5, 7, 6])  # and blocks only confidence chooses
    engine.policy.choose = lambda reqs: next(choices)
    verified_ahead = []
    observe = engine.policy.observe_confident
    engine.policy.observe_confident = lambda *a: verified_ahead.append(a) or observe(*a)
    count = 16 if case == "greedy" else 12
    reqs = run_all(engine, prompts[:count], 4, case, embedded_tokenizer)
    assert [r.output_ids for r in reqs] == plain_outputs[case][:count]
    for r in reqs:
        check_invariants(meta_info(r))
    assert verified_ahead and sum(drafted for _, drafted, _ in verified_ahead) > 0
    assert all(len(confidence) == proposer.block_size - 1 and max(confidence) <= 0 for confidence, _, _ in verified_ahead)
    assert runner.pool.num_free == runner.pool.num_pages and proposer.pool.num_free == proposer.pool.num_pages


def test_draft_ahead_policy_chooses_blocks_by_confidence(runner, proposer, embedded_tokenizer, prompts, plain_outputs):
    """With the policy choosing (costs given), a draft-ahead engine weighs blocks by the drafter's
    confidence: outputs unchanged, its calibration learns from the steps, and more than one block
    length is chosen."""
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=16, ahead=True))
    engine.policy.pinned = None
    engine.policy.timed_steps = False
    engine.policy.costs = StepCosts(128, {(1, 0): 1.0, (1, 4): 1.5, (1, 8): 1.9, (1, 16): 2.8})
    reqs = run_all(engine, prompts[:6], 1)
    assert [r.output_ids for r in reqs] == plain_outputs["greedy"][:6]
    assert sum(engine.policy.calibration.tried) > 0
    blocks = [sum(r.spec.block_histogram[b] for r in reqs) for b in (4, 8, 16)]
    assert sum(1 for n in blocks if n) >= 2, blocks


def test_draft_ahead_policy_takes_blocks_between_the_timed_ones(runner, proposer, embedded_tokenizer, prompts,
                                                                plain_outputs):
    """Given blocks only a choice by confidence takes (5, 6, 7: `SpecPolicy.confident_only`), the
    policy verifies blocks of those lengths too, outputs unchanged."""
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=16, ahead=True))
    engine.policy.pinned = None
    engine.policy.timed_steps = False
    engine.policy.confident_only = [5, 6, 7]
    engine.policy.costs = StepCosts(128, {(1, 0): 1.0, (1, 4): 1.5, (1, 5): 1.6, (1, 6): 1.7, (1, 7): 1.8, (1, 8): 1.9,
                                          (1, 16): 2.8})
    reqs = run_all(engine, prompts[:6], 1)
    assert [r.output_ids for r in reqs] == plain_outputs["greedy"][:6]
    assert sum(r.spec.block_histogram[b] for r in reqs for b in (5, 6, 7)) > 0


@pytest.mark.parametrize("concurrency", [1, 4])
def test_drafts_ahead_are_the_drafts(runner, proposer, embedded_tokenizer, prompts, concurrency):
    """A block drafted ahead, at the end of a step, is the block the next step would draft first:
    with blocks of 16, every request accepts as many drafts at every step with draft-ahead as
    without (a draft context caught up wrongly, a block drafted after the wrong token, or one
    written past its page table, drafts worse and would show here, not in the outputs)."""
    verified_ahead = []

    def histograms(ahead: bool) -> list[list[int]]:
        engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer,
                        spec=SpecConfig(block=16, ahead=ahead))
        engine.decoder.ahead_rows = concurrency
        engine.policy.observe_confident = lambda *a: verified_ahead.append(a)
        return [r.spec.histogram for r in run_all(engine, prompts[:4], concurrency)]

    fresh = histograms(False)
    assert not verified_ahead
    ahead = histograms(True)
    assert sum(k * n for h in fresh for k, n in enumerate(h)) > 0
    assert len(verified_ahead) > sum(map(sum, ahead)) // 2  # most steps verified drafts kept ahead
    assert ahead == fresh


def test_a_plain_step_chosen_by_confidence_is_one(runner, proposer, embedded_tokenizer, prompts, plain_outputs):
    """When the drafter is unsure of the block it drafted ahead, the policy decodes one token
    plainly; the step after it has no drafts ahead and weighs as before (here: speculate), not
    again by the confidences of the drafts the plain step left behind, nor by a choice held from
    before them."""
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=16, ahead=True))
    policy = engine.policy
    policy.pinned, policy.timed_steps = None, False
    policy.costs = StepCosts(128, {(1, 0): 1.0, (1, 4): 1.1, (1, 8): 1.2, (1, 16): 1.4})
    policy.calibration.rates = lambda: [0.01] * len(PRIOR)  # every draft kept ahead looks hopeless
    reqs = run_all(engine, prompts[:2], 1)
    assert [r.output_ids for r in reqs] == plain_outputs["greedy"][:2]
    for r in reqs:
        assert r.spec.plain_steps > 0 and abs(r.spec.plain_steps - r.spec.verify_ct) <= 1, meta_info(r)


def test_the_draft_kv_of_a_prefill_times_no_product(runner, proposer, embedded_tokenizer, prompts, monkeypatch):
    """A prefill step's draft KV is written eagerly for however many tokens it holds: none of its
    products may be timed while requests wait (common.model.gemv.kept_only)."""
    seen = []
    write = proposer.write_context
    monkeypatch.setattr(proposer, "write_context", lambda *a: seen.append(gemv._timing) or write(*a))
    engine = Engine(runner, embedded_tokenizer.eos_token_ids, proposer=proposer, spec=SpecConfig(block=4))
    run_all(engine, [ids[:5] for ids in prompts[:2]], 2)
    assert seen and seen[0] is False  # the first is the prefill's; later ones are decode steps' catch-ups
