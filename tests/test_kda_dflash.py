"""DFlash on a KDA target (Kimi-Linear): a verify block leaves each request's recurrent state and
convolution windows as they were, and the step then commits exactly its accepted prefix
(ModelRunner.commit_block), so --spec dflash equals --spec none token for token (fp32).

Checked on test_kimi_linear's tiny checkpoint: the verify step's logits and the committed state
for every prefix length in one mixed batch against transformers and against plain extends;
greedy and seeded engines with a real random drafter, batched and one at a time; and, with the
drafter's guesses replaced by the plain run's own tokens (some spoiled), acceptance lengths over
the whole block, requests that stop inside a block and seeded sampling. Negative controls:
committing the whole block's state, or none of it, fails each comparison. At TP 2 (a KDA head per
rank, each committing its share) the replayed drafts equal --spec none too, and committing one
token too many fails.
"""
from __future__ import annotations

import random

import pytest
import torch

from common.dflash.drafter import Drafter
from common.dflash.proposer import DFlashProposer
from common.engine.engine import Engine
from common.engine.meta import meta_info
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig
from common.kv.seq_cache import SeqCache
from common.model.attention import table_slots
from common.model.static_attention import StaticAttn
from common.parallel.driver import ParallelRunner
from common.tools.bench import stats
from hf_oracle import checkpoint_fixture, tiny_runner
from test_kimi_linear import PROMPTS as KIMI_PROMPTS, TOL, VARIANTS, write_checkpoint
from tiny_models import save_random_drafter

B = 4
# Short prompts (prefill is not what is tested here), one of them over two chunks of 16.
PROMPTS = [KIMI_PROMPTS[1], KIMI_PROMPTS[2][:20], [3, 1, 4, 1, 5, 9, 2, 6]]
checkpoint = checkpoint_fixture({"checkpoint_style": VARIANTS["checkpoint_style"]}, write_checkpoint)


def verify_and_commit(runner, seqs: list[SeqCache], blocks: list[list[int]], counts: list[int]) -> torch.Tensor:
    """One static verify step of blocks[i] (B tokens) after seqs[i], as the decoder runs it, then
    commit counts[i] of them: the step's logits [rows, B, vocab]."""
    rows = len(seqs)
    table = torch.full((rows, max(len(s.pages) for s in seqs) + 1), runner.scratch_page)
    for i, s in enumerate(seqs):
        table[i, :len(s.pages)] = torch.tensor(s.pages)
    length = torch.tensor([s.length for s in seqs])
    positions = length[:, None] + torch.arange(B)
    attn = StaticAttn(table, length + B, B, causal=True, backend=runner.static_backend)
    slots = torch.tensor([s.state_slot for s in seqs])
    with torch.inference_mode():
        hidden, _ = runner.forward_static(torch.tensor(blocks).flatten(), positions.flatten(),
                                          table_slots(table, positions, runner.page_size).flatten(), attn, (), slots)
        runner.commit_block(slots, torch.tensor(counts), B)
        logits = runner.model.logits(hidden).view(rows, B, -1)
    for s, n in zip(seqs, counts):
        s.length += n
    return logits


