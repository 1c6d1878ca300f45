"""Slots of fixed-size per-request state (the recurrent state and convolution windows of KDA
layers). Pure Python, like the page pool: which slot is whose; the runner owns the tensors.

A request holds one slot (the same index in every KDA layer's state) from admission to its
end, across all its prefill chunks; the slot is not paged and does not grow. Slot 0 is never
handed out: padding rows of static (CUDA graph) steps read and write it. SGLang's equivalent is
the MambaPool behind its HybridReqToTokenPool, sized by --max-mamba-cache-size or
--mamba-full-memory-ratio.
"""
from __future__ import annotations

from common.kv.page_pool import OutOfPages


class OutOfStateSlots(OutOfPages):
    """Raised when no state slot is free; nothing is allocated. An OutOfPages (no room for the
    request's cache) so that admission, which waits on that, waits for a slot just the same."""


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots ({num_slots}) must be positive")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots, 0, -1))  # slots 1..num_slots; pop gives 1 first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfStateSlots(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        if (len(self._free) + len(self._used) != self.num_slots or set(self._free) & self._used
                or 0 in self._used or 0 in self._free):
            raise RuntimeError("state pool corrupted: free and used slots overlap, are missing or include slot 0")
