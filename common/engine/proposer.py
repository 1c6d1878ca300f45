"""What the engine asks of a speculative proposer (DFlash: common.dflash.proposer).

The engine and the decoder know a proposer only through these protocols, so the engine layer
does not depend on any drafter, and another drafting method plugs in without touching them.
A prefill instance needs only the draft context (ContextProposer: under pipeline parallelism
the draft KV lives on the last stage); a decoding engine needs the whole Proposer.
"""
from __future__ import annotations

from typing import Protocol

import torch

from common.kv.buffers import PagedKVBuffer
from common.kv.page_pool import PagePool
from common.kv.seq_cache import SeqCache


class ContextProposer(Protocol):
    block_size: int  # the largest verify block: the last committed token and block_size - 1 drafts
    capture_layers: tuple[int, ...]  # target layers whose hidden states the drafter reads
    pool: PagePool  # the draft KV's pages

    def reserve(self, seq: SeqCache, num_tokens: int) -> None:
        """Draft pages for num_tokens tokens (raises OutOfPages, allocating nothing)."""

    def release(self, seq: SeqCache) -> None: ...

    def append_context(self, seqs: list[SeqCache], captured: dict[int, torch.Tensor],
                       rows: list[torch.Tensor]) -> None:
        """Extend each seq's draft context with the captured target states of its committed
        tokens (rows[i]: which rows of `captured` are seqs[i]'s, in order)."""

    def describe_buffers(self) -> list[PagedKVBuffer]:
        """The draft KV buffers a peer may write for a room (PD transfer)."""

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A CPU copy of these draft pages (transfer checksums)."""


class Proposer(ContextProposer, Protocol):
    name: str  # what its step costs depend on (the drafter's shape), for the costs kept on disk
    scratch_slot: int  # a draft KV slot no request owns (padding rows of static steps use its page)

    def draft(self, last: torch.Tensor, length: torch.Tensor, pages: torch.Tensor, B: int) -> torch.Tensor:
        """Static: drafts [rows, B-1] after each row's last token last[i], its draft context of
        length[i] tokens in the pages of row i of the table pages [rows, W]."""

    def draft_ahead(self, last: torch.Tensor, length: torch.Tensor, pages: torch.Tensor, slot: torch.Tensor
                    ) -> torch.Tensor:
        """Static: draft() of a whole block (block_size - 1 drafts) for the next step, kept in
        row slot[i] (the request's pending row); returns the drafter's log-probability of each
        draft [rows, block_size - 1], fp32."""

    def ahead(self, slot: torch.Tensor, B: int) -> torch.Tensor:
        """Static: the first B-1 drafts that draft_ahead() kept in row slot[i] [rows, B-1]."""

    def reserve_pending(self, width: int, slots: int) -> None:
        """Room for `width` pending tokens per request (features of committed tokens whose draft
        context is not written yet), for `slots` requests to start with."""

    @property
    def pending_width(self) -> int: ...

    def hold_slots(self, seqs: list[SeqCache]) -> bool:
        """A pending row (seq.state_slot) for each seq without one; True when the buffer moved
        (static steps captured over it must be captured again). release() frees it."""

    def keep(self, captured: dict[int, torch.Tensor], slot: torch.Tensor, offset: torch.Tensor | None) -> None:
        """Static: the captured target states of a step's T tokens per row (rows in the same
        order) become row slot[i]'s pending tokens offset[i] .. offset[i]+T-1 (None: from 0)."""

    def catch_up(self, slot: torch.Tensor, start: torch.Tensor, pages: torch.Tensor, width: int) -> None:
        """Static: the draft context of each row's first `width` pending tokens, at positions
        start[i] on (rows with fewer write garbage past their committed length, overwritten
        before anything reads it)."""
