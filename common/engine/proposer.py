"""What the engine asks of a speculative proposer (DFlash: common.dflash.proposer).

The engine and the speculative step know a proposer only through this protocol, so the engine
layer does not depend on any drafter, and a new drafting method plugs in without touching them.
"""
from __future__ import annotations

from typing import Protocol

import torch

from common.kv.buffers import PagedKVBuffer
from common.kv.seq_cache import SeqCache


class Proposer(Protocol):
    block_size: int  # tokens per verify block: the last committed token and block_size - 1 drafts
    capture_layers: tuple[int, ...]  # target layers whose hidden states the drafter reads

    def reserve(self, seq: SeqCache, num_tokens: int) -> None:
        """Draft pages for num_tokens tokens (raises OutOfPages, allocating nothing)."""

    def release(self, seq: SeqCache) -> None: ...

    def append_context(self, seqs: list[SeqCache], captured: dict[int, torch.Tensor],
                       rows: list[torch.Tensor]) -> None:
        """Extend each seq's draft context with the captured target states of its committed
        tokens (rows[i]: which rows of `captured` are seqs[i]'s, in order)."""

    def propose(self, seqs: list[SeqCache], last_tokens: list[int]) -> list[list[int]]:
        """block_size - 1 draft tokens per request, after its last committed token."""

    def describe_buffers(self) -> list[PagedKVBuffer]:
        """The draft KV buffers a peer may write for a room (PD transfer)."""

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A CPU copy of these draft pages (transfer checksums)."""
