"""`pdflash dflash train` on CPU with tiny settings: the training attention mask and labels,
the self-distillation data (equal to what the Engine generates; sharded, resumable, stopped by
a time limit; every source posed as it should be), a loss that falls on a fixed batch, the saved
drafter, a resumed run equal to an uninterrupted one, and `dflash eval`."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os

import pytest
import torch

from common.dflash.drafter import Drafter
from common.engine.engine import CHUNK_SIZE, Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.seq_cache import SeqCache
from common.tools.bench import gsm8k_data
from common.tools.drafter import sources
from common.tools.drafter.data import DataStore, GenSettings, Part, Sequence, file_sha256, generate, read_prompts
from common.tools.drafter.evaluate import eval_prompts
from common.tools.drafter.feature_cache import ROW_MULTIPLE, FeatureCache, Places, capture_rows, capture_shape
from common.tools.drafter.objective import (
    IGNORE,
    PAD_MULTIPLE,
    SOFT_TOP_K,
    Targets,
    block_attention_mask,
    block_labels,
    block_loss,
    block_soft_labels,
    block_tokens,
    draft_hidden,
    make_batch,
    padded_length,
    refine_prefix,
    sample_anchors,
)
from common.tools.drafter.train import (GEN_CHUNK_SIZE, _chunk_size, add_args, drafter_config, feature_cache,
                                        format_replans, held_out, parse_replans, repeated, reproduce_command, run,
                                        train)
from common.tools.drafter.plan import (StepCost, fit_cost, new_shape_cost, read_back_cost, replan_points, replanned_total,
                                       shape_of, steps_that_fit)
from common.tools.drafter.trainer import EpochOrder, Trainer

PROMPTS = os.path.join(os.path.dirname(__file__), "fixtures", "dflash_prompts.jsonl")
WORKED = gsm8k_data.DEFAULT_TRAIN  # shipped questions with worked answers (the few-shot format)
NEW_TOKENS = 6


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(["--prompts", PROMPTS, "--device", "cpu", "--no-progress", *argv])


# ---- no model ------------------------------------------------------------------------------

def brute_force_mask(anchors: list[list[int]], ctx_len: int, B: int, window: int | None) -> torch.Tensor:
    S, A = len(anchors), len(anchors[0])
    m = torch.zeros(S, A * B, ctx_len + A * B, dtype=torch.bool)
    for s in range(S):
        for j, a in enumerate(anchors[s]):
            for i in range(B):
                q = j * B + i
                for t in range(ctx_len):
                    m[s, q, t] = t < a and (window is None or t >= a - window)
                for k in range(A * B):
                    m[s, q, ctx_len + k] = k // B == j
    return m.unsqueeze(1)


def test_block_attention_mask():
    # Context strictly before the anchor, bidirectional inside the block, blocks isolated.
    m = block_attention_mask(torch.tensor([[3, 7]]), ctx_len=10, block_size=4)[0, 0]
    assert m.shape == (8, 18)
    for q in range(4):
        assert m[q, :10].tolist() == [True] * 3 + [False] * 7
        assert m[q, 10:].tolist() == [True] * 4 + [False] * 4
    for q in range(4, 8):
        assert m[q, :10].tolist() == [True] * 7 + [False] * 3
        assert m[q, 10:].tolist() == [False] * 4 + [True] * 4
    g = torch.Generator().manual_seed(1)
    anchors = torch.randint(0, 20, (3, 5), generator=g)
    for window in (None, 4):
        got = block_attention_mask(anchors, 20, 6, window)
        assert torch.equal(got, brute_force_mask(anchors.tolist(), 20, 6, window))


def test_anchors_and_labels():
    seqs = [Sequence("chat", 0, 0, 5, torch.arange(100, 112).int().numpy()),  # response 5..11
            Sequence("chat", 1, 0, 3, torch.arange(200, 206).int().numpy())]  # response 3..5: anchors 3, 4
    batch = make_batch(seqs)
    assert batch.ids.shape == (2, PAD_MULTIPLE) and batch.lengths.tolist() == [12, 6]  # padded: fewer shapes
    assert not batch.ids[0, 12:].any() and not batch.ids[1, 6:].any()
    anchors, ok = sample_anchors(batch, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 4)
    a0 = anchors[0][ok[0]].tolist()
    assert len(set(a0)) == 4 and all(5 <= a <= 10 for a in a0)
    assert sorted(anchors[1][ok[1]].tolist()) == [3, 4] and ok[1].sum() == 2
    labels = block_labels(batch, anchors, ok, block_size=4)
    for s, seq in enumerate(seqs):
        for j in range(4):
            a = int(anchors[s, j])
            for k in range(4):
                want = int(seq.ids[a + k]) if ok[s, j] and k > 0 and a + k < len(seq.ids) else IGNORE
                assert labels[s, j, k] == want


def test_sampled_answers_labelled_on_the_greedy_path():
    # Sampled answer 100..111 from position 2; the target's greedy choice after position t is
    # 1000 + t except after 5, where it chose the sampled token 6 + 100 = 106: the sampled tokens
    # at positions 3, 4, 5 and 7.. are off the greedy path, the one at 6 is on it.
    ids = torch.arange(100, 112)
    seqs = [Sequence("chat", 0, 1, 2, ids.int().numpy(), temperature=0.8),
            Sequence("chat", 1, 0, 2, ids.int().numpy())]  # greedy: labelled with its own tokens
    batch = make_batch(seqs)
    target_next = torch.arange(1000, 1000 + batch.ids.shape[1]).repeat(2, 1)  # [S, L] as capture gives it
    target_next[:, 5] = 106
    anchors, ok = torch.tensor([[5, 2, 4], [5, 2, 4]]), torch.ones(2, 3, dtype=torch.bool)
    argmax = block_labels(batch, anchors, ok, 4, target_next)
    path = block_labels(batch, anchors, ok, 4, target_next, greedy_path=True)
    assert argmax[0].tolist() == [[IGNORE, 106, 1006, 1007], [IGNORE, 1002, 1003, 1004], [IGNORE, 1004, 106, 1006]]
    # Anchor 5: the token at 6 is the greedy choice, the one at 7 is not: position 3 is dropped.
    # Anchor 2: the token at 3 is not: everything after position 1 is dropped.
    # Anchor 4: the token at 5 is not, the one at 6 is: the path stays broken, 2 and 3 are dropped.
    assert path[0].tolist() == [[IGNORE, 106, 1006, IGNORE], [IGNORE, 1002, IGNORE, IGNORE], [IGNORE, 1004, IGNORE, IGNORE]]
    assert path[1].tolist() == argmax[1].tolist() == [[IGNORE, 106, 107, 108], [IGNORE, 103, 104, 105],
                                                      [IGNORE, 105, 106, 107]]


def test_soft_labels_mix_the_targets_distribution_into_each_label():
    # The target's top-2 after position t of sequence s: tokens 10*t + s and 10*t + s + 1, with
    # probabilities 0.75 / 0.25 (or 0.5 / 0.5 for s = 1).
    S, L, B, V, H = 2, 9, 4, 64, 8
    t = torch.arange(L)[None, :, None]
    ids = 10 * t + torch.arange(S)[:, None, None] + torch.tensor([0, 1])
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])[:, None, :].expand(S, L, 2).contiguous()
    targets = Targets({}, top_ids=ids % V, top_probs=probs)
    anchors = torch.tensor([[1, 4], [0, 5]])
    soft_ids, soft_probs = block_soft_labels(targets, anchors, B)
    # Position k of the block at anchor a: the target's distribution after a+k-1.
    for s in range(S):
        for j in range(2):
            for k in range(1, B):
                assert soft_ids[s, j, k].tolist() == targets.top_ids[s, int(anchors[s, j]) + k - 1].tolist()
                assert soft_probs[s, j, k].tolist() == probs[s, 0].tolist()

    g = torch.Generator().manual_seed(0)
    hidden, lm_head = torch.randn(S, 2, B, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (S, 2, B), generator=g)
    labels[:, :, 0] = IGNORE
    labels[1, 1, 2:] = IGNORE
    gamma, w = 3.0, 0.4
    logp = torch.log_softmax(hidden @ lm_head.T, -1)
    num = den = 0.0
    for s in range(S):
        for j in range(2):
            for k in range(1, B):
                if labels[s, j, k] == IGNORE:
                    continue
                hard = -logp[s, j, k, labels[s, j, k]]
                soft = -(soft_probs[s, j, k] * logp[s, j, k, soft_ids[s, j, k]]).sum()
                weight = torch.exp(torch.tensor(-(k - 1) / gamma))
                num, den = num + weight * ((1 - w) * hard + w * soft), den + weight
    loss, _ = block_loss(hidden, labels, lm_head, gamma, (soft_ids, soft_probs), w)
    torch.testing.assert_close(loss, num / den)
    hard_only, _ = block_loss(hidden, labels, lm_head, gamma)
    assert torch.equal(block_loss(hidden, labels, lm_head, gamma, (soft_ids, soft_probs), 0.0)[0], hard_only)
    assert abs(loss.item() - hard_only.item()) > 1e-3  # the soft part counts


def test_sources_and_greedy_answers_weighted_up_by_repetition():
    seqs = [Sequence(src, i, k, 1, torch.arange(3).int().numpy(), temperature=0.0 if k == 0 else 0.8)
            for src in ("chat", "fewshot") for i in range(2) for k in range(2)]
    got, drawn = repeated(seqs, {"chat": 3}, greedy_repeat=2)
    count = {(s.source, s.i, s.k): sum(t is s for t in got) for s in seqs}
    assert count == {("chat", i, 0): 6 for i in range(2)} | {("chat", i, 1): 3 for i in range(2)} | \
        {("fewshot", i, 0): 2 for i in range(2)} | {("fewshot", i, 1): 1 for i in range(2)}
    assert drawn == []
    assert repeated(seqs, {}, 1) == (seqs, [])
    assert repeated(seqs, {"fewshot": 0}, 1) == ([s for s in seqs if s.source == "chat"], [])
    # A fraction: the greedy few-shot answers once an epoch (0.5 x 2), the sampled ones drawn half at a time.
    got, drawn = repeated(seqs, {"fewshot": 0.5}, greedy_repeat=2)
    fewshot = [s for s in seqs if s.source == "fewshot"]
    assert [s for s in got if s.source == "fewshot"] == [s for s in fewshot if not s.sampled]
    assert drawn == [([s for s in fewshot if s.sampled], 1)]
    # Each source's share apart, at least one of a group: half of one sampled answer is one.
    _, drawn = repeated(seqs, {"chat": 0.5, "fewshot": 0.5}, greedy_repeat=1)
    assert sorted((g[0].source, g[0].sampled, len(g), k) for g, k in drawn) == [
        ("chat", False, 2, 1), ("chat", True, 2, 1), ("fewshot", False, 2, 1), ("fewshot", True, 2, 1)]
    assert repeated(seqs[1:2], {"chat": 0.5}, 1)[1] == [(seqs[1:2], 1)]
    for bad in ("poetry=2", "chat=-1", "chat", "chat=x", "chat=nan", "chat=inf"):
        with pytest.raises(ValueError, match="source-repeat"):
            train(parse("--source-repeat", bad), None, None)
    with pytest.raises(ValueError, match="soft-labels must be between 0 and 1"):
        train(parse("--soft-labels", "1.5"), None, None)
    with pytest.raises(SystemExit):  # argparse: "want a number of steps or auto"
        parse("--steps", "many")
    with pytest.raises(ValueError, match="gen-chunk-size must be positive"):
        train(parse("--gen-chunk-size", "0"), None, None)


def test_an_epoch_draws_its_share_of_a_fractional_source_afresh():
    seqs = [Sequence("chat", i, 0, 1, torch.arange(3 + i % 5).int().numpy()) for i in range(40)]
    group = [Sequence("fewshot", i, 1, 1, torch.arange(4 + i % 7).int().numpy(), temperature=0.8) for i in range(30)]
    order = EpochOrder(seqs, 8, seed=3, drawn=[(group, 10)])
    assert order.steps_per_epoch == 7  # (40 + 10) / 8, rounded up
    picked = []
    for epoch in range(3):
        seen = [s for step in range(epoch * 7, epoch * 7 + 7) for s in order.batch(step)]
        assert len(seen) == 50 and all(sum(t is s for t in seen) == 1 for s in seqs)
        picked.append({s.i for s in seen if s.source == "fewshot"})
        assert len(picked[-1]) == 10
    assert len(picked[0] | picked[1] | picked[2]) > 10  # not the same ten every epoch
    again = EpochOrder(seqs, 8, seed=3, drawn=[(group, 10)])
    assert [s.i for s in again.batch(9)] == [s.i for s in order.batch(9)]  # a resumed run draws the same
    plain = EpochOrder(seqs, 8, seed=3)
    assert plain.steps_per_epoch == 5 and not any(s.source == "fewshot" for st in range(5) for s in plain.batch(st))
    # How often an epoch meets each sequence (what the feature cache places first): a whole
    # repeat twice, the drawn group 10 of 30.
    twice = EpochOrder(seqs + seqs[:5], 8, seed=3, drawn=[(group, 10)])
    times = {id(s): n for s, n in twice.per_epoch()}
    assert len(times) == 70 and [times[id(s)] for s in seqs[4:6]] == [2.0, 1.0]
    assert times[id(group[0])] == pytest.approx(1 / 3)


def test_steps_auto_plans_from_a_fitted_step_cost():
    cost = fit_cost([(n, 0.02 + 1e-6 * n) for n in (1000, 4000, 2000, 8000)])
    assert cost.fixed == pytest.approx(0.02) and cost.per_token == pytest.approx(1e-6)
    assert fit_cost([(1000, 0.5), (1000, 0.7)]) == StepCost(pytest.approx(0.6), 0.0)  # sizes that do not vary
    assert fit_cost([(1000, 0.9), (2000, 0.1)]).per_token == 0.0  # noise, not a negative cost
    stalled = [(n, 0.02 + 1e-6 * n) for n in (1000, 4000, 2000, 8000, 3000)] + [(2000, 40.0)]  # a recompile
    assert fit_cost(stalled).per_token == pytest.approx(1e-6)
    through_origin = fit_cost([(1000, 0.0009), (2000, 0.0021), (3000, 0.0030)])  # fixed part < 0 by noise
    assert through_origin.fixed == 0.0 and through_origin.per_token == pytest.approx(1e-6, rel=0.05)
    seqs = [Sequence("chat", i, 0, 1, torch.arange(10).int().numpy()) for i in range(8)]
    order = EpochOrder(seqs, 2, seed=0)  # every batch 2 x 32 padded tokens (10 rounded up)
    flat = StepCost(1.0, 0.0)
    # 1 s a step, 0.5 s after every 4th: 4.5 s for four steps, 9 s for eight, 10 s for nine.
    assert steps_that_fit(order, flat, 9.9, save_every=4, save_s=0.5) == 8
    assert steps_that_fit(order, flat, 10.0, save_every=4, save_s=0.5) == 9
    assert steps_that_fit(order, flat, 10.9, save_every=4, save_s=0.5) == 9
    assert steps_that_fit(order, StepCost(0.0, 1 / 64), 10.0, save_every=100, save_s=0.0) == 10  # 1 s a 64-token step
    assert steps_that_fit(order, flat, 0.5, save_every=4, save_s=0.5) == 0
    # Snapshots after steps 2, 4, 6, 8 and checkpoints after 4, 8: the 8th step ends at 11 s.
    assert steps_that_fit(order, flat, 10.0, save_every=4, save_s=0.5, snapshot_every=2) == 7
    with pytest.raises(ValueError, match="timed at"):
        steps_that_fit(order, StepCost(0.0, 0.0), 10.0, save_every=4, save_s=0.0)
    # Every batch here is 2 x 32: 5 s more for its first step makes four steps fit in 9.9 s
    # (6, 7, 8, 9 + 0.5), none where the process ran the shape already (the probe's).
    cold = StepCost(1.0, 0.0, new_shape=5.0)
    assert steps_that_fit(order, cold, 9.9, save_every=4, save_s=0.5) == 4
    assert steps_that_fit(order, cold, 9.9, save_every=4, save_s=0.5, seen={(2, 32)}) == 8
    # Lengths share a shape up to the next multiple of PAD_MULTIPLE.
    of_lengths = lambda *ns: shape_of([Sequence("chat", 0, 0, 1, torch.zeros(n).int().numpy()) for n in ns])
    assert of_lengths(10, 31) == of_lengths(32, 5) == (2, 32) and of_lengths(33, 2) == (2, 64)
    assert new_shape_cost([0.30, 0.21, 0.50], [0.10, 0.10, 0.11]) == pytest.approx(0.2)  # the median extra
    assert new_shape_cost([0.10, 0.10], [0.11, 0.12]) == 0.0  # noise, not a saving
    # A feature cache: 1 s a step to capture, 0.25 s read back. With room for every sequence the
    # first epoch (4 steps) captures, then 24 steps read back in 10 s; with room for none it is
    # the walk without a cache; with room for half, in between. The walk stores what it meets.
    read_back = StepCost(0.25, 0.0)
    places_for = lambda room: Places([(id(s), len(s.ids)) for s in seqs], room)  # noqa: E731
    walk = lambda room: steps_that_fit(order, flat, 10.0, save_every=100, save_s=0.0,  # noqa: E731
                                       cached=(read_back, places_for(room)))
    assert walk(80) == 28 and walk(0) == steps_that_fit(order, flat, 10.0, save_every=100, save_s=0.0) == 10
    assert 10 < walk(40) < 28
    # The probe's third run reads back only the placed share of each batch: a step of share s took
    # s x 1 s + (1 - s) x its captured 3 s; below a quarter the share is not read at all.
    read = [(64, 0.5 * 1.0 + 0.5 * 3.0), (128, 0.8 * 1.5 + 0.2 * 3.5), (64, 0.1 * 1.0 + 0.9 * 3.0)]
    got = read_back_cost(read, [3.0, 3.5, 3.0], [0.5, 0.8, 0.1])
    assert got.fixed == pytest.approx(0.5) and got.per_token == pytest.approx(0.5 / 64)
    assert read_back_cost(read[2:], [3.0], [0.1]) is None
    half = places_for(40)
    steps_that_fit(order, flat, 10.0, save_every=100, save_s=0.0, cached=(read_back, half))
    assert half.used == 40 and half.stored == set(half.start) == {id(s) for s in seqs[:4]}  # 10 tokens each


def test_partial_captures_run_few_shapes():
    """The rows of a partial capture are rounded up to ROW_MULTIPLE (at most the batch's) by
    repeating its own, so that its shapes repeat; the planner's walk charges a capture shape's
    first run once, and not where the process ran it already."""
    assert ROW_MULTIPLE == 8
    assert capture_rows([5, 2, 9], 64) == [5, 2, 9, 5, 2, 9, 5, 2] and capture_rows([0, 3], 4) == [0, 3, 0, 3]
    assert len(capture_rows(list(range(9)), 64)) == 16 and len(capture_rows(list(range(60)), 64)) == 64
    assert capture_shape([10, 40, 7], 64) == (8, 64)
    # 64 sequences of 10 tokens in batches of 16, room for 48: from the second epoch on, each batch
    # captures the few of its sequences without a place, in 8 rows, or 16 (its own shape, met at
    # its first step). 5 s for a capture shape's first run leave fewer steps in the time.
    seqs = [Sequence("chat", i, 0, 1, torch.arange(10).int().numpy()) for i in range(64)]
    order = EpochOrder(seqs, 16, seed=0)
    walk = lambda held, seen=frozenset(): steps_that_fit(  # noqa: E731
        order, StepCost(1.0, 0.0), 20.0, save_every=100, save_s=0.0, seen=seen,
        cached=(held, Places([(id(s), 10) for s in seqs], 480)))
    held, cold = StepCost(0.25, 0.0), StepCost(0.25, 0.0, new_shape=5.0)
    assert walk(cold) < walk(held) == walk(cold, seen={("capture", 8, 32)})
    assert walk(cold, seen={(8, 32)}) == walk(cold)  # a batch shape is not a capture shape


def test_generation_prefill_steps_default_by_device():
    """Larger prefill steps on CUDA, where each step costs host time; serving's size on the CPU;
    what is asked for, anywhere."""
    assert _chunk_size(parse("--device", "cpu")) == CHUNK_SIZE
    assert _chunk_size(parse("--device", "cuda")) == GEN_CHUNK_SIZE > CHUNK_SIZE
    assert _chunk_size(parse("--device", "cuda", "--gen-chunk-size", "4096")) == 4096


# ---- with the embedded model --------------------------------------------------------------

@pytest.fixture(scope="module")
def target():
    from common.service.loader import ModelOptions, load_model

    # One intra-op thread for this module: on a busy 2-core machine two OpenMP threads that
    # wait on each other made these tests 3-4x slower (26 s vs 114 s); restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(ModelOptions(kv_pages=48))
    torch.set_num_threads(threads)


def settings_for(runner, path: str = PROMPTS, **changes) -> GenSettings:
    return GenSettings(**{"model": runner.cfg.name, "prompts": os.path.basename(path),
                          "prompts_sha256": file_sha256(path), "prompt_field": "question", "shots": 2,
                          "gen_max_new_tokens": NEW_TOKENS, "sample_temperatures": [0.8, 1.1], "sample_top_p": 0.95,
                          "seed": 0, **changes})


def chat_sources(tok, questions: list[str], samples: int) -> list[sources.Source]:
    return sources.build(tok, questions, None, formats=("chat",), shots=0, samples=samples, self_math=0,
                         self_chat=0, seed=0)


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory):
    """Greedy + two sampled answers for the fixture prompts, generated in three runs: one
    stopped by its time limit at once, one of two prompts, and one that resumes the folder
    (after a torn line) with a third prompt and the samples, prefilling 8 prompt tokens a step
    (test_data_matches_engine compares its greedy answer with an engine's of the default chunk).
    Returns (store, sources)."""
    runner, tok = target
    folder = str(tmp_path_factory.mktemp("data") / "data")
    questions = [r["question"] for r in read_prompts(PROMPTS, "question", 3)]
    settings = settings_for(runner)
    stopped = generate(runner, tok, chat_sources(tok, questions[:2], 0), DataStore(folder, settings), max_running=8,
                       time_limit=0.0, progress=False)
    assert stopped["stopped"] == "time limit" and stopped["generated"] == 0
    first = generate(runner, tok, chat_sources(tok, questions[:2], 0), DataStore(folder, settings), max_running=8,
                     progress=False)
    assert first["generated"] == 2 and first["reused"] == 0 and first["stopped"] == "done"
    with open(os.path.join(folder, "chat-0000.jsonl"), "a") as f:
        f.write('{"i": 2, "k": 0, "t": 0.0, "prompt_len": 3, "ids": [1, 2')  # a torn line from a killed run
    srcs = chat_sources(tok, questions, 2)
    second = generate(runner, tok, srcs, DataStore(folder, settings), max_running=8, chunk_size=8, progress=False)
    assert second["reused"] == 2 and second["generated"] == 7
    return DataStore(folder, settings), srcs


def engines_record_timing(module, monkeypatch) -> list[bool]:
    """module.Engine replaced by one that records, as each is built, whether gemv may time
    kernels then (False inside gemv.kept_only)."""
    from common.model import gemv

    timing = []

    class Recording(Engine):
        def __init__(self, *a, **kw):
            timing.append(gemv._timing)
            super().__init__(*a, **kw)

    monkeypatch.setattr(module, "Engine", Recording)
    return timing


def test_time_limit_counts_from_since_and_no_kernel_is_timed(target, tmp_path, monkeypatch):
    """generate's --gen-time-limit counts from `since` where given (the command's start, so that
    the processes of --gen-workers stop together): a limit already spent there generates nothing,
    where the same limit from now generates the answer. Its engines are built with no product's
    kernel timed (gemv.kept_only)."""
    import time

    from common.model import gemv
    from common.tools.drafter import data

    timing = engines_record_timing(data, monkeypatch)
    runner, tok = target
    srcs = chat_sources(tok, [read_prompts(PROMPTS, "question", 1)[0]["question"]], 0)
    late = generate(runner, tok, srcs, DataStore(str(tmp_path / "late"), settings_for(runner)), max_running=8,
                    time_limit=600, since=time.time() - 601, progress=False)
    assert late["stopped"] == "time limit" and late["generated"] == 0
    now = generate(runner, tok, srcs, DataStore(str(tmp_path / "now"), settings_for(runner)), max_running=8,
                   time_limit=600, progress=False)
    assert now["stopped"] == "done" and now["generated"] == 1
    assert timing == [False, False] and gemv._timing


def test_a_shards_greedy_answers_decode_before_its_samples(target, tmp_path, monkeypatch):
    """Within a shard generation asks every greedy answer before any sampled one, so that the
    engine's batch holds one kind most of the time and its greedy stretches decode without the
    sampler's noise and sort (Mode.GREEDY): here the decode steps run greedy, then sampling,
    never back."""
    from common.engine import decoder, sampler
    from common.tools.drafter.data import pending

    runner, tok = target
    modes = []

    def recording(params):
        modes.append(sampler.mode_of(params))
        return modes[-1]

    monkeypatch.setattr(decoder, "mode_of", recording)
    srcs = chat_sources(tok, [r["question"] for r in read_prompts(PROMPTS, "question", 3)], 2)
    store = DataStore(str(tmp_path / "data"), settings_for(runner))
    assert [(job.i, job.k) for job in pending(srcs, store)] == [(i, 0) for i in range(3)] + \
        [(i, k) for i in range(3) for k in (1, 2)]
    stats = generate(runner, tok, srcs, store, max_running=3, progress=False)
    assert stats["generated"] == 9
    assert modes[0] == sampler.Mode.GREEDY and modes[-1] == sampler.Mode.FULL and modes == sorted(modes), modes


def test_data_matches_engine(target, dataset):
    runner, tok = target
    store, srcs = dataset
    seqs = store.sequences(srcs)
    assert sorted((s.i, s.k) for s in seqs) == [(i, k) for i in range(3) for k in range(3)]
    assert {s.temperature for s in seqs if s.k} == {0.8, 1.1}  # the temperatures cycle over the samples
    engine = Engine(runner, tok.eos_token_ids, max_running=8)
    questions = [r["question"] for r in read_prompts(PROMPTS, "question", 3)]
    reqs = [Request(f"ref{i}", tok.apply_chat_template([{"role": "user", "content": q}]),
                    SamplingParams(max_new_tokens=NEW_TOKENS)) for i, q in enumerate(questions)]
    engine.run_all(reqs)
    greedy = {s.i: s for s in seqs if s.k == 0}
    for i, req in enumerate(reqs):
        assert greedy[i].prompt_len == req.prompt_len
        assert greedy[i].ids.tolist() == req.prompt_ids + req.output_ids
    assert all(s.response_len >= 1 and s.sampled for s in seqs if s.k)
    # A changed generation setting must not silently mix into the folder.
    with pytest.raises(ValueError, match="other settings"):
        DataStore(store.folder, settings_for(runner, gen_max_new_tokens=9))


def test_data_of_several_processes_equals_one_process(target, dataset, tmp_path):
    """--gen-workers 2: two spawned processes, each with its own target, write what one process
    writes (fp32 greedy answers and seeded samples do not depend on the batch), each only to its
    own files and only its own prompts, a written problem answered by the process that wrote it;
    one process then reads their files as its own."""
    runner, tok = target
    store, srcs = dataset
    folder = str(tmp_path / "data")
    argv = ["--out", str(tmp_path), "--max-seqs", "3", "--samples-per-prompt", "2", "--self-math", "4",
            "--sample-temperatures", "0.8,1.1", "--shots", "2", "--gen-max-running", "8", "--kv-pages", "48",
            "--stage", "data"]
    assert run(parse(*argv, "--data", folder, "--gen-workers", "2", "--gen-max-new-tokens", str(NEW_TOKENS))) == 0
    files = sorted(f for f in os.listdir(folder) if f.endswith(".jsonl"))
    assert files == [f"{src}-0000.{k}of2.jsonl" for src in ("chat", "self-math", "self-math-q") for k in (0, 1)]
    for name in files:
        k = int(name.split(".")[1][0])
        assert all(json.loads(line)["i"] % 2 == k for line in open(os.path.join(folder, name)))
    one = str(tmp_path / "one")
    assert train(parse(*argv, "--data", one, "--gen-max-new-tokens", str(NEW_TOKENS)), runner, tok) == 0
    flat = lambda path, part=Part(): {key: r if isinstance(r, str) else r.ids.tolist()  # noqa: E731
                                      for key, r in DataStore(path, settings_for(runner), part).records.items()}
    assert flat(folder) == flat(one) and len([key for key in flat(one) if key[0] == "self-math"]) == 4 * 3
    ids = lambda st: {(s.i, s.k): s.ids.tolist() for s in st.sequences(srcs)}  # noqa: E731
    assert ids(DataStore(folder, settings_for(runner))) == ids(store) and len(ids(store)) == 9
    again = generate(runner, tok, srcs, DataStore(folder, settings_for(runner)), max_running=8, progress=False)
    assert again["generated"] == 0 and again["reused"] == 9

    # A torn last line is dropped only by the process that appends to that file: in another
    # process's file it may be a line being written.
    torn = os.path.join(folder, "chat-0000.1of2.jsonl")
    with open(torn, "a") as f:
        f.write('{"i": 5, "k": 0, "t": 0.0, "prompt_len": 3, "ids": [1, 2')
    size = os.path.getsize(torn)
    DataStore(folder, settings_for(runner))
    DataStore(folder, settings_for(runner), Part(0, 2))
    assert os.path.getsize(torn) == size
    assert flat(folder, Part(1, 2)) == flat(one)
    assert os.path.getsize(torn) < size and open(torn).read().endswith("\n")

    # A process's failure stops the command with its error (here: the folder holds other settings;
    # both processes find it as they start, and the first to report it is named).
    with pytest.raises(RuntimeError, match="generating process [01] failed: ValueError: .* other settings"):
        run(parse(*argv, "--data", folder, "--gen-workers", "2", "--gen-max-new-tokens", str(NEW_TOKENS + 1)))


def test_fewshot_and_self_written_sources(target, tmp_path, monkeypatch, capsys):
    """The few-shot source asks in the users' format (other questions of the file as worked
    examples, then the question, plain completion with the format's stop strings); a stage-2
    source asks, as a chat turn, what its stage-1 source wrote, and skips what was cut off.
    Progress lines (without a bar) name the stage whose rate they give."""
    from common.tools.drafter import data

    monkeypatch.setattr(data, "NOTE_EVERY_S", -1.0)  # a line at every finished step
    runner, tok = target
    rows = read_prompts(WORKED, "question", 4)
    items = [gsm8k_data.Item(r["question"], r["answer"]) for r in rows]
    store = DataStore(str(tmp_path / "data"), settings_for(runner, WORKED))
    srcs = sources.build(tok, [r["question"] for r in rows], items, formats=("fewshot",), shots=2, samples=0,
                         self_math=2, self_chat=0, seed=0, written=lambda name, i: store.written(name, i, tok))
    assert [s.name for s in srcs] == ["fewshot", "self-math-q", "self-math"]
    few = srcs[0].prompt(1)
    text = tok.decode(few.ids)
    assert text.endswith(f"Question: {items[1].question}\nAnswer:") and text.count("Question: ") == 3
    assert items[1].answer not in text and few.stop == tuple(gsm8k_data.STOP)
    assert srcs[1].keys == [(0, 1), (1, 1)] and srcs[1].params(0, 1, NEW_TOKENS, (0.8,), 0.95, 0).temperature == 1.0
    stats = generate(runner, tok, srcs, store, max_running=8, progress=False)
    written = {i: store.records[("self-math-q", i, 1)] for i in range(2)}
    for i, seq in written.items():
        answer = store.records[("self-math", i, 0)]
        if seq.finish == "stop":  # a finished problem is asked as a chat turn
            body = tok.decode([t for t in seq.response_ids if t not in tok.eos_token_ids]).strip()
            assert answer.ids[:answer.prompt_len].tolist() == tok.apply_chat_template([{"role": "user", "content": body}])
        else:  # cut off by the token limit: not asked, and recorded so that no later run asks it
            assert answer == "its written prompt is unusable"
    assert stats["generated"] + stats["skipped"] == 4 + 2 + 2
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("generate: ")]
    stages = [line.split("; ")[1].split(" at ")[0] for line in notes]
    assert stages[0] == "self-math-q" and stages[-1] == "fewshot+self-math" and all(" tok/s" in n for n in notes)


def test_source_samples_set_a_sources_sampled_answers(target):
    """--source-samples gives one source its own number of sampled answers (here more of the chat
    answers, fewer of the few-shot ones), the other sources keeping --samples-per-prompt."""
    _, tok = target
    rows = read_prompts(WORKED, "question", 3)
    items = [gsm8k_data.Item(r["question"], r["answer"]) for r in rows]
    srcs = sources.build(tok, [r["question"] for r in rows], items, formats=("chat", "fewshot"), shots=1, samples=3,
                         self_math=2, self_chat=0, seed=0, source_samples={"fewshot": 1, "self-math": 0})
    ks = {s.name: sorted({k for _, k in s.keys}) for s in srcs}
    assert ks == {"chat": [0, 1, 2, 3], "fewshot": [0, 1], "self-math-q": [1], "self-math": [0]}
    assert len(srcs[0].keys) == 3 * 4 and len(srcs[1].keys) == 3 * 2
    for bad in ("poetry=2", "self-math-q=1", "chat=-1", "chat", "chat=x", "chat=1.5"):
        with pytest.raises(ValueError, match="source-samples"):
            train(parse("--source-samples", bad), None, None)
    assert "--source-samples fewshot=1" in reproduce_command(parse("--source-samples", "fewshot=1"))


def test_refine_flags_set_how_the_saved_drafter_drafts(target):
    from common.tools.drafter.evaluate import refine_settings
    from common.tools.drafter.train import _check_args

    runner, _ = target
    assert drafter_config(parse(), runner).refine_passes == 0
    cfg = drafter_config(parse("--refine", "0.5"), runner)
    assert (cfg.refine_passes, cfg.refine_threshold) == (2, 0.5)
    cfg = drafter_config(parse("--refine", "0.5", "--refine-passes", "1", "--refine-threshold", "0.7"), runner)
    assert (cfg.refine_passes, cfg.refine_threshold) == (1, 0.7)
    for bad in (("--refine", "1.5"), ("--refine-passes", "-1"), ("--refine-threshold", "1"),
                ("--refine", "0.5", "--block-size", "2")):
        with pytest.raises(ValueError, match=bad[0]):
            _check_args(parse(*bad))
    assert refine_settings("saved,0,2@0.4") == [{}, {"refine_passes": 0}, {"refine_passes": 2, "refine_threshold": 0.4}]
    with pytest.raises(ValueError, match="PASSES"):
        refine_settings("two")
    with pytest.raises(ValueError, match="between 0 and 1"):
        refine_settings("0,2@1.5")


def test_resume_checks_the_refine_share_not_how_the_drafter_drafts(target, tmp_path):
    from common.tools.drafter.trainer import load_checkpoint, save_checkpoint

    runner, _ = target
    cfg = drafter_config(parse("--layers", "1", "--block-size", "4", "--refine", "0.5"), runner)
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint(path, Trainer(runner, Drafter(cfg), lr=1e-3, total_steps=10, refine=0.5), 3, 1.0)
    other = dataclasses.replace(cfg, refine_passes=1, refine_threshold=0.7)
    assert load_checkpoint(path, Trainer(runner, Drafter(other), lr=1e-3, total_steps=10, refine=0.5), other, 10)[0] == 3
    with pytest.raises(ValueError, match="--refine 0.5"):
        load_checkpoint(path, Trainer(runner, Drafter(cfg), lr=1e-3, total_steps=10), cfg, 10)


def test_refine_prefix_gives_each_block_a_start_and_leaves_the_rest_scored():
    labels = torch.arange(2 * 60 * 6).view(2, 60, 6) % 7
    labels[0, :, 3:] = IGNORE  # past the end of a short sequence
    g = torch.Generator().manual_seed(0)
    own = labels.clone()
    assert not refine_prefix(labels, 0.0, g, own).any()
    given = refine_prefix(labels, 1.0, g, own)
    assert given[:, :, 1].all()  # every block, from its first draft position on
    assert not given[:, :, 0].any() and not given[:, :, -1].any()  # the anchor is the anchor; one is always scored
    assert not (given & (labels == IGNORE)).any()
    assert (given[:, :, 1:].int().diff(dim=-1) <= 0).all()  # a start: nothing given after a position that is not
    assert set(given[1].sum(-1).tolist()) == {1, 2, 3, 4}  # every start length of a block of 6
    share = refine_prefix(labels, 0.5, g, own)[:, :, 1].float().mean().item()
    assert 0.35 < share < 0.65
    # A sampled answer whose token at position 3 is not the target's greedy choice (its label):
    # the labels after it follow the sampled token, so no start reaches past position 2.
    own[1, :, 3] += 1
    given = refine_prefix(labels, 1.0, g, own)
    assert set(given[1].sum(-1).tolist()) == {1, 2} and not given[1, :, 3:].any()


@pytest.mark.parametrize("refine", [False, True])
def test_batched_blocks_match_one_block_at_a_time(target, dataset, refine):
    """All anchors of a padded batch in one masked forward == each block alone over its own
    context (what decoding does): the mask, positions and padding add nothing; with refine,
    the given start of a block takes the place of its MASKs."""
    runner, _ = target
    seqs = dataset[0].sequences(dataset[1])
    args = parse("--layers", "2", "--block-size", "4")
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(args, runner)).eval()
    trainer = Trainer(runner, drafter, lr=1e-3, total_steps=1)
    batch = make_batch(seqs[:3])
    feats = trainer.capture(batch).feats
    anchors, ok = sample_anchors(batch, 3, torch.Generator().manual_seed(1))
    labels = block_labels(batch, anchors, ok, 4)
    start = refine_prefix(labels, 1.0 if refine else 0.0, torch.Generator().manual_seed(2), block_tokens(batch, anchors, 4))
    given = labels.masked_fill(~start, IGNORE)
    assert start.any() == refine
    cos, sin = trainer.rope
    with torch.no_grad():
        hidden = draft_hidden(drafter, trainer.embed, feats, batch, anchors, trainer.rope, given)
        for s in range(batch.size):
            for j in range(3):
                a = int(anchors[s, j])
                ctx = drafter.fuse({layer: f[s, :a] for layer, f in feats.items()})
                ctx_kv = drafter.context_kv(ctx, cos[:a], sin[:a])
                block = [int(t) if t != IGNORE else 16 for t in given[s, j, 1:]]
                x = trainer.embed[torch.tensor([int(batch.ids[s, a])] + block)]

                def attend(i: int, h: torch.Tensor) -> torch.Tensor:
                    q, k, v = drafter.layers[i].self_attn.qkv(h, cos[a:a + 4], sin[a:a + 4])
                    keys, vals = torch.cat([ctx_kv[i][0], k]), torch.cat([ctx_kv[i][1], v])
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), enable_gqa=True)
                    return out.transpose(0, 1)

                alone = drafter.blocks(x, attend)
                torch.testing.assert_close(hidden[s, j], alone, atol=1e-4, rtol=1e-4)


def test_compiled_drafter_pass_equals_eager(target, dataset, monkeypatch):
    """Trainer(compile=True), as `dflash train --compile` runs it: the loss and every gradient of
    a step equal eager mode's, on two batches of other sizes, from one graph (the batch's sizes
    are dynamic, not specialised). Through AOTAutograd without a code generator (aot_eager): on a
    2-core CPU inductor's C++ build of the graphs takes about 40 s, and a GPU runs Triton's code,
    not that."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    torch._dynamo.reset()  # no graph of another test's
    runner, _ = target
    seqs = dataset[0].sequences(dataset[1])
    args = parse("--layers", "1", "--block-size", "4")
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(args, runner))
    eager = Trainer(runner, drafter, lr=1e-3, total_steps=1, anchors=3)
    compiled = Trainer(runner, drafter, lr=1e-3, total_steps=1, anchors=3, compile=True)
    for batch in (make_batch(seqs[:3]), make_batch(seqs[3:5])):
        targets = eager.capture(batch)
        grads = []
        for trainer in (eager, compiled):
            loss, _ = trainer.loss(batch, targets, torch.Generator().manual_seed(0))
            loss.backward()
            grads.append((loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
            drafter.zero_grad(set_to_none=True)
        torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-5, rtol=1e-5)
        for got, want in zip(grads[1][1], grads[0][1]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert grads[0][0] > 0
    assert len(graphs) == 1


def losses_on_one_batch(trainer: Trainer, batch, targets, steps: int = 12) -> list[float]:
    """The loss of each of `steps` optimizer steps on the same batch, targets and anchors."""
    losses = []
    for _ in range(steps):
        loss, _ = trainer.loss(batch, targets, torch.Generator().manual_seed(0))
        loss.backward()
        trainer.opt.step()
        trainer.opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_feature_cache_reads_back_what_capture_says(target, dataset):
    """Sequences with a place are stored when first captured and read back after, the rest
    captured each time: the features, the greedy next tokens of sampled answers and the loss are
    what capture gives, with two sequences placed and two that do not fit."""
    runner, _ = target
    seqs = dataset[0].sequences(dataset[1])  # prompt 0's greedy answer, then its samples, ...
    args = parse("--layers", "1", "--block-size", "4")
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(args, runner))
    layers, H = drafter.cfg.capture_layers, runner.cfg.hidden_size
    room = len(seqs[0].ids) + len(seqs[1].ids)  # places for the first two, in order of priority
    places = Places([(id(s), len(s.ids)) for s in seqs[:4]], room)
    cache = FeatureCache(places, layers, H, runner.dtype, runner.device)
    plain = Trainer(runner, drafter, lr=0.0, total_steps=1, anchors=4)
    cached = Trainer(runner, drafter, lr=0.0, total_steps=1, anchors=4, cache=cache)
    first, later = make_batch(seqs[:2]), make_batch([seqs[2], seqs[0], seqs[3], seqs[1]])
    unplaced = make_batch(seqs[2:4])
    losses = []
    for batch in (first, later, later, unplaced):
        want, got = plain.capture(batch), cached.capture(batch)
        for r, n in enumerate(batch.lengths.tolist()):
            for layer in layers:
                torch.testing.assert_close(got.feats[layer][r, :n], want.feats[layer][r, :n], rtol=1e-5, atol=1e-5)
            if batch.sampled[r]:
                span = slice(int(batch.prompt_lens[r]) - 1, n)
                assert torch.equal(got.next_token[r, span], want.next_token[r, span])
        gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
        losses.append((plain.loss(batch, want, gen())[0].item(), cached.loss(batch, got, gen())[0].item()))
        assert losses[-1][1] == pytest.approx(losses[-1][0], rel=1e-5)
    assert places.stored == set(places.start) == {id(seqs[0]), id(seqs[1])} and places.used == room
    assert (cache.hits, cache.misses) == (4, 8)
    ran = []  # the two sequences without a place, captured in the batch's 4 rows (ROW_MULTIPLE, at most 4)
    cache.targets(later, lambda b: ran.append(tuple(b.ids.shape)) or plain.capture(b))
    assert ran == [(4, padded_length(max(len(s.ids) for s in seqs[2:4])))]
    cache.feats.zero_()  # negative control: what it reads back is what the loss sees
    assert cached.loss(later, cached.capture(later), gen())[0].item() != pytest.approx(losses[-1][0], rel=1e-3)


def test_loss_falls_on_fixed_batch(target, dataset):
    runner, _ = target
    seqs = dataset[0].sequences(dataset[1])
    args = parse("--layers", "1", "--block-size", "4")
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(args, runner))
    trainer = Trainer(runner, drafter, lr=2e-3, total_steps=100, warmup=0, anchors=4)
    batch = make_batch(seqs[:4])  # greedy and sampled answers (labels from the target's argmax)
    targets = trainer.capture(batch)  # the target is frozen: run it once
    assert targets.next_token is not None
    losses = losses_on_one_batch(trainer, batch, targets)
    assert losses[-1] < 0.5 * losses[0], losses


