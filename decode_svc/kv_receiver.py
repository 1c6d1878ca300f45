"""D's side of a KV handoff: reserve pages, bootstrap P, wait for its ack.

1. reserve pages for the request's whole budget (waiting for free pages until the deadline)
2. Bootstrap(P): our Mooncake session, our buffers and the pages reserved for this room
3. wait for TransferDone from P (status, first token), bounded by the deadline
The caller then hands the request, its cache now holding the prompt, to the decode engine.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from common.buffers import RoomBuffers
from common.engine_loop import EngineLoop
from common.kv_checksum import room_checksums
from common.page_pool import OutOfPages
from common.request import Request
from common.wire import room_to_protos
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc


class HandoffError(Exception):
    """The KV handoff failed; `code` is the gRPC status the client should see."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class KVReceiver:
    loop: EngineLoop
    session_id: str  # our Mooncake session "host:port"
    self_addr: str  # our gRPC address, for P's TransferDone

    def __post_init__(self) -> None:
        self._acks: dict[str, asyncio.Future] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def receive(self, req: Request, prefill_addr: str, deadline: float) -> int:
        """Returns the first token sampled by P. On failure raises HandoffError; the caller
        releases the pages (also reserved ones) by aborting the request."""
        await self._reserve(req, deadline)
        ack = asyncio.get_running_loop().create_future()
        self._acks[req.rid] = ack
        try:
            await self._bootstrap(req, prefill_addr, deadline)
            try:
                done: pb.TransferDoneRequest = await asyncio.wait_for(ack, _left(deadline))
            except asyncio.TimeoutError:
                raise HandoffError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"KV transfer from prefill {prefill_addr} did not finish within the deadline")
            if not done.ok:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"prefill {prefill_addr} failed: {done.error}")
            if done.page_checksums:
                await self._verify(req, list(done.page_checksums))
            req.transfer_bytes = done.bytes
            return done.first_token
        finally:
            self._acks.pop(req.rid, None)

    def transfer_done(self, msg: pb.TransferDoneRequest) -> bool:
        ack = self._acks.get(msg.room)
        if ack is None or ack.done():
            return False
        ack.set_result(msg)
        return True

    def abort(self, room: str, reason: str) -> bool:
        ack = self._acks.get(room)
        if ack is None or ack.done():
            return False
        ack.set_exception(HandoffError(grpc.StatusCode.ABORTED, f"aborted: {reason or 'by request'}"))
        return True

    async def _verify(self, req: Request, expected: list[int]) -> None:
        engine = self.loop.engine
        got = await asyncio.to_thread(room_checksums, engine.kv_tensors(), engine.room_pages(req), req.prompt_len)
        bad = sum(a != b for a, b in zip(got, expected)) + abs(len(got) - len(expected))
        if bad:
            raise HandoffError(grpc.StatusCode.DATA_LOSS,
                               f"KV transfer corrupted: {bad} of {len(expected)} page checksums differ")
        req.verified_pages = len(got)

    async def _reserve(self, req: Request, deadline: float) -> None:
        def reserve(engine) -> bool:
            try:
                engine.reserve(req)
                return True
            except OutOfPages:
                return False

        while not await self.loop.call(reserve):
            if _left(deadline) <= 0:
                raise HandoffError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"no free KV pages for {req.budget} tokens before the deadline")
            await asyncio.sleep(0.01)

    async def _bootstrap(self, req: Request, prefill_addr: str, deadline: float) -> None:
        engine = self.loop.engine
        msg = pb.BootstrapRequest(
            room=req.rid, session_id=self.session_id, tp_rank=0, tp_size=1, decode_addr=self.self_addr,
            buffers=room_to_protos(RoomBuffers(engine.describe_buffers(), engine.room_pages(req))))
        stub = pb_grpc.PrefillServiceStub(self._channel(prefill_addr))
        try:
            reply = await stub.Bootstrap(msg, timeout=max(_left(deadline), 0.001))
        except grpc.aio.AioRpcError as e:
            code = e.code() if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else grpc.StatusCode.UNAVAILABLE
            raise HandoffError(code, f"bootstrap to prefill {prefill_addr} failed: {e.details()}")
        if not reply.ok:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"prefill {prefill_addr} refused bootstrap: {reply.error}")

    def _channel(self, addr: str) -> grpc.aio.Channel:
        if addr not in self._channels:
            self._channels[addr] = grpc.aio.insecure_channel(addr)
        return self._channels[addr]


def _left(deadline: float) -> float:
    return deadline - time.monotonic()
