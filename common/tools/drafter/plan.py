"""`dflash train --steps auto`: how many steps fit in the rest of --time-limit.

The learning rate follows a cosine over the run's steps, so a run cut by its time limit stops
before the schedule anneals, and one planned too short leaves time unused. Here a copy of the
drafter trains on the run's first batches, timed; a step's time is fitted as a + b x (the
batch's padded tokens: a few-shot batch costs about twice a chat one), and the run's own batch
order is walked until its predicted time, with the held-out checks and checkpoints every
--save-every steps, fills the time left.

Each fitted step is timed alone (the device's queue drained before and after it), but the
training loop never waits: the host makes the next batch and queues the next step's kernels
while the device runs this one. On an H100 a step timed alone took about twice as long as one
in the loop (2026-12-06: 5,675 steps planned where about 11,000 fitted), so the fit is scaled to
the time of further steps run as the loop runs them.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from common.tools.drafter.data import Sequence
from common.tools.drafter.objective import Batch, make_batch
from common.tools.drafter.trainer import EpochOrder, Trainer, save_checkpoint

TIMED_STEPS = 16  # timed alone, then as many as the loop runs them, after WARM_STEPS untimed ones
WARM_STEPS = 3  # allocations, kernel choices
MARGIN = 0.03  # of the time left: the fit is an estimate


@dataclass
class StepCost:
    """Predicted seconds of a training step: fixed + per_token x the batch's padded tokens."""

    fixed: float
    per_token: float

    def seconds(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens

    def scaled(self, factor: float) -> StepCost:
        return StepCost(self.fixed * factor, self.per_token * factor)


def loop_factor(shape: StepCost, tokens: list[int], wall: float) -> float:
    """What scales `shape` (steps timed alone) to steps of these padded sizes that took `wall`
    seconds in a row; at most 1: a stall among those (a recompile) must not plan fewer steps
    than the fit, which leaves stalls out, says."""
    predicted = sum(shape.seconds(n) for n in tokens)
    return min(1.0, wall / predicted) if predicted > 0 else 1.0


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


def padded_tokens(seqs: list[Sequence]) -> int:
    return len(seqs) * max(len(s.ids) for s in seqs)


def steps_that_fit(order: EpochOrder, cost: StepCost, seconds: float, save_every: int, save_s: float,
                   snapshot_every: int | None = None) -> int:
    """The most steps of `order` whose predicted time, with save_s after every save_every-th
    step (a checkpoint and the held-out check) and every snapshot_every-th (a snapshot), stays
    within `seconds`."""
    if cost.seconds(1) <= 0:
        raise ValueError(f"--steps auto: a step timed at {cost.seconds(1)} s")
    used, step = 0.0, 0
    while True:
        used += cost.seconds(padded_tokens(order.batch(step)))
        for every in (save_every, snapshot_every):
            if every and (step + 1) % every == 0:
                used += save_s
        if used > seconds:
            return step
        step += 1


def time_steps(trainer: Trainer, order: EpochOrder, first: int, steps: int) -> list[tuple[int, float]]:
    """(padded tokens, seconds) of steps first..first+steps-1 of `order`, each timed alone and
    making its batch as the training loop does."""
    out = []
    for i in range(first, first + steps):
        trainer.synchronize()
        t = time.perf_counter()
        seqs = order.batch(i)
        trainer.step(make_batch(seqs, trainer.device), i)
        trainer.synchronize()
        out.append((padded_tokens(seqs), time.perf_counter() - t))
    return out


def time_loop(trainer: Trainer, order: EpochOrder, first: int, steps: int) -> float:
    """Seconds of steps first..first+steps-1 of `order` run as the training loop runs them: the
    device's queue is drained only at the start and the end."""
    trainer.synchronize()
    t = time.perf_counter()
    for i in range(first, first + steps):
        trainer.step(make_batch(order.batch(i), trainer.device), i)
    trainer.synchronize()
    return time.perf_counter() - t


def measure_cost(trainer: Trainer, order: EpochOrder) -> tuple[StepCost, float]:
    """A step's cost on `trainer` (a copy: it trains on the first batches of `order`): the fit of
    TIMED_STEPS steps timed alone, scaled to TIMED_STEPS more run as the loop runs them; and the
    factor of that scaling."""
    for i in range(WARM_STEPS):
        trainer.step(make_batch(order.batch(i), trainer.device), i)
    shape = fit_cost(time_steps(trainer, order, WARM_STEPS, TIMED_STEPS))
    first = WARM_STEPS + TIMED_STEPS
    wall = time_loop(trainer, order, first, TIMED_STEPS)
    factor = loop_factor(shape, [padded_tokens(order.batch(i)) for i in range(first, first + TIMED_STEPS)], wall)
    return shape.scaled(factor), factor


def plan_steps(probe: Trainer, order: EpochOrder, eval_batches: list[Batch], seconds_left: Callable[[], float],
               save_every: int, snapshot_every: int | None, folder: str) -> tuple[int, dict]:
    """Steps for a run of `order`, timed on `probe` (a trainer like the run's, on a copy of its
    drafter: it trains on the first batches), and what the plan read. seconds_left(): the
    seconds --time-limit still leaves; folder: where the run writes its checkpoints."""
    cost, factor = measure_cost(probe, order)
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
    total = steps_that_fit(order, cost, budget, save_every, save_s, snapshot_every)
    if total < 1:
        raise ValueError(f"--steps auto: not one step fits in the {budget:.1f} s that --time-limit leaves")
    return total, {"timed_steps": 2 * TIMED_STEPS, "step_fixed_s": round(cost.fixed, 5),
                   "step_per_token_us": round(cost.per_token * 1e6, 5),
                   "loop_factor": round(factor, 3), "save_and_check_s": round(save_s, 3),
                   "seconds_planned": round(budget, 1)}
