"""A request's speculative-decoding state: the counters reported in meta_info
(docs/BENCHMARKS.md explains the two accept lengths and the invariants) and the evidence of how
far its drafts get accepted, which the speculation policy reads."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.acceptance import Acceptance


@dataclass
class SpecStats:
    max_block: int  # the largest block a verify step of this request may use
    verify_ct: int = 0
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    plain_steps: int = 0  # decode steps of one token, without speculation
    histogram: list[int] = field(default_factory=list)  # [k] = verify steps that accepted k drafts
    block_histogram: list[int] = field(default_factory=list)  # [b] = verify steps with a block of b
    acceptance: Acceptance | None = None  # set in __post_init__
    # The drafter's log-probability of each draft of the block it drafted ahead for the next
    # step (common.engine.decoder), or None when the last step drafted none for this request.
    ahead: list[float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.histogram = self.histogram or [0] * self.max_block
        self.block_histogram = self.block_histogram or [0] * (self.max_block + 1)
        self.acceptance = self.acceptance or Acceptance(self.max_block)

    def record(self, accepted: int, block: int, drafted: int) -> None:
        """One verify step with a block of `block` that committed `accepted` drafts; the drafter
        had `drafted` of them right (more than accepted when the request stopped inside the block)."""
        self.verify_ct += 1
        self.accepted_drafts += accepted
        self.proposed_drafts += block - 1
        self.histogram[accepted] += 1
        self.block_histogram[block] += 1
        self.acceptance.observe(drafted, block)

    def meta(self, completion_tokens: int) -> dict:
        v = self.verify_ct
        return {
            "spec_verify_ct": v,
            "spec_accept_histogram": list(self.histogram),
            "spec_accepted_drafts": self.accepted_drafts,
            "spec_proposed_drafts": self.proposed_drafts,
            "spec_block_histogram": list(self.block_histogram),
            "spec_plain_steps": self.plain_steps,
            "spec_accept_length": completion_tokens / v if v else 0.0,
            "spec_accept_length_weighted": 1 + self.accepted_drafts / v if v else 0.0,
        }