def test_refine_training_scores_only_what_follows_the_given_start(target, dataset):
    runner, _ = target
    seqs = dataset[0].sequences(dataset[1])
    torch.manual_seed(0)
    trainer = Trainer(runner, Drafter(drafter_config(parse("--layers", "1", "--block-size", "4"), runner)), lr=2e-3,
                      total_steps=100, warmup=0, anchors=4, refine=1.0)
    batch = make_batch(seqs[:4])
    targets = trainer.capture(batch)
    _, metrics = trainer.loss(batch, targets, torch.Generator().manual_seed(0))
    # Each block was given a start, and is no accept length, except where a sampled answer's first
    # token is not the target's greedy choice (no start can be given there).
    anchors, ok = sample_anchors(batch, 4, torch.Generator().manual_seed(0))  # the loss's anchors
    labels = block_labels(batch, anchors, ok, 4, targets.next_token)
    first, own = labels[:, :, 1], block_tokens(batch, anchors, 4)[:, :, 1]
    assert metrics["blocks"] == ((first != IGNORE) & (first != own)).sum()
    trainer.refine = 0.0
    assert trainer.loss(batch, targets, torch.Generator().manual_seed(0))[1]["blocks"] > metrics["blocks"]
    trainer.refine = 1.0
    losses = losses_on_one_batch(trainer, batch, targets)
    assert losses[-1] < 0.5 * losses[0], losses


