"""When to speculate, and with which block.

A speculative step of block B costs more than a plain step and commits more tokens. Per step the
policy compares, for the batch about to run,

    plain:  rows / cost(rows, plain)
    B:      sum over requests of E[tokens | B] / cost(rows, B)

and picks the best. Costs were measured on this device at start-up (step_costs.py): per batch
size and block, at two context lengths, so that long contexts (where attention dominates, and
a CPU pays for every query) are priced as well as short ones. E[tokens | B] = 1 + sum of
P(at least i drafts accepted) for i < B, from each request's running estimate, which starts
from the estimate over all requests (SpecStats.reach). A batch that has run plain for
EXPLORE_EVERY steps speculates once with the smallest block, so that the estimates follow a
drafter that starts hitting. `--spec-block N` pins every step to N.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.request import Request
from common.engine.spec_stats import SpecStats

BLOCKS = (4, 8, 16)
EXPLORE_EVERY = 32
GLOBAL_ALPHA = 0.05  # weight of one verify step in the estimate over all requests
PRIOR_REACH = 0.7  # before any verify step: P(at least i accepted) = PRIOR_REACH ** i


@dataclass(frozen=True)
class SpecConfig:
    block: int | None = None  # every step speculates with this block (--spec-block); None: choose
    blocks: tuple[int, ...] = BLOCKS  # the blocks to choose from (those up to the drafter's)
    cache_dir: str | None = None  # where measured step costs are kept between runs (None: not kept)


@dataclass
class StepCosts:
    """Seconds per step on one device. base[(rows, block)] at `context` tokens of context per
    row (block 0 = plain); slope[block] = seconds per extra context token per row."""

    context: int
    base: dict[tuple[int, int], float]
    slope: dict[int, float] = field(default_factory=dict)

    def cost(self, rows: int, block: int, context: float) -> float:
        measured = sorted(r for r, b in self.base if b == block)
        lo = max((r for r in measured if r <= rows), default=measured[0])
        hi = min((r for r in measured if r >= rows), default=measured[-1])
        if lo == hi and rows > hi and len(measured) > 1:  # past the largest: extend the last segment
            lo = measured[-2]
        c_lo, c_hi = self.base[(lo, block)], self.base[(hi, block)]
        at_rows = c_lo if hi == lo else c_lo + (c_hi - c_lo) * (rows - lo) / (hi - lo)
        return max(at_rows + rows * self.slope.get(block, 0.0) * (context - self.context), 1e-9)

    def to_json(self) -> dict:
        return {"context": self.context, "base": [[r, b, c] for (r, b), c in sorted(self.base.items())],
                "slope": {str(b): s for b, s in self.slope.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "StepCosts":
        return cls(d["context"], {(r, b): c for r, b, c in d["base"]}, {int(b): s for b, s in d["slope"].items()})


class SpecPolicy:
    def __init__(self, max_block: int, config: SpecConfig, costs: StepCosts | None = None):
        self.pinned = config.block
        self.blocks = [b for b in config.blocks if b <= max_block] or [max_block]
        self.costs = costs  # None: only a pinned block (or the largest) is ever used
        self.reach = [PRIOR_REACH ** i for i in range(max_block)]  # over all requests
        self._plain_streak = 0

    def start(self, spec: SpecStats) -> None:
        """A new request's estimate starts from the one over all requests."""
        spec.reach = list(self.reach)

    def choose(self, reqs: list[Request]) -> int:
        """The block for the next step of these requests; 0 = a plain step."""
        if self.pinned is not None:
            return self.pinned
        if self.costs is None:
            return self.blocks[-1]
        rows = len(reqs)
        context = sum(r.cache.length for r in reqs) / rows
        left = [r.params.max_new_tokens - len(r.output_ids) for r in reqs]
        best, best_rate = 0, rows / self.costs.cost(rows, 0, context)
        for block in self.blocks:
            tokens = sum(min(n, r.spec.expected_tokens(block)) for r, n in zip(reqs, left))
            rate = tokens / self.costs.cost(rows, block, context)
            if rate > best_rate:
                best, best_rate = block, rate
        if best:
            self._plain_streak = 0
            return best
        self._plain_streak += 1
        if self._plain_streak >= EXPLORE_EVERY:
            self._plain_streak = 0
            return self.blocks[0]
        return 0

    def observe(self, drafted: int, block: int) -> None:
        """A verify step whose drafts were right for `drafted` positions (the request's own
        estimate is updated by SpecStats.record)."""
        for i in range(1, block):
            self.reach[i] += GLOBAL_ALPHA * (float(drafted >= i) - self.reach[i])
