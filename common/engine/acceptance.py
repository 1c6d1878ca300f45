"""How far a drafter's drafts get accepted, estimated from evidence that fades.

After a verify step with a block of B whose drafts were right for the first k positions, each
position i < B is one trial of "at least i drafts accepted", a hit if k >= i; positions past the
block say nothing. The estimate of P(at least i accepted) is (hits + s * prior) / (trials + s):
the prior (another estimate) weighs s trials. Evidence fades with every decode step, speculative
or not, so that what plain steps cannot teach (they verify nothing) is eventually tried again:
a policy that stopped speculating because the drafts were poor speculates again once its
evidence has faded back toward the prior, and stops again after a few steps if they still are.
The estimate leans a little toward speculating where the evidence is thin (`optimism` standard
errors above the mean): a few unlucky verify steps early on then do not switch a drafter that
pays off for hundreds of steps.

The policy weighs every running request at every step, so the arithmetic is numpy over the
whole batch (`estimates`), and fading multiplies one scale per request instead of its counts.
"""
from __future__ import annotations

import numpy as np


class Acceptance:
    def __init__(self, max_block: int):
        # Counts in units of `scale`: a count is hits[i] * scale.
        self.hits = np.zeros(max_block)
        self.trials = np.zeros(max_block)
        self.scale = 1.0

    def observe(self, drafted: int, block: int) -> None:
        one = 1.0 / self.scale
        self.trials[1:block] += one
        self.hits[1:drafted + 1] += one

    def fade(self, keep: float) -> None:
        """One decode step passed: every count keeps this share."""
        self.scale *= keep
        if self.scale < 1e-100:  # fold it into the counts before it underflows
            self.hits *= self.scale
            self.trials *= self.scale
            self.scale = 1.0

    def estimate(self, prior: np.ndarray, strength: float, optimism: float = 0.0) -> np.ndarray:
        """P(at least i drafts accepted) for each i < len(prior); [0] is 1."""
        return estimates([self], prior, strength, optimism)[0]


def estimates(evidence: list[Acceptance], prior: np.ndarray, strength: float, optimism: float = 0.0) -> np.ndarray:
    """[len(evidence), len(prior)]: each one's estimate, with the same prior."""
    scale = np.array([e.scale for e in evidence])[:, None]
    hits = np.stack([e.hits for e in evidence]) * scale
    trials = np.stack([e.trials for e in evidence]) * scale + strength
    p = (hits + strength * prior) / trials
    p = np.minimum(1.0, p + optimism * np.sqrt(p * (1.0 - p) / trials))
    p[:, 0] = 1.0
    return p