def test_refine_pass_drafts_what_training_teaches(target, dataset):
    """DFlashProposer.draft with refine passes == the training objective's blocks: the drafts the
    drafter is sure of are kept, the rest the argmax of the block with those drafts given in
    place of its first MASKs (draft_hidden with `given`), pass after pass."""
    from common.dflash.proposer import DFlashProposer, confidence

    runner, _ = target
    seq = dataset[0].sequences(dataset[1])[0]
    B = 6
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(parse("--layers", "2", "--block-size", str(B)), runner)).eval()
    with torch.no_grad():
        for p in drafter.parameters():  # drafts less alike than the init's
            p.mul_(3.0)
    trainer = Trainer(runner, drafter, lr=1e-3, total_steps=1)
    batch = make_batch([seq])
    feats = trainer.capture(batch).feats
    lm_head = runner.model.lm_head_weight
    with torch.no_grad():
        def training_blocks(given: torch.Tensor) -> torch.Tensor:  # logits [anchors, B-1, V]
            hidden = draft_hidden(drafter, trainer.embed, feats, batch, anchors, trainer.rope, given)
            return hidden[0, :, 1:] @ lm_head.T

        anchors = torch.arange(seq.prompt_len, len(seq.ids) - 1)[None, :]
        first = training_blocks(None)
        sure = confidence(first)
        given = torch.full((1, anchors.shape[1], B), IGNORE)
        given[0, :, 1] = first[:, 0].argmax(-1)  # every block given its first draft
        refined = training_blocks(given).argmax(-1)
        # An anchor where the drafter is surer of its first draft than of its second (a threshold
        # between the two gives a refine pass a start of one draft), and where that start changes
        # what follows (else the test could not fail).
        fits = (sure[:, 0] > sure[:, 1]) & (refined[:, 1:] != first[:, 1:].argmax(-1)).any(-1)
        assert fits.any()
        a = int(fits.nonzero()[0])
        threshold = float(torch.exp((sure[a, 0] + sure[a, 1]) / 2))
        expected = {0: first[a].argmax(-1).tolist(), 1: [int(first[a, 0].argmax())] + refined[a, 1:].tolist()}
        # A second pass, through the training path: its start is the leading drafts sure in the
        # pass that drafted them (position 1 in the first, the others in the second).
        second = training_blocks(given)[a]
        sure_now = [True] + (confidence(second[1:]) >= math.log(threshold)).tolist()
        start = next((k for k, ok in enumerate(sure_now) if not ok), B - 1)
        again = torch.full((1, anchors.shape[1], B), IGNORE)
        again[0, a, 1:1 + start] = torch.tensor(expected[1][:start])
        expected[2] = expected[1][:start] + training_blocks(again)[a, start:].argmax(-1).tolist()

        drafted = {}
        for passes in (0, 1, 2):
            drafter.set_refine({"refine_passes": passes, "refine_threshold": threshold})
            proposer = DFlashProposer(drafter, runner, runner.pool.num_pages)
            anchor = int(anchors[0, a])
            cache = SeqCache()
            proposer.reserve(cache, anchor + B)
            proposer.append_context([cache], {k: f[0, :anchor] for k, f in feats.items()}, [torch.arange(anchor)])
            table = torch.full((1, runner.max_pages + 1), proposer.scratch_slot // runner.page_size, dtype=torch.long)
            table[0, :len(cache.pages)] = torch.tensor(cache.pages)
            drafted[passes] = proposer.draft(torch.tensor([int(seq.ids[anchor])]), torch.tensor([anchor]), table,
                                             B)[0].tolist()
            proposer.release(cache)
    assert drafted == expected
    assert drafted[1] != drafted[0]


def test_soft_labels_are_the_targets_renormalised_top_k(target, dataset, monkeypatch):
    """capture(top_k) keeps, per position, the target's most likely next tokens and their
    probabilities renormalised over them (found a slice of positions at a time); the greedy token
    is the first; and a drafter trained on soft labels learns too."""
    from common.tools.drafter import objective

    monkeypatch.setattr(objective, "TOP_K_ROWS", 7)
    runner, _ = target
    seqs = dataset[0].sequences(dataset[1])
    args = parse("--layers", "1", "--block-size", "4")
    torch.manual_seed(0)
    trainer = Trainer(runner, Drafter(drafter_config(args, runner)), lr=2e-3, total_steps=100, warmup=0,
                      anchors=4, soft_weight=0.5)
    batch = make_batch(seqs[:2])
    targets = trainer.capture(batch)
    ids = batch.tokens[1]
    cache = SeqCache()
    runner.reserve(cache, len(ids))
    try:
        logits = runner.extend([cache], [ids], all_logits=True).logits.float()
    finally:
        runner.release(cache)
    p, n = int(batch.prompt_lens[1]) - 1, len(ids)  # from the position before the response
    top = logits[p:].topk(SOFT_TOP_K, dim=-1)
    assert torch.equal(targets.top_ids[1, p:n], top.indices)
    assert not targets.top_ids[1, :p].any() and not targets.top_probs[1, :p].any()
    torch.testing.assert_close(targets.top_probs[1, p:n], torch.softmax(top.values, -1))
    torch.testing.assert_close(targets.top_probs[1, p:n].sum(-1), torch.ones(n - p))
    assert torch.equal(targets.top_ids[1, p:n, 0], targets.next_token[1, p:n])
    losses = losses_on_one_batch(trainer, batch, targets)
    assert losses[-1] < 0.7 * losses[0], losses


def test_capture_runs_the_lm_head_only_where_labels_read_it(target, dataset, monkeypatch):
    """capture asks the target's LM head only for sampled answers, from the position before their
    response to their end (where a label can read its greedy choice), in passes of at most
    LOGIT_ROWS such rows (a sequence that asks more goes alone). There its greedy tokens are
    those of the target's logits over the whole sequence; elsewhere they are 0; and neither they
    nor the features depend on the grouping (features to rounding: products over fewer rows may
    sum in another order)."""
    from common.tools.drafter import objective

    runner, _ = target
    seqs = dataset[0].sequences(dataset[1])
    trainer = Trainer(runner, Drafter(drafter_config(parse("--layers", "1", "--block-size", "4"), runner)), lr=0.0,
                      total_steps=1, anchors=4)
    batch = make_batch(seqs[:4])
    sampled, plens = batch.sampled.tolist(), batch.prompt_lens.tolist()
    assert any(sampled) and not all(sampled)
    lens = [len(t) for t in batch.tokens]
    asks = [n - p + 1 if s else 0 for n, p, s in zip(lens, plens, sampled)]
    calls = []
    extend = runner.extend

    def counted(caches, tokens, **kw):
        calls.append((sum(len(t) for t in tokens), len(kw["logit_rows"])))
        return extend(caches, tokens, **kw)

    monkeypatch.setattr(runner, "extend", counted)
    whole = trainer.capture(batch)
    assert calls == [(sum(lens), sum(asks))]
    for r, ids in enumerate(batch.tokens):
        cache = SeqCache()
        runner.reserve(cache, len(ids))
        try:
            greedy = extend([cache], [ids], all_logits=True).logits.argmax(-1)
        finally:
            runner.release(cache)
        expected = torch.zeros(batch.ids.shape[1], dtype=torch.long)
        if sampled[r]:
            expected[plens[r] - 1:lens[r]] = greedy[plens[r] - 1:]
        assert torch.equal(whole.next_token[r], expected)
    big = max(asks)
    for bound in (big, big - 1):  # the sampled answers one per pass, then the largest alone over it
        calls.clear()
        monkeypatch.setattr(objective, "LOGIT_ROWS", bound)
        grouped = trainer.capture(batch)
        assert sum(t for t, _ in calls) == sum(lens) and sum(n for _, n in calls) == sum(asks)
        assert all(n <= bound or (n in asks and t in lens) for t, n in calls), calls
        assert len(calls) > 1
        assert torch.equal(grouped.next_token, whole.next_token)
        for layer in whole.feats:
            torch.testing.assert_close(grouped.feats[layer], whole.feats[layer], rtol=1e-3, atol=1e-3)


def test_dense_capture_equals_the_paged_one(target, dataset, monkeypatch):
    """Where capture runs the target as one dense causal pass over the padded batch
    (DENSE_DEVICES; forced here on the CPU), its greedy and top next tokens equal those of the
    pass through the KV cache and its features agree to rounding at every real position, with
    the LM head in one slice or in several, greedy tokens alone or with the top tokens. Only a
    plain decoder in one process runs dense (MLA and KDA keep state only the cache path has)."""
    from types import SimpleNamespace

    from common.model.architectures import build_on_meta
    from common.model.shapes import SHAPES
    from common.model.transformer import no_reduce
    from common.runner.layout import RankLayout
    from common.runner.model_runner import ModelRunner
    from common.tools.drafter import objective

    runner, _ = target
    batch = make_batch(dataset[0].sequences(dataset[1])[:4])
    assert len(set(batch.lengths.tolist())) > 1  # padding to the longest is exercised
    layers = (1, 14, 28)
    calls = []
    dense_pass = runner.forward_dense
    monkeypatch.setattr(runner, "forward_dense", lambda *a: calls.append(a) or dense_pass(*a))
    real = torch.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]
    for logit_rows, top_k in ((objective.LOGIT_ROWS, 4), (7, 4), (7, 0)):
        monkeypatch.setattr(objective, "LOGIT_ROWS", logit_rows)
        monkeypatch.setattr(objective, "TOP_K_ROWS", 3)
        monkeypatch.setattr(objective, "DENSE_DEVICES", ())
        paged = objective.capture(runner, batch, layers, argmax=True, top_k=top_k)
        monkeypatch.setattr(objective, "DENSE_DEVICES", (runner.device.type,))
        calls.clear()
        dense = objective.capture(runner, batch, layers, argmax=True, top_k=top_k)
        assert len(calls) == 1
        assert torch.equal(dense.next_token, paged.next_token) and bool(paged.next_token.any())
        if top_k:
            assert torch.equal(dense.top_ids, paged.top_ids)
            torch.testing.assert_close(dense.top_probs, paged.top_probs, rtol=1e-4, atol=1e-5)
        for layer in layers:
            torch.testing.assert_close(dense.feats[layer][real], paged.feats[layer][real], rtol=1e-3, atol=1e-3)
    assert runner.runs_dense
    runs_dense = lambda model, layout: ModelRunner.runs_dense.fget(SimpleNamespace(model=model, layout=layout))
    for layout in (RankLayout(tp=2), RankLayout(pp=2)):
        assert not runs_dense(runner.model, layout)
    for shape in ("deepseek-small", "kimi-linear-small"):
        assert not runs_dense(build_on_meta(SHAPES[shape], no_reduce), RankLayout())


