"""The instances of one role (prefill, or decode/replica) and which of them take new requests.

An instance is out of service while its Health says ok=false (a node of it is lost: the same
moment its standard gRPC health turns NOT_SERVING) or does not answer within HEALTH_TIMEOUT_S;
the dispatcher polls every instance each HEALTH_POLL_S, so one that fails is skipped within a
few seconds and one that comes back takes requests again as soon as it answers ok. A request goes
to the instance in service with the fewest of this router's rooms in flight, round robin among
equals; with none in service, it gets a 503 that says why each is out.

Why not plain round robin: it gives an instance that is behind (a long prompt in its queue, a
slow host) as many new rooms as an idle one, and with as many P as D instances it paired P i
with D i for good, so a slow D failed the rooms of the same P every time and the two could not
be told apart."""
from __future__ import annotations

import asyncio
import logging

import grpc

from router_svc.backend import Backend, BackendHealth
from router_svc.errors import ApiError

log = logging.getLogger("router_svc")

HEALTH_POLL_S = 1.0
# Short enough that a frozen or unreachable instance is out within a few seconds; a loaded one
# that misses it is out until its next answer (and is asked again before a request is refused).
HEALTH_TIMEOUT_S = 2.0
NO_INSTANCE = "no_instance_in_service"  # the error type a client sees


class Instances:
    def __init__(self, role: str, backends: list[Backend]):
        self.role = role
        self.backends = backends
        self._down: dict[str, str] = {}  # address -> why it is out of service
        self._next = 0  # round robin position
        self.rooms = dict.fromkeys((b.addr for b in backends), 0)  # address -> rooms in flight there

    @property
    def any_in_service(self) -> bool:
        return len(self._down) < len(self.backends)

    def pick(self, index: int | None = None) -> Backend:
        """The instance in service with the fewest rooms in flight, the next in round robin order
        among those, or the `index`th if given (a pinned route); counts a room on it until
        `done`. ApiError 503 if none (or the pinned one) is in service."""
        if index is not None:
            return self._take(self.backends[index])
        n = len(self.backends)
        order = [self.backends[(self._next + i) % n] for i in range(n)]
        live = [b for b in order if b.addr not in self._down]
        if not live:
            # "ROLE ADDR: ..." as every error that names a backend (errors.from_grpc)
            why = "; ".join(f"{self.role} {addr}: {reason}" for addr, reason in self._down.items())
            raise ApiError(503, f"no {self.role} instance in service ({why})", NO_INSTANCE,
                           grpc.StatusCode.UNAVAILABLE)
        backend = min(live, key=lambda b: self.rooms[b.addr])  # the first of the least loaded
        self._next = self.backends.index(backend) + 1
        return self._take(backend)

    def _take(self, backend: Backend) -> Backend:
        why = self._down.get(backend.addr)
        if why is not None:
            raise ApiError(503, f"{self.role} {backend.addr} is not in service ({why})", NO_INSTANCE,
                           grpc.StatusCode.UNAVAILABLE)
        self.rooms[backend.addr] += 1
        return backend

    def done(self, backend: Backend) -> None:
        """A room `pick` gave `backend` is over there."""
        self.rooms[backend.addr] -= 1

    async def poll(self, timeout: float = HEALTH_TIMEOUT_S) -> list[BackendHealth]:
        """Ask every instance's Health at once and take the answers as they are."""
        answers = list(await asyncio.gather(*(b.health(timeout) for b in self.backends)))
        for h in answers:
            self.update(h)
        return answers

    def update(self, h: BackendHealth) -> None:
        if h.ok:
            if self._down.pop(h.addr, None) is not None:
                log.info("%s %s is back in service", self.role, h.addr)
            return
        why = h.error or "its Health says it is not ok (out of service)"
        if h.addr not in self._down:
            log.warning("%s %s is out of service, not routing to it: %s", self.role, h.addr, why)
        self._down[h.addr] = why
