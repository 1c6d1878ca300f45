"""The writes of one room's KV into D's pages: one per prefill chunk (the pages it completed, sent
while the next chunk computes) and the last one (the rest, after the last chunk). D may decode,
and the room's pages on either side may be reused, only once none of them is in flight."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from common.transfer.writer import Moved
from protos import pdflash_pb2 as pb


@dataclass
class RoomWrites:
    sent: int = 0  # prompt tokens whose target KV pages have been submitted
    boot: pb.BootstrapRequest | None = None  # D's bootstrap (where the writes go), once the room has claimed it
    _writes: list[asyncio.Future] = field(default_factory=list)

    @property
    def in_flight(self) -> bool:
        return any(not w.done() for w in self._writes)

    @property
    def early(self) -> int:
        """Writes submitted before the last chunk ended: all but the last, once it is submitted."""
        return max(len(self._writes) - 1, 0)

    def submit(self, write: Coroutine[Any, Any, Moved]) -> None:
        self._writes.append(asyncio.ensure_future(write))

    async def moved(self) -> Moved:
        """What every write moved, once all have ended; the first failure raised, if any. Shielded:
        a caller cancelled here leaves the writes running (`settle` waits for them)."""
        await self.settle()
        total = Moved()
        for w in self._writes:
            total += w.result()
        return total

    async def settle(self) -> None:
        """Until no write is in flight, whatever each ended with."""
        pending = {w for w in self._writes if not w.done()}
        if pending:
            await asyncio.shield(asyncio.wait(pending))
        for w in self._writes:
            w.cancelled() or w.exception()  # retrieved: no "never retrieved" warning
