"""The instances of one role (prefill, or decode/replica) and which of them take new requests.

An instance is out of service while its Health says ok=false (a node of it is lost: the same
moment its standard gRPC health turns NOT_SERVING) or does not answer within HEALTH_TIMEOUT_S;
the dispatcher polls every instance each HEALTH_POLL_S, so one that fails is skipped within a
few seconds and one that comes back takes requests again as soon as it answers ok. Round robin
runs over the instances in service; with none left, a request gets a 503 that says why each is
out."""
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

    @property
    def any_in_service(self) -> bool:
        return len(self._down) < len(self.backends)

    def pick(self) -> Backend:
        """The next instance in service, round robin; ApiError 503 if there is none."""
        for _ in range(len(self.backends)):
            backend = self.backends[self._next % len(self.backends)]
            self._next += 1
            if backend.addr not in self._down:
                return backend
        why = "; ".join(f"{addr}: {reason}" for addr, reason in self._down.items())
        raise ApiError(503, f"no {self.role} instance in service ({why})", NO_INSTANCE, grpc.StatusCode.UNAVAILABLE)

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