def test_commit_keeps_exactly_the_accepted_prefix(checkpoint):
    """Four requests in one verify step keep 1, 3, 4 and 2 of their block's tokens: the step's
    logits are those of an ordinary extend of the block (test_kimi_linear matches those to
    transformers), and afterwards each slot's state and windows, and the next token's logits,
    equal those of a request fed just the kept tokens."""
    prompts = PROMPTS + [[9, 8, 7, 6, 5]]
    blocks = [[30 + 4 * i + j for j in range(B)] for i in range(len(prompts))]
    counts = [1, 3, 4, 2]
    runner = tiny_runner(checkpoint)
    runner.reserve_blocks(len(prompts), B)

    def after(feed) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Prefill the prompts, feed(seqs) -> logits, then the slots' state and windows and the
        logits of one more token (the requests' slots and pages are returned after)."""
        seqs = [SeqCache() for _ in prompts]
        for s, p in zip(seqs, prompts):
            runner.reserve(s, len(p) + B + 1)
        runner.extend(seqs, prompts)
        logits = feed(seqs)
        slots = [s.state_slot for s in seqs]
        state = (runner.cache.recurrent[:, slots].clone(), runner.cache.conv[:, slots].clone())
        nxt = runner.extend(seqs, [[70]] * len(seqs)).logits
        for s in seqs:
            runner.release(s)
        return logits, state, nxt

    logits, state, nxt = after(lambda seqs: verify_and_commit(runner, seqs, blocks, counts))
    ref_logits, _, _ = after(lambda seqs: runner.extend(seqs, blocks, all_logits=True).logits)
    torch.testing.assert_close(logits.flatten(0, 1), ref_logits, **TOL)
    _, ref_state, ref_next = after(lambda seqs: runner.extend(seqs, [b[:n] for b, n in zip(blocks, counts)]).logits)
    torch.testing.assert_close(state, ref_state, **TOL)
    torch.testing.assert_close(nxt, ref_next, **TOL)

    # Negative controls: the whole block's state (what a block advancing the slot would leave),
    # or none of it, is caught for every request that keeps fewer tokens, or more.
    for wrong in (B, 0):
        _, _, bad = after(lambda seqs: verify_and_commit(runner, seqs, blocks, [wrong] * len(seqs)))
        for i, n in enumerate(counts):
            assert (n == wrong) == torch.allclose(bad[i], ref_next[i], **TOL), (wrong, i)
    assert runner.state_pool.num_free == runner.state_pool.num_slots


def run(runner, cfg, params, concurrency: int, **spec) -> list[Request]:
    reqs = [Request(str(i), p, params(i)) for i, p in enumerate(PROMPTS)]
    Engine(runner, cfg.eos_token_ids, chunk_size=16, **spec).run_all(reqs, concurrency)
    assert runner.pool.num_free == runner.pool.num_pages
    assert runner.state_pool.num_free == runner.state_pool.num_slots
    return reqs


@pytest.fixture(scope="module")
def runner(checkpoint):
    return tiny_runner(checkpoint)


@pytest.fixture(scope="module")
def drafter(checkpoint, tmp_path_factory) -> Drafter:
    _, _, cfg, _, _ = checkpoint
    return Drafter.load(save_random_drafter(cfg, (0, 2), str(tmp_path_factory.mktemp("drafter"))))


@pytest.fixture(scope="module")
def cases(checkpoint, runner) -> dict[str, tuple]:
    """Each case's sampling parameters and its plain (--spec none) outputs, batched: greedy;
    seeded sampling at T > 0; greedy with a stop token met in the middle of a plain output and
    budgets of 9 + i tokens, so that requests end inside a block."""
    _, _, cfg, _, _ = checkpoint
    params = {"greedy": lambda i: SamplingParams(max_new_tokens=12, ignore_eos=True),
              "seeded": lambda i: SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=i)}
    plain = {case: [r.output_ids for r in run(runner, cfg, p, 3)] for case, p in params.items()}
    stop = plain["greedy"][1][6]
    params["stops"] = lambda i: SamplingParams(max_new_tokens=9 + i, stop_token_ids=(stop,), ignore_eos=True)
    plain["stops"] = [r.output_ids for r in run(runner, cfg, params["stops"], 3)]
    assert any(len(out) < 9 + i for i, out in enumerate(plain["stops"]))  # one stopped on the token
    return {case: (params[case], plain[case]) for case in params}


def test_random_drafter_lossless(checkpoint, runner, drafter, cases):
    """The whole path with a real (random) drafter: its guesses are nearly all rejected, so a
    block commits one token of four, and the other three must leave no trace in the state."""
    _, _, cfg, _, _ = checkpoint
    params, plain = cases["greedy"]
    reqs = run(runner, cfg, params, 3, proposer=DFlashProposer(drafter, runner, runner.pool.num_pages),
               spec=SpecConfig(block=B))
    assert [r.output_ids for r in reqs] == plain
    assert all(stats.check_invariants(meta_info(r)) == [] for r in reqs)
    assert sum(r.spec.verify_ct for r in reqs) > 0


