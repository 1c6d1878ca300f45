"""One request's place in a paged cache."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqCache:
    """One request's place in the cache: its pages in token order and how many tokens are stored,
    and its state slot, 0 while it holds none (models with recurrent layers: their state; a
    DFlash draft cache: its row of pending context features)."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    state_slot: int = 0
