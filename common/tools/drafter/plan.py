"""`dflash train --steps auto`: how many steps fit in the rest of --time-limit.

The learning rate follows a cosine over the run's steps, so a run cut by its time limit stops
before the schedule anneals, and one planned too short leaves time unused. Here a copy of the
drafter trains on the run's first batches, timed; a step's time is fitted as a + b x (the
batch's padded tokens: a few-shot batch costs about twice a chat one), and the run's own batch
order is walked until its predicted time, with the held-out checks and checkpoints every
--save-every steps, fills the time left.

A batch shape the process has not run yet costs more than the same shape again (on CUDA, likely
the attention kernel's plan per shape and allocations that grow; not timed apart), and nearly
every probe batch is a new shape: on an H100 a plan from such steps alone came to about half the
steps that fitted. So each
probe batch runs twice: the second runs give the step's cost, the difference the extra of a new
shape, which the walk adds once per shape it has not met (make_batch pads lengths to a multiple
of PAD_MULTIPLE, so that shapes repeat).

With a feature cache, a step whose sequences the cache holds skips the target's pass. The probe
then times each batch twice more with the cache reading back what it stored (each batch's placed
share: the rest is captured, as in the second run, and taken out): the second of these gives
the cost read back, their difference the extra of a partial capture's new shape (its rows,
rounded as feature_cache.capture_rows does, and their padded length). The walk replays the
cache's places (feature_cache.Places), charging each step the cost read back plus its share of
sequences still to capture times the difference, and that extra once per new capture shape.

The plan is a start: the run takes its own pace from 15% to 30% of the planned steps and from
30% to 60%, and at the end of each re-plans its total (replan_points, replanned_total), its
learning rate going on from where it is (Trainer.replan).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from common.tools.drafter.data import Sequence
from common.tools.drafter.feature_cache import Places, capture_shape
from common.tools.drafter.objective import Batch, make_batch, padded_length
from common.tools.drafter.trainer import EpochOrder, Trainer, save_checkpoint

TIMED_STEPS = 16  # batches timed twice each (four times with a feature cache), after WARM_STEPS untimed ones
WARM_STEPS = 3  # the first allocations and kernel choices
MARGIN = 0.03  # of the time left: the fit is an estimate
# The run itself re-plans at these shares of the planned steps, from its own pace since the
# point before (checkpoints and held-out checks included): a probe of 16 batches missed by a
# third on an H100 (2026-12-07, the feature cache's first run), and a run's pace changes as
# batch shapes and cached features come. Only where each stretch is at least REPLAN_MIN_STEPS.
REPLAN_POINTS = (0.15, 0.3, 0.6)
REPLAN_MIN_STEPS = 50


Shape = tuple[int, int]  # a batch's (sequences, padded length)


@dataclass
class StepCost:
    """Predicted seconds of a training step: fixed + per_token x the batch's padded tokens, and
    new_shape more the first time the process runs its shape."""

    fixed: float
    per_token: float
    new_shape: float = 0.0

    def seconds(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


def fit_cost(samples: list[tuple[int, float]]) -> StepCost:
    """Least squares over (padded tokens, seconds), without the steps over 3x the median (a
    compile or another stall would skew every planned step); through the origin where the fit
    gives a negative fixed part, the mean step where the sizes do not vary."""
    secs = np.array([t for _, t in samples], dtype=np.float64)
    keep = secs <= 3 * np.median(secs)
    tokens, secs = np.array([n for n, _ in samples], dtype=np.float64)[keep], secs[keep]
    if np.ptp(tokens) > 0:
        slope, fixed = np.polyfit(tokens, secs, 1)
        if slope >= 0 and fixed >= 0:
            return StepCost(float(fixed), float(slope))
        if slope >= 0:
            return StepCost(0.0, float((tokens * secs).sum() / (tokens * tokens).sum()))
    return StepCost(float(secs.mean()), 0.0)


def new_shape_cost(first: list[float], again: list[float]) -> float:
    """The median extra seconds of a batch's first step over the same batch's next (at least 0:
    on a CPU there is none, and noise is not a saving)."""
    return max(0.0, float(np.median(np.subtract(first, again))))


def shape_of(seqs: list[Sequence]) -> Shape:
    return len(seqs), padded_length(max(len(s.ids) for s in seqs))


def padded_tokens(seqs: list[Sequence]) -> int:
    n, length = shape_of(seqs)
    return n * length


def capture_key(seqs: list[Sequence], size: int) -> tuple[str, int, int]:
    """The key of the shape that capturing these sequences out of a batch of `size` runs, apart
    from batch shapes (a batch shape also runs the drafter)."""
    return ("capture", *capture_shape([len(s.ids) for s in seqs], size))


def steps_that_fit(order: EpochOrder, cost: StepCost, seconds: float, save_every: int, save_s: float,
                   snapshot_every: int | None = None, seen: set[Shape] = frozenset(),
                   cached: tuple[StepCost, Places] | None = None) -> int:
    """The most steps of `order` whose predicted time, with save_s after every save_every-th
    step (a checkpoint and the held-out check) and every snapshot_every-th (a snapshot), and
    cost.new_shape for each batch shape not in `seen` (those the process ran already) the first
    time it comes, stays within `seconds`. cached: the step's cost when a feature cache holds
    every sequence (its new_shape: the extra of a partial capture's shape the first time), and
    (a copy of) that cache's places as the run starts; `seen` holds capture shapes too, as
    ("capture", rows, length)."""
    if cost.seconds(1) <= 0:
        raise ValueError(f"--steps auto: a step timed at {cost.seconds(1)} s")
    used, step, seen = 0.0, 0, set(seen)
    while True:
        seqs = order.batch(step)
        tokens = padded_tokens(seqs)
        if cached is None:
            used += cost.seconds(tokens)
        else:
            held, places = cached
            new = [s for s in seqs if id(s) not in places.stored]
            places.store(id(s) for s in new)
            used += held.seconds(tokens) + len(new) / len(seqs) * (cost.seconds(tokens) - held.seconds(tokens))
            if 0 < len(new) < len(seqs):  # a whole batch captures in its own shape, counted below
                captured = capture_key(new, len(seqs))
                if captured not in seen:
                    seen.add(captured)
                    used += held.new_shape
        if shape_of(seqs) not in seen:
            seen.add(shape_of(seqs))
            used += cost.new_shape
        for every in (save_every, snapshot_every):
            if every and (step + 1) % every == 0:
                used += save_s
        if used > seconds:
            return step
        step += 1


def replan_points(total: int) -> list[int]:
    """The steps where a run planned for `total` steps takes its pace (the first) and re-plans
    (the others); none where a stretch between them would be shorter than REPLAN_MIN_STEPS."""
    points = [round(share * total) for share in REPLAN_POINTS]
    stretches = [b - a for a, b in zip([0, *points], points)]
    return points if min(stretches) >= REPLAN_MIN_STEPS else []


def replanned_total(step: int, seconds_left: float, pace: float) -> int:
    """The steps a run at `step` makes in total at `pace` seconds a step in the time left (less
    MARGIN), at least one more."""
    return step + max(1, int(seconds_left * (1 - MARGIN) / pace))


def time_steps(trainer: Trainer, order: EpochOrder, steps: range) -> list[tuple[int, float]]:
    """(padded tokens, seconds) of these steps of `order`, each making its batch as the training
    loop does."""
    out = []
    for i in steps:
        trainer.synchronize()
        t = time.perf_counter()
        seqs = order.batch(i)
        trainer.step(make_batch(seqs, trainer.device), i)
        trainer.synchronize()
        out.append((padded_tokens(seqs), time.perf_counter() - t))
    return out


def read_back_cost(read: list[tuple[int, float]], captured: list[float], shares: list[float],
                   least: float = 0.25) -> StepCost | None:
    """The cost of a step whose every sequence is read back, from steps that read back a share s
    of theirs (the time t = s x read back + (1 - s) x captured, `captured` timed on the same
    batch); only steps with s >= least (below it the noise of both times dominates). None if no
    step reads that much back: the plan then counts every step as captured."""
    samples = [(n, (t - (1 - s) * c) / s) for (n, t), c, s in zip(read, captured, shares) if s >= least]
    return fit_cost(samples) if samples else None


def measure_cost(trainer: Trainer, order: EpochOrder) -> tuple[StepCost, StepCost | None, set[Shape]]:
    """A step's cost on `trainer` (a copy: it trains on the first batches of `order`), from
    TIMED_STEPS batches after WARM_STEPS untimed ones, each run twice, the second time
    capturing again; with a feature cache, the cost when it reads every sequence back (a third
    run, then a fourth for the cost, the third's extra as its new_shape; None where too few of
    the probe's sequences have a place); and the shapes it ran, batches' and partial captures'
    (the process has met them: the run's steps of those shapes cost no new shape's extra)."""
    ran = range(WARM_STEPS + TIMED_STEPS)
    time_steps(trainer, order, ran[:WARM_STEPS])
    first = time_steps(trainer, order, ran[WARM_STEPS:])
    cache, trainer.cache = trainer.cache, None
    try:
        again = time_steps(trainer, order, ran[WARM_STEPS:])
    finally:
        trainer.cache = cache
    held, seen = None, {shape_of(order.batch(i)) for i in ran}
    if cache is not None:
        batches = [order.batch(i) for i in ran[WARM_STEPS:]]
        missing = [[s for s in seqs if id(s) not in cache.places.stored] for seqs in batches]
        shares = [1 - len(m) / len(seqs) for m, seqs in zip(missing, batches)]
        read_first = time_steps(trainer, order, ran[WARM_STEPS:])
        read = time_steps(trainer, order, ran[WARM_STEPS:])
        held = read_back_cost(read, [t for _, t in again], shares)
        # The extra of a capture shape's first run, from the batches that ran one first (a shape
        # met again in the probe, or a whole batch's, costs about nothing more the first time).
        first_runs = []
        for i, m in enumerate(missing):
            key = capture_key(m, len(batches[i])) if 0 < len(m) < len(batches[i]) else None
            if key is not None and key not in seen:
                seen.add(key)
                first_runs.append(i)
        if held is not None and first_runs:
            extra = new_shape_cost([read_first[i][1] for i in first_runs], [read[i][1] for i in first_runs])
            held = replace(held, new_shape=extra)
    cost = replace(fit_cost(again), new_shape=new_shape_cost([t for _, t in first], [t for _, t in again]))
    return cost, held, seen


def plan_steps(probe: Trainer, order: EpochOrder, eval_batches: list[Batch], seconds_left: Callable[[], float],
               save_every: int, snapshot_every: int | None, folder: str) -> tuple[int, dict]:
    """Steps for a run of `order`, timed on `probe` (a trainer like the run's, on a copy of its
    drafter: it trains on the first batches), and what the plan read. seconds_left(): the
    seconds --time-limit still leaves; folder: where the run writes its checkpoints."""
    cost, held, seen = measure_cost(probe, order)
    t = time.perf_counter()
    if eval_batches:
        probe.evaluate(eval_batches)
    path = os.path.join(folder, "checkpoint.plan.pt")  # timed where the run's go: disks differ
    save_checkpoint(path, probe, 0, 0.0)
    os.remove(path)
    save_s = time.perf_counter() - t  # a checkpoint with its held-out check; the run ends with one too
    budget = seconds_left() * (1 - MARGIN) - save_s
    if budget <= 0:
        raise ValueError(f"--steps auto: --time-limit leaves no time to train ({seconds_left():.0f} s left)")
    cached = (held, probe.cache.places.copy()) if held is not None else None
    total = steps_that_fit(order, cost, budget, save_every, save_s, snapshot_every, seen, cached)
    if total < 1:
        raise ValueError(f"--steps auto: not one step fits in the {budget:.1f} s that --time-limit leaves")
    plan = {"steps": total, "timed_steps": TIMED_STEPS, "step_fixed_s": round(cost.fixed, 5),
            "step_per_token_us": round(cost.per_token * 1e6, 5), "new_shape_s": round(cost.new_shape, 5),
            "save_and_check_s": round(save_s, 3), "seconds_planned": round(budget, 1)}
    if held is not None:
        plan |= {"cached_step_fixed_s": round(held.fixed, 5),
                 "cached_step_per_token_us": round(held.per_token * 1e6, 5),
                 "cached_new_capture_shape_s": round(held.new_shape, 5)}
    return total, plan
