"""Page allocator for paged KV caches. Pure Python: no model, no tensors, testable anywhere.

A page holds `page_size` consecutive tokens of one request. Requests own pages through a page
table (a list of page indices in token order); the pool only tracks which pages are free.
"""
from __future__ import annotations

from common.kv.seq_cache import SeqCache


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free; nothing is allocated."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page indices are handed out first, which keeps a fresh
        # request's pages contiguous (fewer, larger transfer entries).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
        self._free.extend(reversed(pages))

    def reserve(self, seq: SeqCache, num_tokens: int) -> None:
        """Make sure seq has pages for `num_tokens` tokens (raises OutOfPages, allocating nothing)."""
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.alloc(need))

    def release(self, seq: SeqCache) -> None:
        """Return seq's pages; it holds nothing after."""
        self.free(seq.pages)
        seq.pages, seq.length = [], 0

    def check_integrity(self) -> None:
        if len(self._free) + len(self._used) != self.num_pages or set(self._free) & self._used:
            raise RuntimeError("page pool corrupted: free and used pages overlap or are missing")
