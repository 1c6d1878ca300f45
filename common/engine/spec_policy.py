"""When to speculate, and with which block.

A speculative step of block B costs more than a plain step and commits more tokens. Per step the
policy compares, for the batch about to run,

    plain:  rows / cost(rows, plain)
    B:      sum over requests of E[tokens | B] / cost(rows, B)

and picks the best, plain unless a block promises PLAIN_EDGE times its rate. Costs were measured on
this device at start-up (step_costs.py): per batch size and block, at two context lengths, so that
long contexts (where attention dominates, and a CPU pays for every query) are priced as well as
short ones. What the steps then take is timed, so that a start-up measurement that was off, or a
device that later runs one kind of step slower than the other, is seen within a few hundred steps
instead of being trusted to the end. Each timed step gives its time over its start-up cost; a fast
running level of that ratio over every step follows the machine's speed (clocks, other work), and
each choice's price is its ratio relative to that level, which a change of the whole machine's
speed leaves as it is. Timings fix prices only up to a common factor, so a plain step's price stays
1 and the level takes the rest; the running averages are of logarithms, which zero-mean noise does
not drag. Prices of two choices compare only when both were timed lately, so once every EXPLORE
steps a choice other than the one made is taken, the one timed longest ago of: the best of the
other kind (plain while speculating, the best block while decoding plainly), and the blocks whose
rate comes within CONTENDER of the best's. A price timed at a bad moment, as the machine's speed
changed, is then mended, and the drafter's evidence reaches past the block in use. A block far
behind is explored only once in STALE steps, where each step would cost (a block of 16 against
plain steps, with drafts that miss, costs about two plain steps) but its price would otherwise
follow plain's updates alone, which carry the bias of the blocks chosen for being cheap. A price
forgets at the same rate per step however seldom it is timed. A speculative step that first catches
up the draft KV of the plain steps before it is not timed (that work is the plain steps' price):
when it was the exploring step, the step after it, which catches up only its own block, explores
again.

E[tokens | B] = 1 + the sum over i < B of P(at least i drafts accepted), estimated per request
from its own verify steps, with the estimate over all requests as its prior. That one's prior
for each draft being right, given the ones before it, is PRIOR_REACH, and past the positions
verified so far the last one's rate; a request's own evidence refines it where the request's
blocks reached (acceptance.py). The evidence fades with every decode step (the requests' faster
than the global), so that when the drafts were poor and the batch decodes plainly, speculation is
tried again once that evidence has faded, and dropped again within a few steps if the drafts
still miss: a drafter that never hits costs about one speculative step in a hundred.
`--spec-block N` pins every step to N.

Where every request of the batch has drafts ahead (the decoder's draft-ahead: the step before
drafted the next block and brought the drafter's confidence in each draft), E[tokens | B] is read
from those confidences instead (common.engine.confidence): how sure the drafter is of this very
block says more about how far it will be accepted than how far the request's blocks went before.
Such a choice is not held for later steps: it is this block's, and it may be any of
CONFIDENT_BLOCKS, which holds blocks between the others (a block that ends where the drafter's
confidence falls; those blocks are captured for the batch sizes that draft ahead only, never
explored, and priced by their neighbours' corrections). It is made after the step's read,
while the device waits, so what can be done before is done while the device runs the step that
drafts ahead (weigh_confident: the evidence of the verify steps since, and the prices of the
choices), and what is left is a short loop over the confidences.

Weighing takes tens of microseconds of host time, which a GPU step of a small batch would wait
for: the decoder has the next step weighed (ahead()) while the device runs this one, and the
next step takes that choice if its batch is the same. The evidence of the step in flight then
counts from the step after.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from common.engine.acceptance import Acceptance, reach
from common.engine.confidence import Calibration
from common.engine.request import Request

BLOCKS = (4, 8, 16)
# The blocks a choice from the drafter's confidence takes (steps of single requests, with
# draft-ahead): there each step's block is this block's own, so blocks between those above pay
# too. A replay of 1,835 recorded verify steps (GSM8K chat, the shipped drafter) at the H200's
# batch-1 device costs, those between measured blocks interpolated, gave 1.5% more tokens per
# unit of device time with 5, 6 and 7 added, 2% with every block from 2 to 16; on an H100 the
# speedup at concurrency 1 went from 1.97x to 2.02x (docs/PERFORMANCE.md, 2026-12-05 (late night)
# and 2026-12-06). Each is a CUDA graph and a set of product shapes at each batch size that
# drafts ahead (one, by default).
CONFIDENT_BLOCKS = (4, 5, 6, 7, 8, 16)
PRIOR_REACH = 0.5  # before any evidence: P(a draft is right | the ones before it were)
GLOBAL_STRENGTH = 8.0  # the prior counts as this many verify steps in the estimate over all requests
REQUEST_STRENGTH = 4.0  # the estimate over all requests counts as this many of a request's own steps
GLOBAL_KEEP = 0.998  # evidence over all requests kept per decode step (half-life ~350 steps)
REQUEST_KEEP = 0.98  # a request's own evidence kept per decode step (half-life ~35 steps)
OPTIMISM = 0.25  # standard errors the estimates lean toward speculating (acceptance.py)
# Speculation is chosen only where it promises this much more than a plain step: its rate rests on
# two estimates (acceptance, a step's price) and plain decoding's on one, and near a tie a wrong
# guess costs a few percent for nothing (on two CPU cores, at 32 rows, speculating read 0.90-1.05x
# of plain decoding in rounds of the same choices: docs/PERFORMANCE.md, 2026-12-04 (night)).
PLAIN_EDGE = 1.05
# A clear decision (one choice CLEAR times the other's rate) holds for HOLD more steps of the same
# batch: the estimates move slowly, and weighing them takes host time.
CLEAR, HOLD = 1.25, 6
EXPLORE = 50  # an exploring step once in this many (2% of the steps, priced wrongly)
CONTENDER = 0.75  # a block explored besides the best of the other kind: its rate over the best's at least this
STALE = 500  # every choice is explored at least once in this many steps
LEVEL_KEEP = 0.8  # per timed step, the weight the machine's level keeps
PRICE_KEEP = 0.99  # per step taken, the weight a choice's price keeps (half-life ~70 steps)
PRICE_LEAST_KEPT = 0.5  # one timed step moves a price at most halfway, however long since the last
PRICE_LIMITS = (0.25, 4.0)  # one step's ratio, clamped (a stall of the host is not a price)


def between_blocks(values: dict[int, float], block: int) -> float:
    """values[block] for a block without one: linear between the nearest blocks below and above
    it that have one (the nearest, if only one side has any); block 0 (plain) is not a neighbour."""
    lo = max((b for b in values if 0 < b < block), default=None)
    hi = min((b for b in values if b > block), default=None)
    if lo is None or hi is None:
        return values[hi if lo is None else lo]
    return values[lo] + (values[hi] - values[lo]) * (block - lo) / (hi - lo)


@dataclass(frozen=True)
class SpecConfig:
    block: int | None = None  # every step speculates with this block (--spec-block); None: choose
    blocks: tuple[int, ...] = BLOCKS  # the blocks to choose from (those up to the drafter's)
    confident_blocks: tuple[int, ...] = CONFIDENT_BLOCKS  # ... when choosing from the drafter's confidence
    cache_dir: str | None = None  # where measured step costs are kept between runs (None: not kept)
    timed: bool = True  # correct the costs by timing steps, exploring the other kind (False: costs as given)
    # Draft the next block at the end of each speculative step, and choose its length from the
    # drafter's confidence (common.engine.decoder); None: where steps replay CUDA graphs and the
    # block is chosen (not --spec-block).
    ahead: bool | None = None


@dataclass
class StepCosts:
    """Seconds per step on one device. base[(rows, block)] at `context` tokens of context per
    row (block 0 = plain); slope[block] = seconds per extra context token per row. `padded`:
    the rows measured are the CUDA-graph batch sizes, and a batch between two runs the larger's
    graph, at its cost; else a step costs about linearly in its rows, between and past them."""

    context: int
    base: dict[tuple[int, int], float]
    slope: dict[int, float] = field(default_factory=dict)
    padded: bool = False

    def __post_init__(self) -> None:
        self._rows = {b: sorted(r for r, bb in self.base if bb == b) for b in {b for _, b in self.base}}

    def cost(self, rows: int, block: int, context: float) -> float:
        measured = self._rows[block]
        lo = max((r for r in measured if r <= rows), default=measured[0])
        hi = min((r for r in measured if r >= rows), default=measured[-1])
        if self.padded:
            lo = hi
        elif lo == hi and rows > hi and len(measured) > 1:  # past the largest: extend the last segment
            lo = measured[-2]
        c_lo, c_hi = self.base[(lo, block)], self.base[(hi, block)]
        at_rows = c_lo if hi == lo else c_lo + (c_hi - c_lo) * (rows - lo) / (hi - lo)
        return max(at_rows + rows * self.slope.get(block, 0.0) * (context - self.context), 1e-9)

    def to_json(self) -> dict:
        return {"context": self.context, "base": [[r, b, c] for (r, b), c in sorted(self.base.items())],
                "slope": {str(b): s for b, s in self.slope.items()}, "padded": self.padded}

    @classmethod
    def from_json(cls, d: dict) -> "StepCosts":
        return cls(d["context"], {(r, b): c for r, b, c in d["base"]}, {int(b): s for b, s in d["slope"].items()},
                   d.get("padded", False))


class SpecPolicy:
    def __init__(self, max_block: int, config: SpecConfig, costs: StepCosts | None = None, confident: bool = False):
        self.max_block = max_block
        self.pinned = config.block
        self.blocks = [b for b in config.blocks if b <= max_block] or [max_block]
        # With `confident` (the decoder drafts ahead), the blocks only a choice from the drafter's
        # confidence takes. Never explored nor priced by timing: their price is their neighbours'.
        self.confident_only = sorted({b for b in config.confident_blocks if b <= max_block} - set(self.blocks)) \
            if confident and self.pinned is None else []
        self.costs = costs  # None: only a pinned block (or the largest) is ever used
        self.acceptance = Acceptance(max_block)  # over all requests
        self.calibration = Calibration()  # drafts right by the drafter's confidence, over all requests
        self.timed_steps = config.timed
        self.level = 0.0  # log of time taken / start-up cost over every step: the machine's speed now
        # log of each choice's time / cost relative to the level; a plain step's is 0
        self.log_price = {b: 0.0 for b in (0, *self.blocks)}
        self._steps = 0  # steps taken so far
        self._timed_at = dict.fromkeys(self.log_price, 0)  # the step at which each choice was last timed
        self._asked_at = dict.fromkeys(self.log_price, 0)  # ... and last chosen to be timed
        self._others: list[int] = [0]  # the choices to explore, from the last weighing
        self._explored_at = 0  # the last step that explored
        self._exploring: int | None = None  # this step's exploring choice, if it explores
        self._explore_again: int | None = None  # an exploring step that was not timed, to take again
        self._retrying = False  # this step's exploring choice is such a step, taken again
        self._held: tuple[tuple[int, ...], int, int] = ((), 0, 0)  # (batch, choice, steps left)
        self._ahead: tuple[tuple[int, ...], int] | None = None  # (batch, its next choice), weighed ahead
        self._confident: list[tuple[list[float], int, int]] = []  # verify steps of drafts kept ahead, not yet counted
        # (batch, the confidence bands' rates, plain's rate, each block's cost), weighed while a step
        # that drafts ahead runs
        self._weighed: tuple[tuple[int, ...], list[float], float, dict[int, float]] | None = None
        self._times: list[tuple[int, int, float, float, int]] = []  # steps timed, not yet priced (.., steps since the last)

    def new_step(self, reqs: list[Request]) -> None:
        """A decode step of these requests begins (in one or more chunks): fade the evidence, count
        the step, and decide whether it explores, taking again an exploring step that could not
        be timed."""
        self.acceptance.fade(GLOBAL_KEEP)
        self.calibration.fade(GLOBAL_KEEP)
        for r in reqs:
            r.spec.acceptance.fade(REQUEST_KEEP)
        self._exploring, self._retrying = None, False
        if self.pinned is not None or self.costs is None or not self.timed_steps:
            return
        self._steps += 1
        other, self._explore_again = self._explore_again, None
        self._retrying = other is not None
        if other is None and self._steps - self._explored_at >= EXPLORE:
            stalest = min(self._others, key=self._last_timed)
            forgotten = min(self.log_price, key=self._last_timed)
            if self._steps - self._last_timed(forgotten) >= STALE:
                stalest = forgotten
            if self._steps - self._last_timed(stalest) >= EXPLORE:
                other, self._explored_at = stalest, self._steps
        if other is not None:
            self._asked_at[other] = self._steps
            self._exploring = other

    def choose(self, reqs: list[Request]) -> int:
        """The block for the next step of these requests (a chunk of the step new_step began);
        0 = a plain step."""
        ahead, self._ahead = self._ahead, None
        if self._exploring is not None:
            return self._exploring
        if ahead is not None and ahead[0] == tuple(id(r) for r in reqs):
            return ahead[1]
        return self._choose(reqs)

    def ahead(self, reqs: list[Request]) -> None:
        """Weigh the next step of these requests now, for choose() to take if it is asked about
        the same batch next."""
        self._ahead = (tuple(id(r) for r in reqs), self._choose(reqs))

    def _choose(self, reqs: list[Request]) -> int:
        if self.pinned is not None:
            return self.pinned
        if self.costs is None:
            return self.blocks[-1]
        if all(r.spec.ahead is not None for r in reqs):  # priced by weigh_confident, while the step before ran
            return self._choose_confident(reqs)
        self._price()
        batch = tuple(id(r) for r in reqs)
        held_batch, held_choice, left_steps = self._held
        if batch == held_batch and left_steps > 0:
            self._held = (batch, held_choice, left_steps - 1)
            return held_choice
        rows = len(reqs)
        context = sum(r.cache.length for r in reqs) / rows
        shared = self.acceptance.continuations(PRIOR_REACH, GLOBAL_STRENGTH)
        expected = reach([r.spec.acceptance for r in reqs], shared, REQUEST_STRENGTH, OPTIMISM).cumsum(1)
        left = np.array([r.params.max_new_tokens - len(r.output_ids) for r in reqs])
        # Tokens per second of each choice; E[tokens | B] = 1 + P(>= 1) + ... + P(>= B-1).
        rates = {0: rows / self._cost(rows, 0, context)}
        for block in self.blocks:
            rates[block] = np.minimum(left, expected[:, block - 1]).sum() / self._cost(rows, block, context)
        best_block = max(self.blocks, key=rates.get)
        best = best_block if rates[best_block] >= PLAIN_EDGE * rates[0] else 0
        self._others = [best_block if best == 0 else 0]
        self._others += [b for b in self.blocks if b not in (best, best_block) and rates[b] >= CONTENDER * rates[best]]
        plain, spec = rates[0], rates[best_block]
        clear = max(plain, spec) >= CLEAR * min(plain, spec)
        self._held = (batch, best, HOLD if clear else 0)
        return best

    def weigh_confident(self, reqs: list[Request]) -> None:
        """While the device runs a step of these requests that drafts ahead: count the verify
        steps observed since, and price the next step's choices for this batch."""
        for confidence, drafted, block in self._confident:
            self.calibration.observe(confidence, drafted, block)
        self._confident.clear()
        if self.pinned is not None or self.costs is None:  # nothing to choose
            return
        self._price()
        rows = len(reqs)
        context = sum(r.cache.length for r in reqs) / rows
        self._weighed = (tuple(id(r) for r in reqs), self.calibration.rates(), rows / self._cost(rows, 0, context),
                         {block: self._cost(rows, block, context) for block in sorted(self.blocks + self.confident_only)})

    def _choose_confident(self, reqs: list[Request]) -> int:
        """_choose() for requests with drafts ahead: E[tokens | B] from the drafter's confidence."""
        self._held = ((), 0, 0)  # a choice held from before is not this block's
        if self._weighed is None or self._weighed[0] != tuple(id(r) for r in reqs):
            self.weigh_confident(reqs)
        _, band_rates, plain, costs = self._weighed
        drafted = len(reqs[0].spec.ahead) + 1  # the block the drafts ahead fill
        tokens = {block: 0.0 for block in costs if block <= drafted}
        for r in reqs:
            # E[tokens | B] = 1 + P(>= 1) + ... + P(>= B - 1), and no more than the request has left
            expected = list(accumulate(self.calibration.reach(r.spec.ahead, band_rates)))
            left = r.params.max_new_tokens - len(r.output_ids)
            for block in tokens:
                tokens[block] += min(left, expected[block - 1])
        rates = {block: tokens[block] / costs[block] for block in tokens}
        best_block = max(rates, key=rates.get)
        best = best_block if rates[best_block] >= PLAIN_EDGE * plain else 0
        explorable = [b for b in rates if b in self.log_price]
        self._others = [max(explorable, key=rates.get) if best == 0 else 0]
        top = rates[best] if best else plain
        self._others += [b for b in explorable if b not in (best, *self._others) and rates[b] >= CONTENDER * top]
        return best

    def _last_timed(self, choice: int) -> int:
        return max(self._timed_at[choice], self._asked_at[choice])

    def _cost(self, rows: int, block: int, context: float) -> float:
        return self.costs.cost(rows, block, context) * math.exp(self._log_price(block))

    def _log_price(self, block: int) -> float:
        """A choice's price; a block only confidence chooses takes its neighbours' among the
        timed blocks, interpolated (prices follow the machine and the step's code, which the
        neighbours share)."""
        return self.log_price[block] if block in self.log_price else between_blocks(self.log_price, block)

    def timed(self, rows: int, block: int, context: float, seconds: float) -> None:
        """A step of `rows` requests at `context` tokens of context each took `seconds` (host
        synchronisation included, as the start-up costs were measured); a block only confidence
        chooses is not priced by its own steps (its neighbours' prices are). Priced when the policy
        next weighs: the step's read is where the device waits for the host, and the next
        choice was weighed while this step ran."""
        if self.pinned is not None or self.costs is None or not self.timed_steps or block not in self.log_price:
            return
        self._times.append((rows, block, context, seconds, self._steps - self._timed_at[block]))
        self._timed_at[block] = self._steps  # new_step's exploring reads it before the next weighing

    def _price(self) -> None:
        """Move the prices by the steps timed since the last weighing."""
        lo, hi = PRICE_LIMITS
        for rows, block, context, seconds, since in self._times:
            ratio = math.log(min(max(seconds / self.costs.cost(rows, block, context), lo), hi))
            self.level = LEVEL_KEEP * self.level + (1 - LEVEL_KEEP) * (ratio - self.log_price[block])
            keep = max(PRICE_LEAST_KEPT, PRICE_KEEP ** since)
            self.log_price[block] = keep * self.log_price[block] + (1 - keep) * (ratio - self.level)
            shift = self.log_price[0]  # plain's price stays 1: the level takes the common factor
            self.level += shift
            for b in self.log_price:
                self.log_price[b] -= shift
        self._times.clear()

    def untimed(self, block: int) -> None:
        """The step just taken with this block was not timed (see the module's notes)."""
        if block == self._exploring and not self._retrying:  # taken again once, not for ever
            self._explore_again = block

    def observe(self, drafted: int, block: int) -> None:
        """A verify step whose drafts were right for `drafted` positions (the request's own
        evidence is recorded by SpecStats.record)."""
        self.acceptance.observe(drafted, block)

    def observe_confident(self, confidence: list[float], drafted: int, block: int) -> None:
        """The same verify step, whose drafts were drafted ahead with this confidence in each
        (counted by the next weigh_confident)."""
        self._confident.append((confidence, drafted, block))