class ReplayProposer(DFlashProposer):
    """A DFlash proposer (its draft KV built and read as always) whose guesses are the plain
    run's own next tokens, about a third of them spoiled at random: acceptance lengths then
    cover 0 .. B-1, which a random drafter never reaches. Rows are matched to requests by their
    first draft page (host reads: eager steps on the CPU only)."""

    def __init__(self, drafter: Drafter, runner, reqs: list[Request], plain: list[list[int]]):
        super().__init__(drafter, runner, runner.pool.num_pages)
        rng = random.Random(0)
        self.reqs = reqs
        self.guesses = [[t if rng.random() > 0.35 else -1 for t in out] for out in plain]

    def draft(self, last: torch.Tensor, length: torch.Tensor, pages: torch.Tensor, B: int) -> torch.Tensor:
        drafts = super().draft(last, length, pages, B)
        for row, first_page in enumerate(pages[:, 0].tolist()):
            for req, guesses in zip(self.reqs, self.guesses):
                if req.draft_cache.pages and req.draft_cache.pages[0] == first_page:
                    at = int(length[row]) - req.prompt_len + 1  # output index of the first draft
                    for j, t in enumerate(guesses[at:at + B - 1]):
                        if t >= 0:
                            drafts[row, j] = t
        return drafts


def replayed(runner, cfg, drafter: Drafter, params, plain: list[list[int]], concurrency: int) -> list[Request]:
    """The first len(plain) prompts through a speculative engine whose drafts replay `plain`
    (ReplayProposer)."""
    reqs = [Request(str(i), p, params(i)) for i, p in enumerate(PROMPTS[:len(plain)])]
    proposer = ReplayProposer(drafter, runner, reqs, plain)
    Engine(runner, cfg.eos_token_ids, chunk_size=16, proposer=proposer, spec=SpecConfig(block=B)).run_all(
        reqs, concurrency)
    return reqs


def assert_lossless(runner, reqs: list[Request], plain: list[list[int]], kinds: int = 3) -> None:
    """Outputs equal `plain`, with at least `kinds` different acceptance lengths among the blocks."""
    assert [r.output_ids for r in reqs] == plain
    assert all(stats.check_invariants(meta_info(r)) == [] for r in reqs)
    accepted = {k for r in reqs for k, n in enumerate(r.spec.histogram) if n}
    assert len(accepted) >= kinds, accepted  # partly accepted blocks among them
    assert runner.state_pool.num_free == runner.state_pool.num_slots


@pytest.mark.parametrize("case,concurrency", [("greedy", 3), ("greedy", 1), ("seeded", 3), ("stops", 3)],
                         ids=["greedy", "alone", "seeded", "stops"])
def test_accepted_prefixes_lossless(checkpoint, runner, drafter, cases, case, concurrency, monkeypatch):
    """Blocks of 4 accepting 0 to 3 drafts, batched and alone, seeded, and requests that end inside
    a block; and (once) the negative control: committing the whole block's state is caught."""
    _, _, cfg, _, _ = checkpoint
    params, plain = cases[case]
    assert_lossless(runner, replayed(runner, cfg, drafter, params, plain, concurrency), plain)
    if case == "greedy" and concurrency > 1:
        whole = runner.commit_block
        monkeypatch.setattr(runner, "commit_block",
                            lambda slots, count, block: whole(slots, torch.full_like(count, block), block))
        assert [r.output_ids for r in replayed(runner, cfg, drafter, params, plain, concurrency)] != plain


@pytest.fixture(scope="module")
def tp2(checkpoint):
    _, _, cfg, tensors, _ = checkpoint
    runner = ParallelRunner(cfg, tensors, tp=2, num_pages=64, page_size=8, state_slots=4)
    yield runner
    runner.close()


def test_tensor_parallel_lossless(checkpoint, tp2, drafter, cases, monkeypatch):
    """TP 2, each rank one KDA head: every rank keeps its head's share of a verify block and
    commits the accepted prefix onto its slice of each slot (the driver tells the workers the
    counts). Equal to --spec none batched and alone (one request); committing one token more
    than the step keeps (where there is one more) is caught."""
    _, _, cfg, _, _ = checkpoint
    params, plain = cases["greedy"]
    assert_lossless(tp2, replayed(tp2, cfg, drafter, params, plain, 3), plain)
    assert_lossless(tp2, replayed(tp2, cfg, drafter, params, plain[:1], 1), plain[:1], kinds=2)
    commit = tp2.commit_block
    monkeypatch.setattr(tp2, "commit_block",
                        lambda slots, count, block: commit(slots, (count + 1).clamp(max=block), block))
    assert [r.output_ids for r in replayed(tp2, cfg, drafter, params, plain, 3)] != plain
