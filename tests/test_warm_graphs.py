"""Every greedy decode step a speculating engine takes was captured at start-up
(common/engine/warm_graphs.py). Nothing is captured on a CPU, so here a graph cache that runs its
steps eagerly records the keys captured by the warm-up and those the steps then ask for, while a
tiny random model decodes requests that leave the batch at different steps, with every kind of
step (plain, blocks of 4 and 8) in turn."""
from __future__ import annotations

import itertools
import uuid

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.decoder import DRAFT_AHEAD, FROM_AHEAD, NO_AHEAD
from common.engine.spec_policy import SpecConfig, StepCosts
from common.engine.warm_graphs import steps, warm_graphs
from common.runner.model_runner import ModelRunner
from tiny_models import random_model, speculating_engine


class RecordingGraphs:
    """GraphCache's interface, enabled, running every step eagerly; records captures."""

    enabled = True

    def __init__(self) -> None:
        self.keys: set = set()
        self.asked: set = set()  # every key a step ran
        self.captures = 0

    def __contains__(self, key) -> bool:
        return key in self.keys

    def clear(self) -> None:
        self.keys.clear()

    def capture(self, key, fn) -> None:
        fn()
        self.keys.add(key)
        self.captures += 1

    def run(self, key, fn):
        self.asked.add(key)
        if key not in self.keys:
            self.capture(key, fn)
        return fn()


def decode_after(warm: bool, tmp_path, ahead_rows: int | None = None, **engine_args) -> tuple[set, set, int, set]:
    """(keys the warm-up captured, keys captured while decoding, captures while decoding, keys
    decoding ran). Six requests, more than the
    largest batch size (4): their pending rows were reserved at start-up too, or the decoder
    would take a larger buffer, and capture every graph again, when the fifth arrives."""
    engine = speculating_engine(str(tmp_path / "drafter"), block_size=8, **({"batch_sizes": (1, 2, 4)} | engine_args))
    decoder = engine.decoder
    decoder.graphs = RecordingGraphs()
    if ahead_rows is not None:
        decoder.ahead_rows = ahead_rows
    if warm:
        warm_graphs(decoder, engine.policy.blocks)
    warmed, captured = set(decoder.graphs.keys), decoder.graphs.captures
    decoder.graphs.asked.clear()
    # Blocks that change; a speculative step after 5 plain ones (whose pending tokens are more
    # than its block); 17 plain steps in a row (a full pending buffer, caught up by a plain step).
    choices = itertools.cycle([0, 4, 0, 0, 8, 4, 8] + [0] * 5 + [4] + [0] * 17)
    engine.policy.choose = lambda reqs: next(choices)
    reqs = [Request(uuid.uuid4().hex, list(range(1, 20 + 7 * i)), SamplingParams(max_new_tokens=12 + 9 * i, ignore_eos=True))
            for i in range(6)]
    engine.run_all(reqs)
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    return warmed, decoder.graphs.keys - warmed, decoder.graphs.captures - captured, decoder.graphs.asked


def test_decoding_captures_nothing_after_the_warm_up(tmp_path):
    warmed, _, later, _ = decode_after(True, tmp_path)
    assert len(warmed) == 3 * 6 and later == 0  # batch sizes 1, 2, 4 x (0, 0) (0, 16) (4, 4) (4, 16) (8, 8) (8, 16)


def test_the_warm_up_stops_at_the_batch_size_the_engine_s_requests_pad_to(tmp_path):
    """At most 3 requests at a time run in graphs of 4 rows: the warm-up captures no graph of 8."""
    warmed, _, later, _ = decode_after(True, tmp_path, batch_sizes=(1, 2, 4, 8), max_running=3)
    assert {rows for rows, *_ in warmed} == {1, 2, 4} and later == 0


def test_without_the_warm_up_decoding_captures_the_catch_ups_too(tmp_path):
    """The negative control: the same steps capture as they go, among them those that catch up a
    whole pending buffer."""
    later = decode_after(False, tmp_path)[1]
    assert {(0, 16), (4, 16)} <= {(block, catch_up) for _, block, _, catch_up, _ in later}, later


def test_draft_ahead_steps_are_captured_at_the_warm_up_too(tmp_path):
    """With draft-ahead every block drafts ahead, first drafting or verifying the drafts kept
    ahead; decoding with every kind of step in turn then captures nothing either."""
    warmed, _, later, ran = decode_after(True, tmp_path, ahead_rows=4, spec=SpecConfig(ahead=True))
    assert {ahead for *_, ahead in ran} == {NO_AHEAD, DRAFT_AHEAD, FROM_AHEAD} and later == 0  # each kind ran
    # Each batch size: (0, 0) (0, 16), and 4 and 8 each drafting ahead (after a catch-up of the
    # block or of the whole buffer) and verifying drafts kept ahead.
    assert len(warmed) == 3 * 8


def test_blocks_only_confidence_chooses_are_measured_and_captured_where_steps_draft_ahead(tmp_path):
    """Where steps draft ahead (single requests), the blocks only a choice by confidence takes (5,
    6 and 7 for a drafter of 8) are measured at start-up and captured verifying drafts kept ahead,
    and nowhere else; the policy itself, with costs that favour them, then takes them while
    requests join and leave and steps run in chunks, and decoding captures nothing more."""
    engine = speculating_engine(str(tmp_path / "drafter"), block_size=8, batch_sizes=(1, 2), max_running=3,
                                spec=SpecConfig(ahead=True))
    decoder, policy = engine.decoder, engine.policy
    assert policy.confident_only == [5, 6, 7]
    measured = {(rows, block) for rows, block in policy.costs.base if block in (5, 6, 7)}
    assert measured == {(1, 5), (1, 6), (1, 7)} and {5, 6, 7} <= set(policy.costs.slope)
    decoder.graphs = RecordingGraphs()
    warm_graphs(decoder, policy.blocks, policy.confident_only)
    extra = {key for key in decoder.graphs.keys if key[1] in (5, 6, 7)}
    assert {(rows, block, catch_up, ahead) for rows, block, _, catch_up, ahead in extra} == \
        {(1, b, 0, FROM_AHEAD) for b in (5, 6, 7)}
    warmed = set(decoder.graphs.keys)
    decoder.graphs.asked.clear()
    policy.timed_steps = False
    policy.costs = StepCosts(128, {(1, 0): 1.0, (1, 4): 1.5, (1, 5): 0.5, (1, 6): 0.5, (1, 7): 0.5, (1, 8): 1.9,
                                   (2, 0): 1.2, (2, 4): 1.8, (2, 8): 2.2}, padded=True)
    reqs = [Request(uuid.uuid4().hex, list(range(1, 20 + 7 * i)), SamplingParams(max_new_tokens=20 + 9 * i, ignore_eos=True))
            for i in range(6)]
    engine.run_all(reqs, 3)
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    assert decoder.graphs.keys == warmed
    asked = {(rows, block) for rows, block, *_ in decoder.graphs.asked}
    assert {block for _, block in asked} & {5, 6, 7} and {rows for rows, _ in asked} == {1, 2}


def test_by_default_only_single_requests_draft_ahead(tmp_path):
    warmed = decode_after(True, tmp_path, spec=SpecConfig(ahead=True))[0]
    assert len(warmed) == 8 + 2 * 6 and {rows for rows, *_, ahead in warmed if ahead} == {1}


def test_the_steps_of_each_kind_of_engine(tmp_path):
    cfg, tensors = random_model(num_layers=2)
    runner = ModelRunner(cfg, tensors, num_pages=64, page_size=16)
    assert steps(Engine(runner, ()).decoder, []) == [(0, 0, NO_AHEAD)]
