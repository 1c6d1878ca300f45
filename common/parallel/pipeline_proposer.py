"""The driver's DFlash proposer under pipeline parallelism, on a prefill instance.

The draft KV is computed and held by the last stage (common.parallel.worker), from the fc sum that
travelled down the pipeline with the forward pass (common.parallel.stage); this side keeps the draft
pages (the driver owns every page table) and tells the last stage which rows to append where.
Prefill only: propose() would need the draft KV here, and decode instances run no pipeline.
"""
from __future__ import annotations

import torch

from common.dflash.drafter import Drafter
from common.dflash.proposer import DraftPages
from common.kv.seq_cache import SeqCache
from common.parallel.driver import ParallelRunner


class PipelineProposer(DraftPages):
    def __init__(self, path: str, drafter: Drafter, runner: ParallelRunner, num_pages: int):
        super().__init__(drafter.cfg, runner.cfg, num_pages, runner.page_size)
        self.runner = runner
        runner.load_pipeline_drafter(path, drafter, num_pages)

    def describe_buffers(self) -> list:
        return []  # the draft KV is registered and described by the last stage's worker

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        return self.runner.read_draft_pages(pages)

    def append_context(self, seqs: list[SeqCache], captured: dict[int, torch.Tensor], rows: list[torch.Tensor]) -> None:
        """As DFlashProposer.append_context; `captured` is empty here (see ParallelRunner.forward)."""
        positions, slots = self.claim_slots(seqs, [len(r) for r in rows])
        self.runner.append_draft_context(torch.cat(rows).tolist(), positions, slots)
