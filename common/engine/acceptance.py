"""How far a drafter's drafts get accepted, estimated from evidence that fades.

After a verify step with a block of B whose drafts were right for the first k positions, each
position i < B is one trial of "at least i drafts accepted", a hit if k >= i; positions past the
block say nothing. The estimate of P(at least i accepted) is (hits + s * prior) / (trials + s):
the prior (another estimate) weighs s trials. Evidence fades with every decode step, speculative
or not, so that what plain steps cannot teach (they verify nothing) is eventually tried again:
a policy that stopped speculating because the drafts were poor speculates again once its
evidence has faded back toward the prior, and stops again after a few steps if they still are.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Acceptance:
    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def observe(self, drafted: int, block: int) -> None:
        if len(self.trials) < block:
            grow = block - len(self.trials)
            self.hits += [0.0] * grow
            self.trials += [0.0] * grow
        for i in range(1, block):
            self.trials[i] += 1.0
            self.hits[i] += float(drafted >= i)

    def fade(self, keep: float) -> None:
        """One decode step passed: every count keeps this share."""
        self.hits = [h * keep for h in self.hits]
        self.trials = [t * keep for t in self.trials]

    def estimate(self, prior: list[float], strength: float) -> list[float]:
        """P(at least i drafts accepted) for i < len(prior); [0] is 1."""
        out = [1.0]
        for i in range(1, len(prior)):
            h, t = (self.hits[i], self.trials[i]) if i < len(self.trials) else (0.0, 0.0)
            out.append((h + strength * prior[i]) / (t + strength))
        return out