def test_train_on_pooled_data(target, dataset, tmp_path):
    """--pool adds other data folders' sequences, each distinct sequence once, held-out prompts
    left out; the folders are checked before generation and never written."""
    import shlex
    import shutil

    runner, tok = target
    store, srcs = dataset
    pool, pool2 = str(tmp_path / "seed7"), str(tmp_path / "seed8")
    for folder, seed in ((pool, 7), (pool2, 8)):  # other runs' data: here, copies of this one
        shutil.copytree(store.folder, folder)
        meta = json.load(open(os.path.join(folder, "meta.json")))
        json.dump(meta | {"seed": seed}, open(os.path.join(folder, "meta.json"), "w"))
    with open(os.path.join(pool, "chat-0000.jsonl"), "a") as f:
        f.write('{"i": 9, "k": 0, "t": 0.0, "prompt_len": 3, "ids": [1, 2')  # a run still writing there
    before = {name: open(os.path.join(pool, name), "rb").read() for name in os.listdir(pool)}
    common = ["--data", store.folder, "--max-seqs", "3", "--gen-max-new-tokens", str(NEW_TOKENS),
              "--shots", "2", "--sample-temperatures", "0.8,1.1", "--layers", "1", "--block-size", "4",
              "--anchors", "4", "--batch-size", "2", "--steps", "1", "--save-every", "100"]
    out = str(tmp_path / "pooled")
    # This run asks for the 3 greedy answers, the last prompt held out: the pools add the samples
    # of the other two (both pools hold the same: once), but not those that repeat an answer.
    assert train(parse(*common, "--eval-prompts", "1", "--pool", f"{pool},{pool2}", "--out", out), runner, tok) == 0
    info = json.load(open(os.path.join(out, "train_info.json")))
    kept = [s for s in store.sequences(srcs) if s.i < 2 and s.response_len >= 2]
    distinct = {s.ids.tobytes() for s in kept}
    assert len([s for s in kept if s.k == 0]) == 2 and len(distinct) > 2
    assert info["data"]["sequences"] == len(distinct) and info["data"]["pooled_sequences"] == len(distinct) - 2
    words = shlex.split(info["command"])
    assert [os.path.abspath(f) for f in words[words.index("--pool") + 1].split(",")] == [pool, pool2]
    assert {name: open(os.path.join(pool, name), "rb").read() for name in os.listdir(pool)} == before
    # A source repeated 0 times is not trained on, from the pools neither: here every sequence is chat's.
    with pytest.raises(ValueError, match="every source repeated 0"):
        train(parse(*common, "--source-repeat", "chat=0", "--pool", pool, "--out", out), runner, tok)

    # Checked before generation: --stage data never trains.
    for key in ("model", "prompts_sha256", "prompt_field"):
        json.dump(meta | {key: "another"}, open(os.path.join(pool2, "meta.json"), "w"))
        with pytest.raises(ValueError, match=f"holds other data: {key}"):
            train(parse(*common, "--stage", "data", "--pool", pool2, "--out", out), runner, tok)
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        train(parse(*common, "--stage", "data", "--pool", str(tmp_path / "nowhere"), "--out", out), runner, tok)


