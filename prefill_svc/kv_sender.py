"""P's side of a KV handoff: match D's bootstrap to the room, plan the copy, move the bytes (by
local copy into a D on this host, over Mooncake otherwise), and acknowledge to D."""
from __future__ import annotations

import asyncio
import time

from collections.abc import Mapping

import grpc
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.kv.buffers import RankEndpoint, RoomBuffers
from common.service.grpc_process import peer_channel
from common.service.tls import Tls
from common.service.transfer_ranks import TransferRanks
from common.transfer.plan import TPRank, TransferPlanError, Writes, build_plan
from common.transfer.wire import ranks_from_bootstrap, shared_from_bootstrap
from common.transfer.writer import Moved, Peers
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

TARGET_KV = "kv"  # the target model's paged KV: the one buffer each prefill chunk extends


class Aborted(RuntimeError):
    """The room was aborted here; `boot` is D's bootstrap if it had arrived."""

    def __init__(self, reason: str, boot: pb.BootstrapRequest | None):
        super().__init__(f"aborted: {reason or 'by request'}")
        self.boot = boot


class KVSender:
    def __init__(self, ranks: TransferRanks, engine: Engine, bootstrap_ttl_s: float, verify: bool,
                 tls: Tls | None = None):
        self.ranks = ranks
        self.engine = engine
        self.verify = verify  # send page checksums so D can verify what it received
        self.tls = tls  # mutual TLS towards D
        self.bootstrap_ttl_s = bootstrap_ttl_s
        self._boots: dict[str, asyncio.Future] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    # Bootstrap and Prefill for one room arrive in either order: whichever comes first
    # creates the future; a bootstrap nobody claims is dropped after its TTL.
    def _future(self, room: str) -> asyncio.Future:
        fut = self._boots.get(room)
        if fut is None:
            fut = self._boots[room] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(self.bootstrap_ttl_s, self._expire, room, fut)
        return fut

    def _expire(self, room: str, fut: asyncio.Future) -> None:
        if self._boots.get(room) is fut:
            del self._boots[room]
        if not fut.done():
            fut.cancel()

    def bootstrap(self, msg: pb.BootstrapRequest) -> str:
        """Hand D's bootstrap to the room; "" or, if the room has already failed or been
        aborted here, why (D then fails the room at once instead of waiting for its deadline)."""
        fut = self._future(msg.room)
        if not fut.done():
            fut.set_result(msg)
        elif fut.exception() is not None:
            return str(fut.exception())
        return ""

    def abort(self, room: str, reason: str) -> bool:
        """Fail the room's wait for its bootstrap, now or, if its Prefill has not asked yet, when
        it does (the failed future stays for the TTL): after an Abort, no bootstrap that arrives
        late can make us write into D's pages. True if Prefill was already waiting."""
        fut = self._boots.get(room)
        waiting = fut is not None and not fut.done()
        boot = self.held_bootstrap(room)  # kept: the failed Prefill still owes D its word
        if not waiting:
            fut = self._boots[room] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(self.bootstrap_ttl_s, self._expire, room, fut)
        fut.set_exception(Aborted(reason, boot))
        fut.exception()  # retrieved: a tombstone nobody awaits must not log "never retrieved"
        return waiting

    def held_bootstrap(self, room: str) -> pb.BootstrapRequest | None:
        """The room's bootstrap if it has arrived, claimed or not (a Prefill that failed before
        waiting for it must still answer D, with the token it brought)."""
        fut = self._boots.get(room)
        if fut is None or not fut.done() or fut.cancelled():
            return None
        err = fut.exception()
        if err is None:
            return fut.result()
        return err.boot if isinstance(err, Aborted) else None

    async def wait_bootstrap(self, room: str, deadline: float) -> pb.BootstrapRequest:
        fut = self._future(room)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), deadline - time.monotonic())
        except TimeoutError:
            raise TimeoutError("decode's bootstrap (where to write) never came") from None
        finally:
            self._boots.pop(room, None)

    def page_tokens(self) -> int:
        """Tokens per page of the target's KV ("kv"), which P sends chunk by chunk; 0 if no rank
        holds it (a model of KDA layers only)."""
        return next((b.page_size for r in self.ranks.endpoints for b in r.buffers if b.name == TARGET_KV), 0)

    async def send_pages(self, req: Request, boot: pb.BootstrapRequest, tokens: range,
                         ready: torch.cuda.Event | None) -> Moved:
        """Copy the target KV's pages of prompt tokens `tokens` (whole pages, all computed: a
        prefill chunk has ended) into D's pages while the next chunk computes. Planned and
        bounds-checked like the whole room (`send`), before any of its bytes move."""
        jobs, peers = await self._plan(req, boot, tokens.stop, names={TARGET_KV}, starts={TARGET_KV: tokens.start})

        def write() -> Moved:
            if ready is not None:  # the chunk's kernels may still run; the next chunk's need not end
                ready.synchronize()
            return self.ranks.write(jobs, peers)

        return await asyncio.to_thread(write)

    async def send(self, req: Request, boot: pb.BootstrapRequest, sent: int = 0) -> Moved:
        """Copy the prompt's KV from each of our ranks into the pages D reserved on each of its
        ranks: by local copy where D is on our host and its buffers open here, else over Mooncake;
        of the target KV only the pages from token `sent` on (those before went with `send_pages`).
        Plan errors (bounds, layouts) are raised before any byte moves; a failed write raises
        TransferError once none of its entries is in flight.

        The hand-off convention (D's side: Engine.add_prefilled): P has consumed every prompt
        token, so the KDA state and convolution windows sent cover the whole prompt (they are
        taken after the last prefill chunk, never between chunks, and so is the draft KV); D
        starts from the first sampled token, which no state sent here has seen."""
        if req.cache.length != req.prompt_len:
            raise TransferPlanError(f"room {req.rid}: {req.cache.length} of {req.prompt_len} prompt tokens "
                                    "prefilled; the cache and state go to decode only after the last chunk")
        jobs, peers = await self._plan(req, boot, req.prompt_len, starts={TARGET_KV: sent})
        return await asyncio.to_thread(self.ranks.write, jobs, peers)

    async def _plan(self, req: Request, boot: pb.BootstrapRequest, num_tokens: int, **part) -> tuple[list[Writes], Peers]:
        """plan_writes for this room and `part` of it, and the D buffers each of our ranks opens
        on its own host. Planned off the event loop: with differing head splits a long prompt's
        plan has an entry per token, layer and K/V, and other rooms' RPCs must not wait for it."""
        jobs = await asyncio.to_thread(plan_writes, req.rid, self.ranks.endpoints, self.ranks.tp,
                                       self.engine.room_pages(req), ranks_from_bootstrap(boot),
                                       boot.tp_size or 1, num_tokens, **part)
        return jobs, shared_from_bootstrap(boot)

    async def checksums(self, req: Request) -> list[int]:
        if not self.verify:
            return []
        return await asyncio.to_thread(self.engine.room_checksums, req)

    async def ack(self, decode_addr: str, msg: pb.TransferDoneRequest, timeout: float) -> None:
        if decode_addr not in self._channels:
            self._channels[decode_addr] = peer_channel(decode_addr, self.tls)
        stub = pb_grpc.DecodeServiceStub(self._channels[decode_addr])
        # wait_for_ready: a D just restarted (or a channel still backing off) is waited for, up to
        # the timeout, instead of failing the room at once; a dead D's room is cancelled by the router.
        # A D that no longer waits for the room answers NOT_FOUND.
        await stub.TransferDone(msg, timeout=max(timeout, 1.0), wait_for_ready=True)


