"""One rank's writes of a room: to each D rank whose buffers are open on this host by local copy
(common/transfer/local.py), to every other over Mooncake. Which one each took is reported."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.kv.shared import SharedRegion
from common.transfer.local import LocalWriter
from common.transfer.mooncake import MooncakeEngine
from common.transfer.plan import Writes

LOCAL, MOONCAKE = "local", "mooncake"

Peers = Mapping[str, Sequence[SharedRegion]]  # D rank's Mooncake session -> its buffers (opened where on our host)


@dataclass(frozen=True)
class Moved:
    """Bytes written and the transports that carried them."""

    bytes: int = 0
    transports: frozenset[str] = frozenset()

    def __add__(self, other: "Moved") -> "Moved":
        return Moved(self.bytes + other.bytes, self.transports | other.transports)

    @property
    def transport(self) -> str:
        """"local", "mooncake", both joined by "+", or "" when nothing was written."""
        return "+".join(sorted(self.transports))


@dataclass
class RankWriter:
    mooncake: MooncakeEngine
    local: LocalWriter | None = None  # None: local transfer is off on this instance

    def write(self, writes: Writes, peers: Peers) -> Moved:
        moved = Moved()
        for session, entries in writes:
            regions = peers.get(session)
            if regions and self.local is not None and self.local.open(session, regions):
                moved += Moved(self.local.write(session, entries), frozenset({LOCAL}))
            else:
                moved += Moved(self.mooncake.write(session, entries), frozenset({MOONCAKE}))
        return moved