def test_train_save_and_resume(target, dataset, tmp_path):
    runner, tok = target
    data = dataset[0].folder
    common = ["--data", data, "--max-seqs", "3", "--gen-max-new-tokens", str(NEW_TOKENS),  # greedy answers only
              "--shots", "2", "--sample-temperatures", "0.8,1.1",
              "--layers", "1", "--block-size", "4", "--anchors", "4", "--batch-size", "2", "--steps", "3",
              "--log-every", "1", "--save-every", "100"]
    split, straight = str(tmp_path / "split"), str(tmp_path / "straight")

    assert train(parse(*common, "--out", split, "--stop-at", "1"), runner, tok) == 0
    assert torch.load(os.path.join(split, "checkpoint.pt"), weights_only=True)["step"] == 1
    assert train(parse(*common, "--out", split, "--resume"), runner, tok) == 0
    assert torch.load(os.path.join(split, "checkpoint.pt"), weights_only=True)["step"] == 3
    log = [json.loads(line) for line in open(os.path.join(split, "train_log.jsonl"))]
    assert [r["step"] for r in log] == [1, 2, 3]  # the resumed run continued at step 2

    assert train(parse(*common, "--out", straight, "--snapshot-every", "2"), runner, tok) == 0
    resumed = Drafter.load(os.path.join(split, "drafter"))
    whole = Drafter.load(os.path.join(straight, "drafter"))
    for name, w in whole.state_dict().items():
        assert torch.equal(w, resumed.state_dict()[name]), name  # resume == one uninterrupted run
        assert torch.equal(w, ckpt_weights(straight)[name]), name  # the saved file == the trained weights
    assert resumed.cfg.block_size == 4 and resumed.cfg.mask_token_id == 16

    info = json.load(open(os.path.join(straight, "train_info.json")))
    assert info["command"].startswith("pdflash dflash train ") and "--resume" not in info["command"]
    assert info["data"]["sequences"] == 3 and info["steps"] == {"done": 3, "total": 3, "stopped": "done"}
    assert info["drafter"]["bytes"] <= 40_000_000
    assert {"loss", "acc1", "accepted"} <= set(info["final"])
    snap = json.load(open(os.path.join(straight, "snapshots", "step-2", "train_info.json")))
    assert snap["step"] == 2 and 0 < snap["trained_response_tokens"] < info["trained_response_tokens"]
    assert Drafter.load(os.path.join(straight, "snapshots", "step-2")).cfg == whole.cfg

    # --train-seed: a sibling on the same data (other batches and anchors); --seed's value by default.
    same, sibling = str(tmp_path / "same"), str(tmp_path / "sibling")
    assert train(parse(*common, "--out", same, "--train-seed", "0"), runner, tok) == 0
    assert train(parse(*common, "--out", sibling, "--train-seed", "5"), runner, tok) == 0
    same_w = Drafter.load(os.path.join(same, "drafter")).state_dict()
    sibling_w = Drafter.load(os.path.join(sibling, "drafter")).state_dict()
    for name, w in whole.state_dict().items():
        assert torch.equal(w, same_w[name]), name
    assert any(not torch.equal(w, sibling_w[name]) for name, w in whole.state_dict().items())
    assert "--train-seed 5" in json.load(open(os.path.join(sibling, "train_info.json")))["command"]
    assert "--train-seed" not in info["command"]

    # --init: a run starts from a trained drafter (at learning rate 0 it saves that drafter back).
    tuned = str(tmp_path / "tuned")
    assert train(parse(*common, "--out", tuned, "--init", os.path.join(straight, "drafter"), "--lr", "0"),
                 runner, tok) == 0
    for name, w in Drafter.load(os.path.join(tuned, "drafter")).state_dict().items():
        assert torch.equal(w, whole.state_dict()[name]), name

    # A deeper run grows it: its own layers first, then new ones that start as the identity, so
    # that the grown drafter scores every block exactly as the loaded one does.
    at = common.index("--layers")
    deeper = [*common[:at], "--layers", "2", *common[at + 2:]]
    grown_dir = str(tmp_path / "grown")
    assert train(parse(*deeper, "--out", grown_dir, "--init", os.path.join(straight, "drafter"), "--lr", "0"),
                 runner, tok) == 0
    grown = Drafter.load(os.path.join(grown_dir, "drafter"))
    assert grown.cfg.num_layers == 2
    for name, w in whole.state_dict().items():
        assert torch.equal(w, grown.state_dict()[name]), name
    assert grown.layers[1].self_attn.q_proj.weight.any()  # drawn, not zero: training can move it
    batch = make_batch(dataset[0].sequences(dataset[1])[:3])
    scores = []
    for d in (whole, grown):
        trainer = Trainer(runner, d, lr=0.0, total_steps=1, anchors=4)
        loss, m = trainer.loss(batch, trainer.capture(batch), torch.Generator().manual_seed(0))
        scores.append((loss.item(), m["accepted"].item()))
    assert scores[0] == scores[1]
    # Negative control: a new layer that does not start as the identity changes the scores.
    with torch.no_grad():
        grown.layers[1].mlp.down_proj.weight.normal_(0, 0.02)
    trainer = Trainer(runner, grown, lr=0.0, total_steps=1, anchors=4)
    assert trainer.loss(batch, trainer.capture(batch), torch.Generator().manual_seed(0))[0].item() != scores[0][0]

    # A run that reads more of the target's layers grows fc: the loaded layers' columns move to
    # their places among the new capture layers, the new ones start at zero, and the grown
    # drafter fuses the same context (to rounding: fc sums over more columns).
    wide_dir = str(tmp_path / "wide")
    assert train(parse(*common, "--out", wide_dir, "--init", os.path.join(straight, "drafter"), "--lr", "0",
                       "--capture-layers", "1,5,8,14,20,27,29"), runner, tok) == 0
    wide = Drafter.load(os.path.join(wide_dir, "drafter"))
    assert wide.cfg.capture_layers == (1, 5, 8, 14, 20, 27, 29) and whole.cfg.capture_layers == (1, 8, 14, 20, 27)
    H = whole.cfg.hidden_size
    blocks = wide.fc.weight.view(H, 7, H)
    assert not blocks[:, [1, 6]].any()
    assert torch.equal(blocks[:, [0, 2, 3, 4, 5]], whole.fc.weight.view(H, 5, H))
    for name, w in whole.state_dict().items():
        if name != "fc.weight":
            assert torch.equal(w, wide.state_dict()[name]), name
    feats = Trainer(runner, wide, lr=0.0, total_steps=1).capture(batch).feats
    with torch.no_grad():
        torch.testing.assert_close(wide.fuse(feats), whole.fuse(feats), rtol=1e-5, atol=1e-5)
        wide.fc.weight.view(H, 7, H)[:, 6].normal_(0, 0.02)  # negative control: the new layer read
        assert not torch.allclose(wide.fuse(feats), whole.fuse(feats), rtol=1e-3, atol=1e-3)

    # Fewer layers, fewer capture layers, or another shape, are refused.
    with pytest.raises(ValueError, match="only more layers"):
        train(parse(*common, "--out", str(tmp_path / "narrower"), "--init", os.path.join(wide_dir, "drafter")),
              runner, tok)
    with pytest.raises(ValueError, match="only more layers"):
        train(parse(*common, "--out", str(tmp_path / "shallower"), "--init", os.path.join(grown_dir, "drafter")),
              runner, tok)
    other = [*common[:common.index("--block-size")], "--block-size", "8", *common[common.index("--block-size") + 2:]]
    with pytest.raises(ValueError, match="differs"):
        train(parse(*other, "--out", str(tmp_path / "other"), "--init", os.path.join(straight, "drafter")), runner, tok)


