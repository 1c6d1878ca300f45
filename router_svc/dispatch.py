"""Where each request goes (round robin over the instances in service), and the P/D fan-out of
one request.

pd: P.Prefill and D.Generate go out together with one room id. D reserves pages and calls P's
Bootstrap; P prefills, writes the KV over Mooncake and acks D (TransferDone); D streams tokens.
round_robin: D.Generate alone with an empty prefill_addr; the replica prefills locally.
Whatever ends a room early (P fails, D fails, the client leaves) aborts it on both sides, so
their pages are freed.

For tests and debugging, a router started with --allow-route-header lets a request name its
instances (ROUTE_HEADER, e.g. `X-PDflash-Route: p=1,d=2`: 0-based, in the order of --prefill
and --decode), so that every P/D pair of a mixed fleet can be exercised on purpose.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from common.engine.sampling import InvalidRequest, SamplingParams
from common.service.messages import sampling_to_proto
from protos import pdflash_pb2 as pb
from router_svc.backend import CONTROL_RPC_TIMEOUT_S, Backend, BackendHealth
from router_svc.errors import ApiError, from_grpc
from router_svc.instances import HEALTH_POLL_S, Instances

log = logging.getLogger("router_svc")

ROUTE_HEADER = "X-PDflash-Route"


@dataclass(frozen=True)
class Route:
    decode: Backend
    prefill: Backend | None  # None: the decode replica prefills locally


@dataclass(frozen=True)
class Pin:
    """The instances a request must go to (ROUTE_HEADER): indices into the prefill and the
    decode (or replica) instances; None leaves that role to the balancer."""
    prefill: int | None = None
    decode: int | None = None


class Dispatcher:
    def __init__(self, prefills: list[Backend], decodes: list[Backend], timeout_s: float,
                 transfer_deadline_s: float, allow_pins: bool = False):
        if not decodes:
            raise ValueError("at least one decode instance or replica is needed")
        self.backends = prefills + decodes
        self.pd = bool(prefills)
        self.timeout_s = timeout_s  # a whole request (gRPC deadlines, which the services see too)
        self.transfer_deadline_s = transfer_deadline_s  # deadline_s for P and D: bootstrap + transfer
        self.allow_pins = allow_pins  # ROUTE_HEADER is accepted (--allow-route-header)
        self._roles = [Instances("prefill", prefills)] if prefills else []
        self._roles.append(Instances(decodes[0].role, decodes))
        self._background: set[asyncio.Task] = set()  # aborts still in flight
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        """Poll every instance's health from now on (on the running event loop)."""
        self._poller = asyncio.ensure_future(self._poll_forever())

    def pin(self, header: str | None) -> Pin | None:
        """The instances ROUTE_HEADER names (`p=I,d=J`, either may be left out); None without
        the header. Raises InvalidRequest if pins are not allowed or the header is malformed."""
        if header is None:
            return None
        if not self.allow_pins:
            raise InvalidRequest(f"{ROUTE_HEADER} is accepted only by a router started with --allow-route-header")
        counts = {"p": len(self._roles[0].backends) if self.pd else 0, "d": len(self._roles[-1].backends)}
        picks: dict[str, int] = {}
        for part in header.split(","):
            role, _, value = part.strip().partition("=")
            if role not in counts or role in picks or not (value.isascii() and value.isdigit()) \
                    or int(value) >= counts[role]:
                raise InvalidRequest(f"{ROUTE_HEADER}: {header!r} is not p=I,d=J with 0 <= I < {counts['p']} "
                                     f"prefill and 0 <= J < {counts['d']} decode instances")
            picks[role] = int(value)
        return Pin(picks.get("p"), picks.get("d"))

    def route(self, pin: Pin | None = None) -> Route:
        """A decode instance (or replica) and, in pd, a prefill instance, each in service and the
        least busy of its role (instances.py) unless `pin` names it, each counting the room until
        its `done` is called; raises ApiError 503 if a role has none (or the pinned one is out)."""
        pin = pin or Pin()
        decode = self._roles[-1].pick(pin.decode)
        try:
            return Route(decode, self._roles[0].pick(pin.prefill) if self.pd else None)
        except ApiError:
            self._roles[-1].done(decode)
            raise

    async def generate(self, room: str, input_ids: list[int], sampling: SamplingParams, pin: Pin | None = None
                       ) -> AsyncIterator[pb.GenerateChunk]:
        """Yield D's chunks for one room; raises ApiError. Must be closed (aclosing) if left early."""
        # A role with every instance out asks them once more before the request is refused: one
        # may be back since the last poll.
        await asyncio.gather(*(r.poll() for r in self._roles if not r.any_in_service))
        route = self.route(pin)
        params = sampling_to_proto(sampling)
        call = route.decode.stub.Generate(pb.GenerateRequest(
            room=room, input_ids=input_ids, sampling=params,
            prefill_addr=route.prefill.addr if route.prefill else "", deadline_s=self.transfer_deadline_s),
            timeout=self.timeout_s)
        prefill = None
        if route.prefill is not None:
            prefill = asyncio.ensure_future(self._prefill(route.prefill, pb.PrefillRequest(
                room=room, input_ids=input_ids, sampling=params, decode_addr=route.decode.addr,
                deadline_s=self.transfer_deadline_s)))
            prefill.add_done_callback(_log_late_prefill_failure)
            prefill.add_done_callback(lambda _, p=route.prefill: self._roles[0].done(p))
        finished, reason = False, "cancelled: the client left or the router is stopping"
        try:
            chunk = await self._first_chunk(call, prefill)
            while chunk is not grpc.aio.EOF:
                finished = finished or chunk.finished
                yield chunk
                chunk = await call.read()
            if not finished:
                raise ApiError(502, f"{route.decode.label}: the stream ended without a last chunk",
                               "backend_error", grpc.StatusCode.INTERNAL)
        except grpc.aio.AioRpcError as e:
            err = from_grpc(e, route.decode.label)
            reason = err.message
            raise err from None
        except ApiError as e:
            reason = e.message
            raise
        finally:
            self._roles[-1].done(route.decode)
            if not finished:
                call.cancel()
                if prefill is not None:
                    prefill.cancel()
                self._spawn(self._abort(route, room, reason))

    async def _first_chunk(self, call: Any, prefill: asyncio.Future | None) -> Any:
        """D's first chunk, or P's error if P fails first: D would otherwise wait for an ack that
        never comes until its deadline. Raises AioRpcError (D) or ApiError (P)."""
        read = asyncio.ensure_future(call.read())
        try:
            if prefill is not None:
                await asyncio.wait({read, prefill}, return_when=asyncio.FIRST_COMPLETED)
                if prefill.done():
                    prefill.result()  # raises P's error; on success only D is left to wait for
            return await read
        finally:
            read.cancel()  # no-op when done

    async def _prefill(self, backend: Backend, req: pb.PrefillRequest) -> None:
        try:
            reply = await backend.stub.Prefill(req, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e, backend.label) from None
        if not reply.ok:
            # PrefillReply carries no status code; a failed transfer or bootstrap is the usual cause.
            raise ApiError(502, f"{backend.label}: {reply.error or 'prefill failed'}", "prefill_failed",
                           grpc.StatusCode.UNAVAILABLE)

    async def _abort(self, route: Route, room: str, reason: str) -> None:
        req = pb.AbortRequest(room=room, reason=reason)
        targets = [b for b in (route.decode, route.prefill) if b is not None]
        results = await asyncio.gather(*(b.stub.Abort(req, timeout=CONTROL_RPC_TIMEOUT_S) for b in targets),
                                       return_exceptions=True)
        for backend, result in zip(targets, results):
            if isinstance(result, Exception):
                why = result.details() if isinstance(result, grpc.aio.AioRpcError) else repr(result)
                log.warning("abort of room %s on %s failed: %s", room, backend.label, why)

    def _spawn(self, coro: Coroutine) -> None:
        # Not awaited here: this runs in `finally` of a generator that may be closing because
        # its task was cancelled (client gone), where awaiting would be cancelled too.
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def health(self) -> list[BackendHealth]:
        """Every instance's Health now; what it says also decides which instances take requests."""
        answers = await asyncio.gather(*(r.poll(CONTROL_RPC_TIMEOUT_S) for r in self._roles))
        return [h for role in answers for h in role]

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(r.poll() for r in self._roles))
            await asyncio.sleep(HEALTH_POLL_S)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._background:
            await asyncio.wait(self._background, timeout=CONTROL_RPC_TIMEOUT_S)
        await asyncio.gather(*(b.channel.close() for b in self.backends))


def _log_late_prefill_failure(task: asyncio.Future) -> None:
    # Retrieves the exception (no "never retrieved" warning). A failure that ended the request
    # is logged by the frontend; one that came after D had finished is odd but harmless.
    if not task.cancelled() and task.exception() is not None:
        log.debug("prefill: %s", task.exception())
