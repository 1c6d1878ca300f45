"""Page allocator for paged KV caches. Pure Python: no model, no tensors, testable anywhere.

A page holds `page_size` consecutive tokens of one request. Requests own pages through a page
table (a list of page indices in token order); the pool only tracks which pages are free.
"""
from __future__ import annotations

from common.kv.seq_cache import SeqCache


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free; nothing is allocated."""


class FreeList:
    """Which of a fixed set of indices (pages, state slots) are free. Lowest first: a fresh
    request's pages come out contiguous (fewer, larger transfer entries)."""

    def __init__(self, indices: range, what: str, out_of: type[OutOfPages]):
        self.indices, self.what, self.out_of = indices, what, out_of
        self._free: list[int] = list(reversed(indices))  # pop from the end: lowest first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise self.out_of(f"need {n} {self.what}s, {len(self._free)} free of {len(self.indices)}")
        items = [self._free.pop() for _ in range(n)]
        self._used.update(items)
        return items

    def give_back(self, items: list[int]) -> None:
        for i in items:
            if i not in self._used:
                raise RuntimeError(f"{self.what} {i} freed twice or never allocated")
            self._used.remove(i)
        self._free.extend(reversed(items))

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free) or free & self._used or free | self._used != set(self.indices):
            raise RuntimeError(f"{self.what} pool corrupted: free and used {self.what}s overlap, repeat or are missing")


class PagePool(FreeList):
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        super().__init__(range(num_pages), "KV page", OutOfPages)
        self.num_pages = num_pages
        self.page_size = page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        return self.take(n)

    def free(self, pages: list[int]) -> None:
        self.give_back(pages)

    def reserve(self, seq: SeqCache, num_tokens: int) -> None:
        """Make sure seq has pages for `num_tokens` tokens (raises OutOfPages, allocating nothing)."""
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.alloc(need))

    def release(self, seq: SeqCache) -> None:
        """Return seq's pages; it holds nothing after."""
        self.free(seq.pages)
        seq.pages, seq.length = [], 0
