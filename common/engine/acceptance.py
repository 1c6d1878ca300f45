"""How far a drafter's drafts get accepted, estimated from evidence that fades.

The quantity is q[i] = P(draft i is right | drafts 1..i-1 were), i >= 1: a verify step with a
block of B whose drafts were right for the first k positions tried position i if it reached it
(i <= k + 1) and the block held it (i < B), and passed it if i <= k. P(at least i accepted) is
then the product q[1] * ... * q[i]. Estimating the continuations rather than P(at least i)
itself uses every verify step whatever its block, like a survival curve of censored data, and
says what to expect past the blocks that were verified: a position that no block reached yet
continues at the rate of the last position before it (`continuations`), so that a drafter that
fills its blocks of 4 is expected to go on past 4 and is given a longer block to show it.

Each estimate is (passed + s * prior) / (tried + s): the prior (another estimate) weighs s trials.
Evidence fades with every decode step, speculative or not, so that what plain steps cannot teach
(they verify nothing) is eventually tried again: a policy that stopped speculating because the
drafts were poor speculates again once its evidence has faded back toward the prior, and stops
again after a few steps if they still are. The estimate leans a little toward speculating where
the evidence is thin (`optimism` standard errors above the mean): a few unlucky verify steps early
on then do not switch a drafter that pays off for hundreds of steps.

The leaning is of each P(at least i), by the verify steps whose block held position i: leaning each
continuation instead would compound along the product, and the steps that reached i are fewer the
deeper i is, which would lean the deep positions for ever. Positions that no block held keep the
lean of the prior's weight alone, a push toward trying the longer block. The policy weighs every
running request at every step, so the arithmetic is numpy over the whole batch (`reach`),
fading multiplies one scale per request instead of its counts, and a verify step's observation
is queued and counted when the estimate is next read: a step observes while the device waits for
the host, and the policy reads mostly while the device runs the next step.
"""
from __future__ import annotations

import numpy as np

MAX_OBSERVED = 64  # verify steps queued at most (an estimate nobody reads)


class Acceptance:
    def __init__(self, max_block: int):
        # Counts in units of `scale`: a count is passed[i] * scale. Position i was held by the
        # block of `held` verify steps, reached by `tried` of them and passed by `passed`.
        self._held = np.zeros(max_block)
        self._tried = np.zeros(max_block)
        self._passed = np.zeros(max_block)
        self.scale = 1.0
        # Verify steps observed and not yet counted: (drafted, block, one count in units of scale).
        self._observed: list[tuple[int, int, float]] = []

    def observe(self, drafted: int, block: int) -> None:
        self._observed.append((drafted, block, 1.0 / self.scale))
        if len(self._observed) >= MAX_OBSERVED:
            self._count()

    def _count(self) -> None:
        for drafted, block, one in self._observed:
            self._held[1:block] += one
            self._tried[1:min(drafted + 1, block - 1) + 1] += one
            self._passed[1:drafted + 1] += one
        self._observed.clear()

    @property
    def held(self) -> np.ndarray:
        self._count()
        return self._held

    @property
    def tried(self) -> np.ndarray:
        self._count()
        return self._tried

    @property
    def passed(self) -> np.ndarray:
        self._count()
        return self._passed

    def fade(self, keep: float) -> None:
        """One decode step passed: every count keeps this share."""
        self.scale *= keep
        if self.scale < 1e-100:  # fold it into the counts before it underflows
            self._count()
            for counts in (self._held, self._tried, self._passed):
                counts *= self.scale
            self.scale = 1.0

    def continuations(self, first: float, strength: float) -> np.ndarray:
        """q[i] for each i < max_block ([0] is 1): position 1's prior is `first`, each later
        position's the estimate before it."""
        passed, tried = self.passed * self.scale, self.tried * self.scale
        q = np.ones_like(passed)
        prior = first
        for i in range(1, len(q)):
            q[i] = prior = (passed[i] + strength * prior) / (tried[i] + strength)
        return q


def reach(evidence: list[Acceptance], prior: np.ndarray, strength: float, optimism: float = 0.0) -> np.ndarray:
    """[len(evidence), len(prior)]: P(at least i drafts accepted) by each one's evidence, with the
    continuations `prior` as every one's prior; [:, 0] is 1, and no later P exceeds an earlier."""
    scale = np.array([e.scale for e in evidence])[:, None]
    passed = np.stack([e.passed for e in evidence]) * scale
    tried = np.stack([e.tried for e in evidence]) * scale + strength
    held = np.stack([e.held for e in evidence]) * scale + strength
    p = ((passed + strength * prior) / tried).cumprod(axis=1)
    p = np.minimum(1.0, p + optimism * np.sqrt(p * (1.0 - p) / held))
    p[:, 0] = 1.0
    return np.minimum.accumulate(p, axis=1)
