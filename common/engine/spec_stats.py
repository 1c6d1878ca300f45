"""A request's speculative-decoding counters and the meta_info fields made of them
(docs/BENCHMARKS.md explains the two accept lengths)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    block_size: int
    verify_ct: int = 0
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    histogram: list[int] = field(default_factory=list)  # [k] = steps that accepted k drafts

    def __post_init__(self) -> None:
        self.histogram = self.histogram or [0] * self.block_size

    def record(self, accepted: int) -> None:
        self.verify_ct += 1
        self.accepted_drafts += accepted
        self.proposed_drafts += self.block_size - 1
        self.histogram[accepted] += 1

    def meta(self, completion_tokens: int) -> dict:
        v = self.verify_ct
        return {
            "spec_verify_ct": v,
            "spec_accept_histogram": list(self.histogram),
            "spec_accepted_drafts": self.accepted_drafts,
            "spec_proposed_drafts": self.proposed_drafts,
            "spec_accept_length": completion_tokens / v if v else 0.0,
            "spec_accept_length_weighted": 1 + self.accepted_drafts / v if v else 0.0,
        }