def plan_writes(room: str, src: list[RankEndpoint], src_tp: int, pages: dict[str, list[int]],
                dst: list[tuple[int, str, RoomBuffers]], dst_tp: int, num_tokens: int,
                names: set[str] | None = None, starts: Mapping[str, int] = {}) -> list[Writes]:
    """What each of our ranks writes to which D rank: of the buffers in `names` (all if None),
    paged ones from the token in `starts` on (build_plan). A rank pair plans the buffers both
    hold (the draft KV lives on one rank per side); each buffer must exist on both sides somewhere."""
    ours = {b.name for r in src for b in r.buffers}
    theirs = {b.name for _, _, d in dst for b in d.buffers}
    if ours != theirs:
        raise TransferPlanError(f"room {room}: buffers differ (prefill {sorted(ours)}, decode {sorted(theirs)}); "
                                "are both started with the same --spec?")
    ours = {b.dtype for r in src for b in r.buffers if b.name == "draft_kv"}
    theirs = {b.dtype for _, _, d in dst for b in d.buffers if b.name == "draft_kv"}
    if ours != theirs:  # --draft-dtype auto is resolved on each host
        raise TransferPlanError(f"room {room}: the draft KV is {'/'.join(sorted(ours))} here and "
                                f"{'/'.join(sorted(theirs))} on decode; start both with the same --draft-dtype")
    jobs: list[Writes] = []
    for rank in src:
        writes: Writes = []
        for d_rank, session, d_room in dst:
            both = {b.name for b in rank.buffers} & {b.name for b in d_room.buffers}
            if names is not None:
                both &= names
            plan = build_plan(room, RoomBuffers([b for b in rank.buffers if b.name in both], pages),
                              RoomBuffers([b for b in d_room.buffers if b.name in both], d_room.indices),
                              num_tokens, src_tp=TPRank(rank.tp_rank, src_tp), dst_tp=TPRank(d_rank, dst_tp),
                              starts=starts)
            if plan.entries:
                writes.append((session, plan.entries))
        jobs.append(writes)
    return jobs
