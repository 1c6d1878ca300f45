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

import math
from bisect import bisect_left
from collections.abc import Sequence

# Bands of log-probability: below 5%, 5-10%, ..., 98-99%, above 99% (band i holds the
# confidences in (EDGES[i - 1], EDGES[i]]; bisect puts a NaN, from overflowed logits, in band 0).
EDGES = [math.log(p) for p in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)]
PRIOR = [0.025, 0.075, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.925, 0.965, 0.985, 0.995]
PRIOR_STRENGTH = 20.0


class Calibration:
    """In plain Python: 14 bands and 15 drafts a step, where numpy's calls cost more than the
    arithmetic, and the host does this work between a GPU's steps."""

    def __init__(self, strength: float = PRIOR_STRENGTH):
        self.strength = strength
        # Counts in units of `scale` (a count is tried[i] * scale), so that fading is one product.
        self.tried = [0.0] * len(PRIOR)
        self.passed = [0.0] * len(PRIOR)
        self.scale = 1.0

    def observe(self, confidence: Sequence[float], drafted: int, block: int) -> None:
        """A verify step of `block` tokens whose drafts were right for the first `drafted`
        positions; confidence[j] is the drafter's log-probability of draft j + 1."""
        one = 1.0 / self.scale
        for j in range(min(drafted + 1, block - 1)):
            band = bisect_left(EDGES, confidence[j])
            self.tried[band] += one
            if j < drafted:
                self.passed[band] += one

    def fade(self, keep: float) -> None:
        self.scale *= keep
        if self.scale < 1e-100:  # fold it into the counts before it underflows
            self.tried = [t * self.scale for t in self.tried]
            self.passed = [p * self.scale for p in self.passed]
            self.scale = 1.0

    def rates(self) -> list[float]:
        """Per band, P(a draft is right | the ones before it were)."""
        s, k = self.scale, self.strength
        return [(p * s + k * prior) / (t * s + k) for p, t, prior in zip(self.passed, self.tried, PRIOR)]

    def reach(self, confidence: Sequence[float], rates: Sequence[float] | None = None) -> list[float]:
        """One request's confidences [W] -> P(at least i drafts accepted) for i = 0..W ([0] = 1)
        (`rates`: rates() as it was computed last, if nothing was observed since). The policy
        reads it after the step's read, while the device waits."""
        rates = self.rates() if rates is None else rates
        p, out = 1.0, [1.0]
        for c in confidence:
            p *= rates[bisect_left(EDGES, c)]
            out.append(p)
        return out
