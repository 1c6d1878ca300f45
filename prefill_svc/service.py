"""PrefillService: computes a room's prompt KV and ships it to the decode instance.

Prefill(room):
  1. validate and queue the prompt in the prefill engine (chunked, batched with other rooms)
  2. after each chunk but the last, once D's Bootstrap has come: plan + write of the target KV
     pages that chunk completed into D's pages, while the next chunk computes (off with
     --no-chunk-overlap)
  3. the engine samples the first token; the prompt's KV stays in our pages
  4. wait for D's Bootstrap (where to write), bounded by the deadline
  5. plan + write of the rest (last pages, KDA states, draft KV) into D's pages (local copy on
     one host, else Mooncake); wait for every write of the room
  6. TransferDone to D (ok + first token, or the error); free our pages; reply to the router
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.engine.engine import StepOutput
from common.engine.request import Request
from common.engine.sampling import InvalidRequest
from common.service.checks import check_bootstrap, check_room_request
from common.service.engine_loop import EngineFailure, EngineLoop
from common.service.messages import sampling_from_proto
from common.service.pool_health import pool_health
from prefill_svc.kv_sender import KVSender
from prefill_svc.room_writes import RoomWrites
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

logger = logging.getLogger("prefill")


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, loop: EngineLoop, sender: KVSender, model_name: str, default_deadline_s: float,
                 chunk_overlap: bool = True):
        self.loop = loop
        self.sender = sender
        # Send each chunk's pages as it ends (rooms of several chunks), not all after the last.
        self.page_tokens = sender.page_tokens() if chunk_overlap else 0
        self.model_name = model_name
        self.default_deadline_s = default_deadline_s
        self.bytes_sent = 0
        self.failures = 0
        # Rooms in Prefill -> abort reason ("" = not aborted). An Abort that lands while the
        # room is inside a step (its whole prompt may be one step) is seen at the next stage.
        self._rooms: dict[str, str] = {}
        self._sends: dict[str, RoomWrites] = {}  # room -> its writes into D's pages
        self._background: set[asyncio.Task] = set()

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillReply:
        req = Request(request.room, list(request.input_ids), sampling_from_proto(request.sampling))
        try:
            deadline = time.monotonic() + check_room_request(
                request.room, req.prompt_ids, req.params, ("decode_addr", request.decode_addr), request.deadline_s,
                self.default_deadline_s, self.loop.engine.runner.cfg)
        except InvalidRequest as e:  # a message no router sends: refused before anything is queued or any D told
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        outputs = self.loop.open(req.rid)
        self._rooms[req.rid] = ""
        writes = self._sends[req.rid] = RoomWrites()
        boot = None
        try:
            await self.loop.call(lambda e: e.add(req))
            out = await self._prefill(req, outputs, writes, deadline)
            boot = writes.boot = await self.sender.wait_bootstrap(req.rid, deadline)
            self._check_abort(req.rid)
            # If this handler is cancelled (the router gave up), the writes go on in their
            # threads, and our pages must not return to the pool before they have finished.
            writes.submit(self.sender.send(req, boot, writes.sent))
            moved = await writes.moved()
            logger.info("room %s: %d bytes to decode by %s, in %d writes (%d before the last chunk ended)",
                        req.rid, moved.bytes, moved.transport or "nothing", writes.early + 1, writes.early)
            self._check_abort(req.rid)
            done = pb.TransferDoneRequest(room=req.rid, ok=True, first_token=out.new_ids[0],
                                          prompt_tokens=req.prompt_len, bytes=moved.bytes,
                                          page_checksums=await self.sender.checksums(req),
                                          transfer_token=boot.transfer_token, transport=moved.transport)
            await self.sender.ack(boot.decode_addr or request.decode_addr, done, deadline - time.monotonic())
            self.bytes_sent += moved.bytes
            return pb.PrefillReply(ok=True)
        except Exception as e:  # every failure is reported to D and to the router, never dropped
            self.failures += 1
            if isinstance(e, TimeoutError):  # asyncio's is this one: the message says which wait it ended
                error = f"prefill deadline exceeded: {e}"
            elif isinstance(e, grpc.aio.AioRpcError):  # TransferDone to D: its code and details, not its repr
                error = f"TransferDone to decode {request.decode_addr} failed: {e.code().name}: {e.details()}"
            else:
                error = str(e)
            logger.warning("room %s failed: %s", req.rid, error)
            await writes.settle()  # D frees its pages when told: no write of ours may still land there
            boot = boot or self.sender.held_bootstrap(req.rid)
            if boot is not None:
                await self._nack(boot.decode_addr or request.decode_addr, req.rid, boot.transfer_token, error)
            else:  # D's bootstrap, when it comes, is refused with the error
                self.sender.abort(req.rid, error)
            return pb.PrefillReply(ok=False, error=error)
        finally:
            self.loop.close(req.rid)
            await writes.settle()
            self._rooms.pop(req.rid, None)
            self._sends.pop(req.rid, None)
            await self.loop.release(lambda e: e.abort(req.rid) or e.release(req))

    async def _prefill(self, req: Request, outputs: asyncio.Queue, writes: RoomWrites, deadline: float) -> StepOutput:
        """The engine's output that ends the room's prefill (its first token). After each chunk
        before it, the target KV pages that are whole are sent on, if D's bootstrap is here."""
        while True:
            try:
                out = await asyncio.wait_for(outputs.get(), deadline - time.monotonic())
            except TimeoutError:
                raise TimeoutError(f"{req.cache.length} of {req.prompt_len} prompt tokens prefilled") from None
            if isinstance(out, EngineFailure):
                raise out
            self._check_abort(req.rid)
            if out.prefill_done:
                return out
            if out.finished:
                raise RuntimeError(f"room {req.rid} was aborted during prefill")
            whole = out.cached // self.page_tokens * self.page_tokens if self.page_tokens else 0
            boot = self.sender.held_bootstrap(req.rid)
            if boot is not None and whole > writes.sent:
                writes.submit(self.sender.send_pages(req, boot, range(writes.sent, whole), out.ready))
                writes.sent = whole

    def _check_abort(self, room: str) -> None:
        if self._rooms.get(room):
            raise RuntimeError(f"room {room} aborted: {self._rooms[room]}")

    async def _nack(self, decode_addr: str, room: str, token: str, error: str) -> None:
        if not decode_addr:
            return
        try:
            await self.sender.ack(decode_addr, pb.TransferDoneRequest(room=room, ok=False, error=error,
                                                                      transfer_token=token), 2.0)
        except Exception:  # D may be the one that is gone; the router fails the request anyway
            pass

    async def Bootstrap(self, request: pb.BootstrapRequest, context) -> pb.BootstrapReply:
        try:
            check_bootstrap(request)
        except InvalidRequest as e:  # never stored: no write is ever planned from it
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        refused = self.sender.bootstrap(request)
        return pb.BootstrapReply(ok=not refused, error=refused)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortReply:
        """Stop the room wherever it is. Answers once no write of its KV into D's pages is in flight
        or will start (D frees those pages when we answer)."""
        live = request.room in self._rooms  # only then can the engine hold it
        if live:
            self._rooms[request.room] = request.reason or "by request"
            # Out of the engine's queue before its next step; not awaited: the engine thread takes
            # calls between steps only, and one prefill step can take seconds.
            task = asyncio.ensure_future(self.loop.abort(request.room))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        found = self.sender.abort(request.room, request.reason)
        writes = self._sends.get(request.room)
        if writes is not None:
            await writes.settle()
        return pb.AbortReply(found=live or found)

    async def Health(self, request, context) -> pb.HealthReply:
        return pb.HealthReply(ok=self.loop.out_of_service is None, role="prefill",
                              running=len(self.loop.engine.prefilling), model=self.model_name,
                              mooncake_session=self.sender.ranks.mooncake.session_id,
                              # a bootstrap held for a room still prefilling is not claimed yet
                              awaiting_bootstrap=sum(w.boot is None and self.sender.held_bootstrap(room) is None
                                                     for room, w in self._sends.items()),
                              writing=sum(w.in_flight for w in self._sends.values()),
                              **pool_health(self.loop.engine))
