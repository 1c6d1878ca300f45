"""How likely a draft is right, given the drafter's own confidence in it.

A speculative step may draft the next block at its end (the decoder's draft-ahead), so that the
host reads, with the committed tokens, the drafter's log-probability of each draft of the next
block before choosing how many of them to verify. A drafter's probabilities are not calibrated
(a DFlash drafter predicts every block position at once, each given MASKs before it, not the
drafts), so the policy does not read them as they are: it counts, per band of confidence, how
often a draft that a verify step reached was right, and reads P(draft i is right | drafts 1..i-1
were) as that band's rate. P(at least i drafts accepted) is the product over positions 1..i.

On the embedded model and its drafter (GSM8K chat, fp32, one request at a time), choosing each
step's block from these estimates instead of from the acceptance seen so far took the speedup
over plain decoding from 1.89x to 1.99x on an H100 (docs/PERFORMANCE.md, 2026-12-05 (late
afternoon)). Each band's estimate starts at the band's own probability, worth PRIOR_STRENGTH
verify steps, and its evidence fades like the acceptance estimate over all requests, so that it
follows a change of prompts.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

# Bands of log-probability: below 5%, 5-10%, ..., 98-99%, above 99%.
EDGES = np.log(np.array([0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99]))
_EDGES = EDGES.tolist()  # band i holds (EDGES[i - 1], EDGES[i]], as np.searchsorted bands them
PRIOR = np.array([0.025, 0.075, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.925, 0.965, 0.985, 0.995])
PRIOR_STRENGTH = 20.0


class Calibration:
    def __init__(self, strength: float = PRIOR_STRENGTH):
        self.strength = strength
        # Counts in units of `scale` (a count is tried[i] * scale), so that fading is one product.
        self.tried = np.zeros(len(PRIOR))
        self.passed = np.zeros(len(PRIOR))
        self.scale = 1.0

    def observe(self, confidence: Sequence[float], drafted: int, block: int) -> None:
        """A verify step of `block` tokens whose drafts were right for the first `drafted`
        positions; confidence[j] is the drafter's log-probability of draft j + 1."""
        reached = min(drafted + 1, block - 1)
        bands = np.searchsorted(EDGES, confidence[:reached])
        one = 1.0 / self.scale
        np.add.at(self.tried, bands, one)
        np.add.at(self.passed, bands[:drafted], one)

    def fade(self, keep: float) -> None:
        self.scale *= keep
        if self.scale < 1e-100:  # fold it into the counts before it underflows
            self.tried *= self.scale
            self.passed *= self.scale
            self.scale = 1.0

    def rates(self) -> np.ndarray:
        """Per band, P(a draft is right | the ones before it were)."""
        return (self.passed * self.scale + self.strength * PRIOR) / (self.tried * self.scale + self.strength)

    def reach(self, confidence: Sequence[float], rates: Sequence[float] | None = None) -> list[float]:
        """One request's confidences [W] -> P(at least i drafts accepted) for i = 0..W ([0] = 1)
        (`rates`: rates() as it was computed last, if nothing was observed since). In plain
        Python: the policy reads it after the step's read, while the device waits, and on a GPU
        host a dozen numpy calls on a row of 15 took longer than this loop."""
        rates = self.rates().tolist() if rates is None else rates
        p, out = 1.0, [1.0]
        for c in confidence:
            p *= rates[bisect_left(_EDGES, c)]
            out.append(p)
        return out
