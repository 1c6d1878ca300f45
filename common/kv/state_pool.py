"""Slots of fixed-size per-request state (the recurrent state and convolution windows of KDA
layers). Pure Python, like the page pool: which slot is whose; the runner owns the tensors.

A request holds one slot (the same index in every KDA layer's state) from admission to its
end, across all its prefill chunks; the slot is not paged and does not grow. Slot 0 is never
handed out: padding rows of static (CUDA graph) steps read and write it. SGLang's equivalent is
the MambaPool behind its HybridReqToTokenPool, sized by --max-mamba-cache-size or
--mamba-full-memory-ratio.
"""
from __future__ import annotations

from common.kv.page_pool import FreeList, OutOfPages


class OutOfStateSlots(OutOfPages):
    """Raised when no state slot is free; nothing is allocated. An OutOfPages (no room for the
    request's cache) so that admission, which waits on that, waits for a slot just the same."""


class StatePool(FreeList):
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots ({num_slots}) must be positive")
        super().__init__(range(1, num_slots + 1), "state slot", OutOfStateSlots)  # never slot 0
        self.num_slots = num_slots

    def alloc(self) -> int:
        return self.take(1)[0]

    def free(self, slot: int) -> None:
        self.give_back([slot])
