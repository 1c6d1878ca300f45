"""DecodeService: streams a room's tokens.

Generate(room):
  1. validate the request                                   (INVALID_ARGUMENT on bad input)
  2. PD: receive the prompt's KV from P (kv_receiver)       colocated: queue a local prefill
  3. decode in the shared batch (engine thread), streaming token and text deltas
  4. last chunk carries meta_info; on any exit the room's pages return to the pool
"""
from __future__ import annotations

import logging
import time

import grpc

from common.engine.meta import meta_info
from common.engine.request import Request
from common.engine.sampling import InvalidRequest
from common.model.tokenizer import IncrementalDecoder, Tokenizer
from common.service.checks import check_room_request
from common.service.engine_loop import EngineFailure, EngineLoop
from common.service.messages import meta_to_proto, sampling_from_proto
from common.service.pool_health import pool_health
from decode_svc.kv_receiver import HandoffError, KVReceiver
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

logger = logging.getLogger("decode")


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer, receiver: KVReceiver | None,
                 role: str, model_name: str, default_deadline_s: float):
        self.loop = loop
        self.tokenizer = tokenizer
        self.receiver = receiver  # None: this instance only prefills locally
        self.role = role
        self.model_name = model_name
        self.default_deadline_s = default_deadline_s

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        params = sampling_from_proto(request.sampling)
        try:
            deadline = time.monotonic() + check_room_request(
                request.room, list(request.input_ids), params, ("prefill_addr", request.prefill_addr),
                request.deadline_s, self.default_deadline_s, self.loop.engine.runner.cfg)
        except InvalidRequest as e:  # a message no router sends: refused before any page is reserved or any P asked
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        req = Request(request.room, list(request.input_ids), params, IncrementalDecoder(self.tokenizer, params.stop))
        outputs = self.loop.open(req.rid)
        try:
            if request.prefill_addr:
                if self.receiver is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this instance has no KV receiver")
                first = await self._handoff(req, request.prefill_addr, deadline, context)
                await self.loop.call(lambda e: self.loop.emit(e.add_prefilled(req, first)))
            else:
                try:
                    await self.loop.call(lambda e: e.add(req))
                except InvalidRequest as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            while True:
                out = await outputs.get()
                if isinstance(out, EngineFailure):
                    raise out
                chunk = pb.GenerateChunk(room=req.rid, token_ids=out.new_ids, text=out.text, finished=out.finished)
                if out.finished:
                    if req.finish_reason == "abort":
                        await context.abort(grpc.StatusCode.ABORTED, f"room {req.rid} was aborted")
                    chunk.meta.CopyFrom(meta_to_proto(meta_info(req)))
                    yield chunk
                    return
                yield chunk
        except EngineFailure as e:  # a step failed, or the instance is out of service (waiting rooms too)
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            # Whatever ended the stream (finish, error, client gone), the room's pages go back.
            self.loop.close(req.rid)
            if not req.finished or req.cache.pages:
                await self.loop.release(lambda e: e.abort(req.rid) or e.release(req))

    async def _handoff(self, req: Request, prefill_addr: str, deadline: float, context) -> int:
        try:
            first = await self.receiver.receive(req, prefill_addr, deadline)
        except HandoffError as e:
            logger.warning("room %s: %s", req.rid, e)
            await context.abort(e.code, str(e))
        req.cache.length = req.prompt_len  # P wrote the prompt's KV (and draft KV) into our pages
        req.draft_cache.length = req.prompt_len if req.draft_cache.pages else 0
        return first

    async def TransferDone(self, request: pb.TransferDoneRequest, context) -> pb.TransferDoneReply:
        if self.receiver is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this instance has no KV receiver")
        try:
            self.receiver.transfer_done(request, self.loop.engine.runner.cfg.vocab_size)
        except HandoffError as e:
            logger.warning("TransferDone refused: %s", e)
            await context.abort(e.code, str(e))
        return pb.TransferDoneReply(ok=True)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortReply:
        found = self.receiver is not None and self.receiver.abort(request.room, request.reason)
        aborted = await self.loop.abort(request.room)
        return pb.AbortReply(found=found or aborted)

    async def Health(self, request, context) -> pb.HealthReply:
        return pb.HealthReply(ok=self.loop.out_of_service is None, role=self.role, running=len(self.loop.engine.running),
                              model=self.model_name, mooncake_session=self.receiver.session_id if self.receiver else "",
                              **pool_health(self.loop.engine))