def test_feature_cache_trains_the_drafter_trained_without_it(target, dataset, tmp_path, capsys):
    """--feature-cache: the run reads later passes' features back and ends with the drafter a run
    without it trains; --steps auto plans with the cost of a step read back; a bad size and soft
    labels are refused."""
    runner, tok = target
    common = ["--data", dataset[0].folder, "--max-seqs", "3", "--gen-max-new-tokens", str(NEW_TOKENS),
              "--shots", "2", "--sample-temperatures", "0.8,1.1", "--layers", "1", "--block-size", "4",
              "--anchors", "4", "--batch-size", "2", "--steps", "4", "--save-every", "100"]
    plain, cached = str(tmp_path / "plain"), str(tmp_path / "cached")
    assert train(parse(*common, "--out", plain), runner, tok) == 0
    capsys.readouterr()
    assert train(parse(*common, "--out", cached, "--feature-cache", "1"), runner, tok) == 0
    assert "feature cache: 0.0 GiB for" in capsys.readouterr().out
    info = json.load(open(os.path.join(cached, "train_info.json")))
    # 3 sequences in steps of 2 and 1: two epochs, each sequence captured once and read back once.
    assert info["feature_cache"]["sequences_captured"] == 3 and info["feature_cache"]["sequences_read_back"] == 3
    assert info["feature_cache"]["sequences_placed"] == 3
    assert "--feature-cache" not in info["command"]  # how fast, not what it trains
    # Split by --stop-at and resumed, the cache starts empty in the second process and says so.
    split = str(tmp_path / "split")
    assert train(parse(*common, "--out", split, "--feature-cache", "1", "--stop-at", "2"), runner, tok) == 0
    capsys.readouterr()
    assert train(parse(*common, "--out", split, "--feature-cache", "1", "--resume"), runner, tok) == 0
    assert "the feature cache starts empty" in capsys.readouterr().out
    want = Drafter.load(os.path.join(plain, "drafter")).state_dict()
    for out in (cached, split):
        for name, w in Drafter.load(os.path.join(out, "drafter")).state_dict().items():
            torch.testing.assert_close(w, want[name], rtol=1e-4, atol=1e-6)

    # --steps auto times a step read back (a third run of the probe's batches) and replays the
    # cache's places; the costs are then set to 100 s and 50 s a step, so that few steps fit.
    from common.tools.drafter import plan
    timed, walked = [], []
    real_cost, real_walk = plan.measure_cost, plan.steps_that_fit
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "WARM_STEPS", 1)
        mp.setattr(plan, "TIMED_STEPS", 2)
        mp.setattr(plan, "measure_cost", lambda probe, order: timed.append(real_cost(probe, order)) or
                   (StepCost(100.0, 0.0), StepCost(50.0, 0.0), timed[-1][2]))
        mp.setattr(plan, "steps_that_fit", lambda *a, **kw: walked.append(a) or real_walk(*a, **kw))
        at = common.index("--steps")
        auto = [*common[:at], "--steps", "auto", "--time-limit", "600", *common[at + 2:]]
        assert train(parse(*auto, "--out", str(tmp_path / "auto"), "--feature-cache", "1"), runner, tok) == 0
    assert timed[0][1].seconds(10) > 0  # timed with the cache reading back
    held, places = walked[0][7]
    assert held == StepCost(50.0, 0.0) and len(places.stored) == 3  # the probe captured every sequence
    info = json.load(open(os.path.join(tmp_path / "auto", "train_info.json")))
    # 600 s less what ran, 3 % and a checkpoint: 11 steps of 50 s (read back: the probe captured
    # every sequence), where steps of 100 s would fit 5.
    assert info["steps"]["planned"]["cached_step_fixed_s"] == 50.0 and info["steps"]["done"] == 11

    # Places go first to the sequences an epoch meets most: room for one, the one met twice.
    seqs = dataset[0].sequences(dataset[1])[:2]
    cfg = Drafter.load(os.path.join(plain, "drafter")).cfg
    per = FeatureCache.bytes_per_token(cfg.capture_layers, runner.cfg.hidden_size, runner.dtype)
    gib = (len(seqs[1].ids) + 0.5) * per / 2**30
    cache = feature_cache(parse("--feature-cache", repr(gib)), runner, cfg, EpochOrder(seqs + seqs[1:], 2, seed=0))
    assert set(cache.places.start) == {id(seqs[1])}
    # Among sequences met as often, the shortest first (here the second in data order): room for
    # the longer one holds the shorter one only.
    every = dataset[0].sequences(dataset[1])
    short, long = sorted([every[0], next(s for s in every if len(s.ids) != len(every[0].ids))], key=lambda s: len(s.ids))
    room = len(long.ids) * per / 2**30
    cache = feature_cache(parse("--feature-cache", repr(room)), runner, cfg, EpochOrder([long, short], 2, seed=0))
    assert set(cache.places.start) == {id(short)}
    assert feature_cache(parse("--feature-cache", "auto"), runner, cfg, EpochOrder(seqs, 2, seed=0)) is None  # CPU

    with pytest.raises(ValueError, match="--feature-cache: want GiB"):
        train(parse(*common, "--out", str(tmp_path / "bad"), "--feature-cache", "lots"), runner, tok)
    with pytest.raises(ValueError, match="soft labels"):
        train(parse(*common, "--out", str(tmp_path / "soft"), "--feature-cache", "1", "--soft-labels", "0.5"),
              runner, tok)


