"""D's side of a KV handoff: reserve pages, bootstrap P, wait for its ack.

1. reserve pages for the request's whole budget (waiting for free pages until the deadline)
2. Bootstrap(P): our Mooncake session, our buffers and the pages reserved for this room (and,
   offering local transfer, how a process on each rank's host opens that rank's buffers)
3. wait for TransferDone from P (status, first token), bounded by the deadline
The caller then hands the request, its cache now holding the prompt, to the decode engine.

If the room ends after step 2 without word from P (abort, deadline, the router gone), P may
still write the prompt's KV into the room's pages: they stay out of the pool until P's Abort
confirms it will not (or P is unreachable), so that no other room gets them and the late bytes.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field

import grpc

from common.engine.request import Request
from common.kv.buffers import RankEndpoint, RoomBuffers
from common.kv.page_pool import OutOfPages
from common.kv.seq_cache import SeqCache
from common.service.engine_loop import EngineFailure, EngineLoop
from common.service.grpc_process import peer_channel
from common.service.tls import Tls
from common.transfer.wire import ranks_to_protos, room_to_protos
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

logger = logging.getLogger("decode")

PEER_ABORT_TIMEOUT_S = 10.0  # default per attempt; P answers Abort once no write of the room is in flight


class HandoffError(Exception):
    """The KV handoff failed; `code` is the gRPC status the client should see."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class KVReceiver:
    loop: EngineLoop
    session_id: str  # our Mooncake session "host:port" (rank 0's)
    self_addr: str  # our gRPC address, for P's TransferDone
    ranks: list[RankEndpoint] = field(default_factory=list)  # every TP rank's buffers (rank 0 first)
    tp: int = 1
    peer_abort_timeout_s: float = PEER_ABORT_TIMEOUT_S  # one attempt at P's Abort of a room we gave up on
    tls: Tls | None = None  # mutual TLS towards P

    def __post_init__(self) -> None:
        self._acks: dict[str, asyncio.Future] = {}
        self._waiting: dict[str, tuple[str, int]] = {}  # room -> (its transfer token, prompt tokens)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._parked: set[asyncio.Task] = set()  # releases waiting for P's Abort reply
        self.loop.on_out_of_service(self._fail_waiting)

    async def receive(self, req: Request, prefill_addr: str, deadline: float) -> int:
        """Returns the first token sampled by P. On failure raises HandoffError, or EngineFailure
        once the instance is out of service; the caller releases the pages (also reserved ones)
        by aborting the request."""
        await self._reserve(req, deadline)
        ack = asyncio.get_running_loop().create_future()
        self._acks[req.rid] = ack
        token = secrets.token_hex(16)  # only the P we bootstrap learns it
        self._waiting[req.rid] = (token, req.prompt_len)
        try:
            try:
                await self._bootstrap(req, prefill_addr, token, deadline)
                done: pb.TransferDoneRequest = await asyncio.wait_for(ack, _left(deadline))
            except asyncio.TimeoutError:
                raise HandoffError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"KV transfer from prefill {prefill_addr} did not finish within the deadline")
            finally:
                if not _heard_from(ack):  # the room ends here, and P may still write into its pages
                    self._park(req, prefill_addr)
            if not done.ok:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"prefill {prefill_addr} failed: {done.error}")
            if done.page_checksums:
                await self._verify(req, list(done.page_checksums))
            req.transfer_bytes = done.bytes
            req.transfer_transport = done.transport
            return done.first_token
        finally:
            self._acks.pop(req.rid, None)
            self._waiting.pop(req.rid, None)

    def transfer_done(self, msg: pb.TransferDoneRequest, vocab_size: int) -> None:
        """Wake the room's receive with P's word; raises HandoffError (and changes nothing) for a
        room not waiting (unknown, or already answered), a sender that is not the P we
        bootstrapped (the token), or an ack that cannot be true."""
        ack = self._acks.get(msg.room)
        if ack is None or ack.done():
            raise HandoffError(grpc.StatusCode.NOT_FOUND, f"room {msg.room[:128]!r} is not waiting for a transfer")
        token, prompt_tokens = self._waiting[msg.room]
        if not hmac.compare_digest(msg.transfer_token.encode(), token.encode()):
            raise HandoffError(grpc.StatusCode.PERMISSION_DENIED,
                               f"room {msg.room}: TransferDone without the token of the bootstrapped prefill")
        if msg.ok and not (0 <= msg.first_token < vocab_size and msg.prompt_tokens == prompt_tokens):
            raise HandoffError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"room {msg.room}: first token {msg.first_token} (vocabulary {vocab_size}) or "
                               f"prompt tokens {msg.prompt_tokens} (expected {prompt_tokens}) is wrong")
        ack.set_result(msg)

    def abort(self, room: str, reason: str) -> bool:
        ack = self._acks.get(room)
        if ack is None or ack.done():
            return False
        ack.set_exception(HandoffError(grpc.StatusCode.ABORTED, f"aborted: {reason or 'by request'}"))
        return True

    def _fail_waiting(self, error: EngineFailure) -> None:
        """The instance is out of service (a rank of it died): the rooms waiting for their KV fail
        now with its reason, as the rooms decoding do, not later with the connection reset of its
        exit. Their pages are parked (P is asked to abort) and go with the instance."""
        for ack in self._acks.values():
            if not ack.done():
                ack.set_exception(EngineFailure(str(error)))

    async def _verify(self, req: Request, expected: list[int]) -> None:
        got = await asyncio.to_thread(self.loop.engine.room_checksums, req)
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

    async def _bootstrap(self, req: Request, prefill_addr: str, token: str, deadline: float) -> None:
        engine = self.loop.engine
        pages = engine.room_pages(req)
        msg = pb.BootstrapRequest(
            room=req.rid, session_id=self.session_id, tp_rank=0, tp_size=self.tp, decode_addr=self.self_addr,
            buffers=room_to_protos(RoomBuffers(engine.describe_buffers(), pages)),
            ranks=ranks_to_protos(self.ranks, pages), transfer_token=token)
        stub = pb_grpc.PrefillServiceStub(self._channel(prefill_addr))
        try:
            # wait_for_ready: as for P's TransferDone (a P just restarted is waited for, not refused)
            reply = await stub.Bootstrap(msg, timeout=max(_left(deadline), 0.001), wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            code = e.code() if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else grpc.StatusCode.UNAVAILABLE
            raise HandoffError(code, f"bootstrap to prefill {prefill_addr} failed: {e.details()}")
        if not reply.ok:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"prefill {prefill_addr} refused bootstrap: {reply.error}")

    def _park(self, req: Request, prefill_addr: str) -> None:
        """Take the room's pages away from req (the caller's release then frees nothing) and
        free them once P has answered Abort, i.e. no write of this room is or will be in flight."""
        parked = Request(req.rid, req.prompt_ids, req.params, cache=req.cache, draft_cache=req.draft_cache)
        req.cache, req.draft_cache = SeqCache(), SeqCache()
        task = asyncio.ensure_future(self._release_after_peer_abort(parked, prefill_addr))
        self._parked.add(task)
        task.add_done_callback(self._parked.discard)

    async def _release_after_peer_abort(self, parked: Request, prefill_addr: str) -> None:
        # Cancelled only when the service stops: then there is no pool to give pages back to.
        since = time.monotonic()
        await self._peer_abort_confirmed(parked.rid, prefill_addr)
        await self.loop.release(lambda e: e.release(parked))
        held = time.monotonic() - since
        if held > self.peer_abort_timeout_s:
            logger.info("room %s: its pages are back in the pool after %.0f s parked", parked.rid, held)

    async def _peer_abort_confirmed(self, room: str, prefill_addr: str) -> None:
        """Returns once P has answered Abort, i.e. no write of the room is in flight, which can be
        long after the room's deadline (Mooncake cannot cancel a write; P waits until what it
        submitted has finished or failed), or once P is unreachable (gone: it writes nothing
        more). A P that does not answer in time is asked again: it may be stalled, not dead, and
        its queued bytes still land when it resumes."""
        stub = pb_grpc.PrefillServiceStub(self._channel(prefill_addr))
        abort = pb.AbortRequest(room=room, reason="decode gave up on the room")
        for attempt in itertools.count():
            try:
                await stub.Abort(abort, timeout=self.peer_abort_timeout_s)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    return
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    logger.warning("room %s: prefill %s failed the abort (%s: %s); freeing its pages",
                                   room, prefill_addr, e.code().name, e.details())
                    return
                if attempt % max(1, round(60 / self.peer_abort_timeout_s)) == 0:  # once a minute
                    logger.warning("room %s: prefill %s has not confirmed the abort for %.0f s; its pages stay "
                                   "out of the pool until it does", room, prefill_addr,
                                   (attempt + 1) * self.peer_abort_timeout_s)

    def _channel(self, addr: str) -> grpc.aio.Channel:
        if addr not in self._channels:
            self._channels[addr] = peer_channel(addr, self.tls)
        return self._channels[addr]


def _heard_from(ack: asyncio.Future) -> bool:
    """P sent TransferDone (ok or not): it is done with the room."""
    return ack.done() and not ack.cancelled() and ack.exception() is None


def _left(deadline: float) -> float:
    return deadline - time.monotonic()
