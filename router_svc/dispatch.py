"""Where each request goes (round robin), and the P/D fan-out of one request.

pd: P.Prefill and D.Generate go out together with one room id. D reserves pages and calls P's
Bootstrap; P prefills, writes the KV over Mooncake and acks D (TransferDone); D streams tokens.
round_robin: D.Generate alone with an empty prefill_addr; the replica prefills locally.
Whatever ends a room early (P fails, D fails, the client leaves) aborts it on both sides, so
their pages are freed.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from common.engine.sampling import SamplingParams
from common.service.grpc_process import peer_channel
from common.service.tls import Tls
from common.service.messages import sampling_to_proto
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc
from router_svc.errors import ApiError, from_grpc

log = logging.getLogger("router_svc")

CONTROL_RPC_TIMEOUT_S = 5.0  # Health and Abort


@dataclass(frozen=True)
class BackendHealth:
    role: str
    addr: str
    reply: pb.HealthReply | None  # None: the Health RPC failed
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.reply is not None and self.reply.ok


@dataclass
class Backend:
    role: str  # "prefill", "decode" or "replica" (a decode service that prefills locally)
    addr: str  # gRPC host:port
    channel: grpc.aio.Channel
    stub: Any  # PrefillServiceStub or DecodeServiceStub; both have Health and Abort

    @classmethod
    def connect(cls, role: str, addr: str, tls: Tls | None = None) -> Backend:
        channel = peer_channel(addr, tls)  # connects lazily, so backends may start later
        stub = pb_grpc.PrefillServiceStub(channel) if role == "prefill" else pb_grpc.DecodeServiceStub(channel)
        return cls(role, addr, channel, stub)

    @property
    def label(self) -> str:
        return f"{self.role} {self.addr}"

    async def health(self) -> BackendHealth:
        try:
            reply = await self.stub.Health(pb.HealthRequest(), timeout=CONTROL_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return BackendHealth(self.role, self.addr, None, f"{e.code().name}: {e.details()}")
        return BackendHealth(self.role, self.addr, reply)


@dataclass(frozen=True)
class Route:
    decode: Backend
    prefill: Backend | None  # None: the decode replica prefills locally


class Dispatcher:
    def __init__(self, prefills: list[Backend], decodes: list[Backend], timeout_s: float,
                 transfer_deadline_s: float):
        if not decodes:
            raise ValueError("at least one decode instance or replica is needed")
        self.backends = prefills + decodes
        self.pd = bool(prefills)
        self.timeout_s = timeout_s  # a whole request (gRPC deadlines, which the services see too)
        self.transfer_deadline_s = transfer_deadline_s  # deadline_s for P and D: bootstrap + transfer
        self._prefills = itertools.cycle(prefills) if prefills else None
        self._decodes = itertools.cycle(decodes)
        self._background: set[asyncio.Task] = set()  # aborts still in flight

    def route(self) -> Route:
        return Route(next(self._decodes), next(self._prefills) if self._prefills else None)

    async def generate(self, room: str, input_ids: list[int], sampling: SamplingParams
                       ) -> AsyncIterator[pb.GenerateChunk]:
        """Yield D's chunks for one room; raises ApiError. Must be closed (aclosing) if left early."""
        route = self.route()
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
        return list(await asyncio.gather(*(b.health() for b in self.backends)))

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=CONTROL_RPC_TIMEOUT_S)
        await asyncio.gather(*(b.channel.close() for b in self.backends))


def _log_late_prefill_failure(task: asyncio.Future) -> None:
    # Retrieves the exception (no "never retrieved" warning). A failure that ended the request
    # is logged by the frontend; one that came after D had finished is odd but harmless.
    if not task.cancelled() and task.exception() is not None:
        log.debug("prefill: %s", task.exception())