def test_one_command_trains_on_what_its_time_limited_generation_finished(target, dataset, tmp_path):
    """--stage all with --gen-time-limit: generation stops, training follows on what finished;
    --resume of that training generates nothing (more data would change its batches)."""
    import shutil

    runner, tok = target
    data = str(tmp_path / "data")
    shutil.copytree(dataset[0].folder, data)  # three prompts answered; --max-seqs 4 asks a fourth
    common = ["--data", data, "--max-seqs", "4", "--gen-max-new-tokens", str(NEW_TOKENS), "--shots", "2",
              "--sample-temperatures", "0.8,1.1", "--layers", "1", "--block-size", "4", "--anchors", "4",
              "--batch-size", "2", "--gen-time-limit", "0", "--save-every", "100", "--out", str(tmp_path / "run")]
    assert train(parse(*common, "--steps", "2"), runner, tok) == 0
    info = json.load(open(tmp_path / "run" / "train_info.json"))
    assert info["generation"]["stopped"] == "time limit" and info["generation"]["generated"] == 0
    assert info["data"]["sequences"] == 3 and info["steps"] == {"done": 2, "total": 2, "stopped": "done"}
    assert train(parse(*common, "--steps", "3", "--resume"), runner, tok) == 0
    info = json.load(open(tmp_path / "run" / "train_info.json"))
    assert info["generation"]["stopped"] == "not run (--stage all --resume)"
    assert info["data"]["sequences"] == 3 and info["steps"]["done"] == 3


def test_a_cut_generation_answers_the_held_out_prompts_first(target, tmp_path, monkeypatch):
    """The held-out check reads the greedy answers to the prompt file's last --eval-prompts, in
    the chat and few-shot formats: generation asks those before anything else (the problems the
    target writes included), so that one cut by --gen-time-limit still leaves the check answers
    to read (a cut H100 run left it none, 2026-12-06)."""
    from common.tools.drafter import data

    rows = [{"question": f"q{i}"} for i in range(10)]
    is_held = held_out(parse("--eval-prompts", "4"), rows)
    assert [i for i in range(10) if is_held("chat", i) and is_held("fewshot", i)] == [6, 7, 8, 9]
    assert not is_held("self-math", 9) and not held_out(parse("--eval-prompts", "0"), rows)("chat", 9)

    runner, tok = target
    stages = []
    real_run = data._run
    monkeypatch.setattr(data, "_run", lambda engine, tok, srcs, todo, *a: stages.append(
        [(job.source.name, job.i, job.k) for job in todo]) or real_run(engine, tok, srcs, todo, *a))
    assert train(parse("--stage", "data", "--eval-prompts", "1", "--max-seqs", "3", "--self-math", "1",
                       "--samples-per-prompt", "1", "--gen-max-new-tokens", str(NEW_TOKENS),
                       "--out", str(tmp_path / "run")), runner, tok) == 0
    assert stages[0] == [("chat", 2, 0)] and stages[1] == [("self-math-q", 0, 1)]
    assert ("chat", 2, 0) not in stages[2] and ("chat", 2, 1) in stages[2] and len(stages) == 3


def test_steps_auto_fills_the_time_limit_and_leaves_the_run_as_planned(target, dataset, tmp_path, monkeypatch):
    """--steps auto: steps timed on a copy of the drafter (here with a fitted cost of 100 s a
    step), as many as fit in --time-limit; the run then equals one given that many steps, a
    --resume keeps the plan, and a limit without room for a step is refused."""
    from common.tools.drafter import plan

    runner, tok = target
    monkeypatch.setattr(plan, "WARM_STEPS", 1)
    monkeypatch.setattr(plan, "TIMED_STEPS", 2)
    timed = []
    real_cost = plan.measure_cost
    monkeypatch.setattr(plan, "measure_cost",
                        lambda probe, order: timed.append((*real_cost(probe, order), order)) or (StepCost(100.0, 0.0), None, set()))
    common = ["--data", dataset[0].folder, "--max-seqs", "3", "--gen-max-new-tokens", str(NEW_TOKENS), "--shots", "2",
              "--sample-temperatures", "0.8,1.1", "--layers", "1", "--block-size", "4", "--anchors", "4",
              "--batch-size", "2", "--log-every", "1", "--save-every", "100"]
    auto, fixed, split = (str(tmp_path / name) for name in ("auto", "fixed", "split"))
    # 600 s less what has run, less 3 %, less a checkpoint: more than 500 s, less than 600 s.
    assert train(parse(*common, "--steps", "auto", "--time-limit", "600", "--out", auto), runner, tok) == 0
    info = json.load(open(os.path.join(auto, "train_info.json")))
    assert info["steps"]["done"] == info["steps"]["total"] == 5 and info["steps"]["stopped"] == "done"
    assert info["steps"]["planned"]["step_fixed_s"] == 100.0 and "--steps 5" in info["command"]
    cost, held, seen, order = timed[0]  # the probe's steps were timed; the shapes it ran are its three batches'
    assert len(timed) == 1 and cost.seconds(10) > 0 and cost.new_shape >= 0 and held is None  # no feature cache
    assert seen == {plan.shape_of(order.batch(i)) for i in range(3)}
    assert train(parse(*common, "--steps", "5", "--out", fixed), runner, tok) == 0
    planned_w = Drafter.load(os.path.join(auto, "drafter")).state_dict()
    for name, w in Drafter.load(os.path.join(fixed, "drafter")).state_dict().items():
        assert torch.equal(w, planned_w[name]), name  # the timed copy left the run's drafter as it was

    assert train(parse(*common, "--steps", "auto", "--time-limit", "600", "--stop-at", "2", "--out", split),
                 runner, tok) == 0
    assert train(parse(*common, "--steps", "auto", "--time-limit", "600", "--resume", "--out", split),
                 runner, tok) == 0
    info = json.load(open(os.path.join(split, "train_info.json")))
    assert info["steps"] == {"done": 5, "total": 5, "stopped": "done"} and len(timed) == 2  # not planned again
    # --stop-after ends a call (here before its first step) and leaves the plan for --time-limit.
    cut = str(tmp_path / "cut")
    assert train(parse(*common, "--steps", "auto", "--time-limit", "600", "--stop-after", "0", "--out", cut),
                 runner, tok) == 0
    info = json.load(open(os.path.join(cut, "train_info.json")))
    assert info["steps"]["done"] == 0 and info["steps"]["total"] == 5 and info["steps"]["stopped"] == "--stop-after"
    assert train(parse(*common, "--steps", "auto", "--time-limit", "600", "--resume", "--out", cut), runner, tok) == 0
    for name, w in Drafter.load(os.path.join(cut, "drafter")).state_dict().items():
        assert torch.equal(w, planned_w[name]), name

    with pytest.raises(ValueError, match="not one step fits"):
        train(parse(*common, "--steps", "auto", "--time-limit", "90", "--out", str(tmp_path / "short")), runner, tok)
    with pytest.raises(ValueError, match="plans the steps that fit in --time-limit"):
        train(parse(*common, "--steps", "auto", "--out", str(tmp_path / "none")), runner, tok)


def test_replan_goes_on_from_the_learning_rate_it_has(target, tmp_path):
    """Trainer.replan: the learning rate has no jump where the total changes, falls from there and
    reaches its floor at the new total, longer or shorter, and a checkpoint keeps the schedule;
    the points where a run re-plans, and the total its pace gives."""
    from common.tools.drafter.trainer import load_checkpoint, save_checkpoint

    runner, _ = target
    drafter = Drafter(drafter_config(parse("--layers", "1", "--block-size", "4"), runner))
    make = lambda total: Trainer(runner, drafter, lr=1.0, total_steps=total, warmup=0.1, min_lr_ratio=0.1)  # noqa: E731
    trainer = make(100)  # 10 warmup steps
    before = [trainer.lr_at(s) for s in range(101)]
    trainer.replan(30, 200)
    assert trainer.lr_at(30) == pytest.approx(before[30]) and trainer.lr_at(5) == before[5]  # no jump; warmup as was
    after = [trainer.lr_at(s) for s in range(30, 201)]
    assert all(a > b for a, b in zip(after, after[1:])) and after[-1] == pytest.approx(0.1)
    assert trainer.lr_at(100) > before[100] + 0.3  # the old total's end is about mid-way now
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint(path, trainer, 40, 1.0)
    resumed = make(200)  # as `dflash train --resume` makes it: with the checkpoint's total (and 20 warmup steps)
    assert load_checkpoint(path, resumed, drafter.cfg, 200) == (40, 1.0)
    assert [resumed.lr_at(s) for s in range(0, 201, 5)] == [trainer.lr_at(s) for s in range(0, 201, 5)]
    assert (resumed.first_total, resumed.replans) == (100, [(30, 200)])
    at_60 = trainer.lr_at(60)
    trainer.replan(60, 120)  # shorter
    assert trainer.lr_at(60) == pytest.approx(at_60) and trainer.lr_at(120) == pytest.approx(0.1)
    assert trainer.lr_at(90) < at_60

    early = make(100)
    early.replan(5, 300)  # in the warmup: only the total changes
    assert early.lr_at(5) == before[5] and early.lr_at(10) == 1.0 and early.lr_at(300) == pytest.approx(0.1)

    assert replan_points(1000) == [150, 300, 600] and replan_points(300) == []  # 45 steps to 15%: too few
    assert replanned_total(300, 100.0, 0.1) == 300 + 970 and replanned_total(10, 0.0, 1.0) == 11
    assert parse_replans("900:7000,1800:7400") == [(900, 7000), (1800, 7400)] and parse_replans(None) == []
    assert format_replans([(900, 7000), (1800, 7400)]) == "900:7000,1800:7400"
    for bad in ("900", "900:800", "1800:7400,900:7000", "a:b"):
        with pytest.raises(ValueError, match="--replans"):
            parse_replans(bad)


def test_steps_auto_re_plans_from_the_runs_own_pace(target, dataset, tmp_path, monkeypatch):
    """A plan from a probe that says a step takes 1 s, where the run's steps take 0.75 s: the run
    takes its own pace and re-plans at its points, to more steps, in the same --time-limit; its
    command, with --replans, trains the same drafter. The clock is the test's (it moves 0.75 s a
    step and stands still otherwise), so that the plan does not depend on this machine's speed."""
    import types

    import common.tools.drafter.train as train_command
    from common.tools.drafter import plan

    runner, tok = target
    now = [1000.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(train_command, "time", clock)
    monkeypatch.setattr(plan, "time", clock)
    step = Trainer.step

    def timed_step(self, batch, i):
        now[0] += 0.75
        return step(self, batch, i)

    monkeypatch.setattr(Trainer, "step", timed_step)
    monkeypatch.setattr(plan, "measure_cost", lambda probe, order: (StepCost(1.0, 0.0), None, set()))
    monkeypatch.setattr(plan, "REPLAN_POINTS", (0.25, 0.5, 0.75))
    monkeypatch.setattr(plan, "REPLAN_MIN_STEPS", 1)
    common = ["--data", dataset[0].folder, "--max-seqs", "3", "--gen-max-new-tokens", str(NEW_TOKENS), "--shots", "2",
              "--sample-temperatures", "0.8,1.1", "--layers", "1", "--block-size", "4", "--anchors", "4",
              "--batch-size", "2", "--warmup", "1", "--save-every", "1000"]
    out, again = str(tmp_path / "auto"), str(tmp_path / "again")
    assert train(parse(*common, "--steps", "auto", "--time-limit", "9", "--out", out), runner, tok) == 0
    info = json.load(open(os.path.join(out, "train_info.json")))
    planned = info["steps"]["planned"]
    replans = planned["replans"]
    assert [r["step"] for r in replans] == replan_points(planned["steps"])[1:]
    assert [r["ms_per_step"] for r in replans] == [750.0] * len(replans)
    assert replans[0]["total"] > planned["steps"] and info["steps"]["total"] == replans[-1]["total"]
    given = format_replans([(r["step"], r["total"]) for r in replans])
    assert f"--steps {planned['steps']} --replans {given}" in info["command"]
    # The same schedule to the step the run reached (the last may not fit the time on a busy machine).
    assert train(parse(*common, "--steps", str(planned["steps"]), "--replans", given,
                       "--stop-at", str(info["steps"]["done"]), "--out", again), runner, tok) == 0
    want = Drafter.load(os.path.join(out, "drafter")).state_dict()
    for name, w in Drafter.load(os.path.join(again, "drafter")).state_dict().items():
        assert torch.equal(w, want[name]), name
    with pytest.raises(ValueError, match="--replans re-plans a schedule of --steps N"):
        train(parse(*common, "--steps", "auto", "--time-limit", "9", "--replans", given, "--out", again), runner, tok)


def test_eval_command(target, tmp_path, monkeypatch):
    """`pdflash dflash eval` through the CLI on the users' few-shot format (stop strings) and then
    GSM8K chat on the same engines, the shipped drafter in both dtypes (--draft-dtype fp32,bf16),
    each as saved and with two refine passes (--refine), against plain decoding: identical
    outputs, accept lengths. One plain engine and one per drafter, built with no product's kernel
    timed (gemv.kept_only)."""
    from common.tools.cli import main
    from common.tools.drafter import evaluate

    timing = engines_record_timing(evaluate, monkeypatch)

    out = str(tmp_path / "eval")
    # One exemplar: the format and its stop strings are what is tested, not five exemplars' prefill.
    assert main(["dflash", "eval", "--device", "cpu", "--sets", "fewshot,gsm8k", "--shots", "1", "--num", "2",
                 "--max-new-tokens", "10", "--concurrency", "2", "--page-size", "16", "--draft-dtype", "fp32,bf16",
                 "--refine", "saved,2@0.4", "--out", out]) == 0
    result = json.load(open(os.path.join(out, "eval.json")))
    assert [(row["draft_dtype"], row["refine_passes"]) for row in result["drafters"]] == [
        ("float32", 0), ("float32", 2), ("bfloat16", 0), ("bfloat16", 2)]
    for row in result["drafters"]:
        for r in (row["sets"]["fewshot"], row["sets"]["gsm8k"]):
            assert r["prompts"] == 2 and r["identical"] == 2 and r["verify_steps"] > 0
            assert sum(r["accept_histogram"]) == r["verify_steps"] and r["accept_length_weighted"] >= 1.0
    assert timing == [False] * (1 + 4)


def test_profile_command(tmp_path, capsys):
    """`pdflash dflash profile` on the tiny random shape: a row per case whose parts add up to
    about a step, and a clear error for a malformed case."""
    from common.tools.cli import main

    out = str(tmp_path / "profile.json")
    assert main(["dflash", "profile", "--shape", "tiny", "--device", "cpu", "--cases", "2x4x40x10",
                 "--steps", "1", "--layers", "1", "--feature-cache", "--read-back-shares", "1,0.5", "--out", out]) == 0
    (row,) = json.load(open(out))["cases"]
    assert (row["sequences"], row["anchors"], row["length"], row["prompt"]) == (2, 4, 40, 10)
    # The step as it captures, with its features read back, and with one of its two read back.
    assert [r["share"] for r in row["read_back"]] == [1.0, 0.5]
    assert "2/2 read back" in capsys.readouterr().out
    for r in (row, *row["read_back"]):
        assert r["seq_per_s"] > 0 and min(r[k] for k in ("capture_ms", "forward_ms", "backward_ms")) > 0
    assert main(["dflash", "profile", "--shape", "tiny", "--device", "cpu", "--cases", "2x4x40", "--out", out]) == 2
    assert "SEQSxANCHORSxLxP" in capsys.readouterr().err
    assert main(["dflash", "profile", "--shape", "tiny", "--device", "cpu", "--cases", "2x4x40x10",
                 "--feature-cache", "--read-back-shares", "0", "--out", out]) == 2
    assert "--read-back-shares '0'" in capsys.readouterr().err


def test_average_command(tmp_path, capsys):
    """`pdflash dflash average`: the saved drafter holds the weighted mean of its sources' weights,
    in the dtype asked (bf16 for this shape by default, as dflash train saves), the first one's
    config (refine settings included) and its sources' hashes; drafters of another shape, weights
    that are not finite or do not sum to 1, one drafter, or an --out among the sources are refused
    with a clear error and nothing written."""
    from safetensors.torch import load_file

    from common.dflash.drafter import DrafterConfig
    from common.model.shapes import SHAPES
    from common.tools.cli import main

    cfg = DrafterConfig.for_target(SHAPES["tiny"], num_layers=1)
    folders = []
    for seed, passes in ((1, 0), (2, 2)):  # the second drafts with refine passes: the first's setting wins
        torch.manual_seed(seed)
        Drafter(dataclasses.replace(cfg, refine_passes=passes)).save(str(tmp_path / f"d{seed}"))
        folders.append(str(tmp_path / f"d{seed}"))
    out = str(tmp_path / "mean")
    assert main(["dflash", "average", *folders, "--weights", "0.25,0.75", "--save-dtype", "fp32", "--out", out]) == 0
    a, b, mean = (Drafter.load(f) for f in (*folders, out))
    assert mean.cfg == cfg
    for name, w in mean.state_dict().items():
        assert torch.allclose(w, 0.25 * a.state_dict()[name] + 0.75 * b.state_dict()[name], atol=1e-6), name
    assert not torch.equal(mean.fc.weight, a.fc.weight)  # the sources differ: the test can fail
    with open(os.path.join(out, "average_info.json")) as f:
        info = json.load(f)
    assert [(s["weight"], s["model_sha256"]) for s in info["sources"]] == [
        (w, file_sha256(os.path.join(folder, "model.safetensors"))) for w, folder in zip((0.25, 0.75), folders)]
    big = DrafterConfig.for_target(SHAPES["embedded"], num_layers=3)  # 49 MB in fp32: over the 40 MB
    for n in (1, 2):
        torch.manual_seed(n)
        Drafter(big).save(str(tmp_path / f"big{n}"))
    assert main(["dflash", "average", str(tmp_path / "big1"), str(tmp_path / "big2"), "--out",
                 str(tmp_path / "big-mean")]) == 0
    assert {t.dtype for t in load_file(str(tmp_path / "big-mean" / "model.safetensors")).values()} == {torch.bfloat16}

    Drafter(dataclasses.replace(cfg, num_layers=2)).save(str(tmp_path / "deeper"))
    for argv, message in (([folders[0], str(tmp_path / "deeper")], "only drafters of one shape"),
                          ([*folders, "--weights", "0.5,0.6"], "summing to 1"),
                          ([*folders, "--weights", "nan,nan"], "summing to 1"),
                          ([folders[0]], "at least two drafters")):
        bad = str(tmp_path / "bad")
        assert main(["dflash", "average", *argv, "--out", bad]) == 2
        assert message in capsys.readouterr().err and not os.path.exists(bad)
    before = file_sha256(os.path.join(folders[0], "model.safetensors"))
    assert main(["dflash", "average", *folders, "--out", folders[0]]) == 2
    assert "one of the drafters" in capsys.readouterr().err
    assert file_sha256(os.path.join(folders[0], "model.safetensors")) == before


def test_eval_prompts_are_the_benchmarks():
    """The few-shot set is what `pdflash bench gsm8k` sends: the first exemplars, then the question."""
    class Chars:  # a tokenizer of characters: the prompt text is visible in the ids
        eos_token_ids = ()

        def encode(self, text):
            return [ord(c) for c in text]

        def apply_chat_template(self, messages):
            return self.encode(messages[0]["content"])

    tests = gsm8k_data.load(gsm8k_data.DEFAULT_TEST)
    shots = gsm8k_data.load(gsm8k_data.DEFAULT_TRAIN)[:5]
    (ids, stop), = eval_prompts(Chars(), "fewshot", 1, offset=3)
    assert "".join(map(chr, ids)) == gsm8k_data.few_shot_prompt(shots, tests[3]) and stop == tuple(gsm8k_data.STOP)
    assert len(eval_prompts(Chars(), "chat", 64)) == 16
    with pytest.raises(ValueError, match="unknown evaluation set"):
        eval_prompts(Chars(), "poetry", 1)


def ckpt_weights(out: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["model"]
