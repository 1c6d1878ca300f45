"""ParallelRunner: a model split over TP x PP processes behind the ModelRunner interface.

The service process is rank 0, the driver: it owns the page pool (so the Engine and the
services are unchanged) and holds stage 0's layers and TP rank 0's heads. It starts the other
ranks (common.parallel.worker), announces every forward pass to them (and, for KDA layers, each
verify block's commit), runs its own part, and gets the final hidden states back from the last
stage, where it computes the logits itself (the LM head is replicated). Activations move between stages and all-reduces run within a stage
over torch.distributed (gloo on CPU, NCCL on GPU).

Across hosts (common.parallel.cluster) the driver starts only node 0's ranks; every other node's
agent (common.parallel.node_agent) starts its own, and the driver reaches them over that node's
control link (common.parallel.node_link): the same commands, writes and replies.

A worker that dies leaves the model incomplete: the driver logs which rank and how it ended, takes
the instance out of service (the service's on_lost: health NOT_SERVING, the requests in flight
failed naming the rank, so clients learn why rather than see a connection reset), and exits
non-zero, so that `pdflash up` restarts the whole instance. A node that is lost (dead, or its link
cut) does the same, after a grace in which its ranks stop themselves (_node_lost). An instance over
several nodes starts over in place instead of exiting (common.parallel.rejoin): it comes back as
soon as every node has joined again.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch
import torch.distributed as dist

from common.dflash.drafter import Drafter
from common.kv.buffers import RankEndpoint
from common.model.config import ModelConfig
from common.model.static_attention import StaticAttn
from common.model.transformer import cpu_fp32_transposed
from common.parallel.cluster import STARTUP_TIMEOUT_S, Nodes, local_device
from common.parallel.local_ranks import LocalRanks
from common.parallel.node_link import Link, RemoteWrite, accept_nodes, instance_key, lost_grace_s
from common.parallel.ports import free_port
from common.parallel.rejoin import restart_in_place
from common.parallel.stage import init_ranks, recv, stage_forward
from common.parallel.worker import (
    AppendContext,
    CommitBlock,
    Forward,
    LoadDrafter,
    PackedTensors,
    ReadPages,
    Reply,
    ReserveBlocks,
    StartTransfer,
    Stop,
    WorkerSpec,
    WriteJob,
)
from common.runner.layout import RankLayout, check_parallel
from common.runner.model_runner import ModelRunner, StepBatch
from common.transfer.mooncake import MooncakeConfig
from common.transfer.plan import Writes
from common.transfer.writer import Peers

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 2.0  # a lost node's failed requests reach D and the router before the instance exits


class WorkerError(RuntimeError):
    """A worker rank reported a failure (e.g. a KV write)."""


class ParallelRunner(ModelRunner):
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], *, tp: int = 1, pp: int = 1,
                 ep: int = 1, dtype: str = "fp32", device: str = "cpu", num_pages: int = 512, page_size: int = 64,
                 state_slots: int = 64, nodes: Nodes = Nodes(), startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 shared_kv: bool = False):
        check_parallel(cfg, tp, pp, ep)  # before any process starts
        layout = RankLayout(tp, pp, 0, ep)
        nodes.check(layout.world)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        init_method = nodes.init_method if nodes.multi else f"tcp://127.0.0.1:{free_port()}"
        self.nodes = nodes
        # The service: out of service now, why, and after how many seconds to fail its requests in flight
        self.on_lost: Callable[[str, float], None] | None = None
        self._pending: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._stopping = threading.Lock()  # held by the one thread that stops the instance
        self._sent = 0  # commands broadcast so far (WriteJob.after)
        self._jobs = itertools.count()
        ready = [self._expect(("ready", r)) for r in range(1, layout.world)]
        # Before the links to other nodes start: their heartbeats must not wait behind this copy.
        packed = PackedTensors.pack(tensors)
        self._links: dict[int, Link] = {}  # node rank -> link, nodes other than this one
        self._local: LocalRanks | None = None  # until every node has joined
        if nodes.multi:  # before our own ranks start: a node that does not fit fails the start at once
            self._links = accept_nodes(  # heartbeats from each join on: the start-up below takes a while
                nodes, instance_key(nodes, layout, cfg.name, num_pages), startup_timeout_s,
                lambda node, conn, ip: Link(conn, f"node {node} ({ip})", self._deliver, self._node_lost, nodes.timeout_s))
        transposed = backend == "gloo" and cpu_fp32_transposed()  # ours, for every rank (WorkerSpec)
        self._local = LocalRanks([
            WorkerSpec(layout.with_rank(r), cfg, packed, dtype, local_device(device, r - nodes.ranks(layout.world).start), num_pages, page_size,
                       init_method, backend, state_slots, nodes.host_ip, shared_kv, transposed)
            for r in nodes.ranks(layout.world) if r])
        threading.Thread(target=self._read_replies, name="rank-replies", daemon=True).start()
        if self._local.procs:
            threading.Thread(target=self._watch_workers, name="rank-watch", daemon=True).start()
        reduce = init_ranks(layout, init_method, backend, local_device(device, 0))
        super().__init__(cfg, tensors, dtype=dtype, device=local_device(device, 0), num_pages=num_pages,
                         page_size=page_size, layout=layout, reduce=reduce, state_slots=state_slots,
                         shared_kv=shared_kv)
        for f in ready:
            f.result(startup_timeout_s)
        self.drafter = None  # pipeline-parallel DFlash: this stage's share of the fused context

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, batch: StepBatch, capture_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if capture_layers and self.layout.pp > 1 and self.drafter is None:
            raise ValueError("under pipeline parallelism layers are captured only for a DFlash drafter "
                             "(load_pipeline_drafter)")
        self._broadcast(Forward(batch, capture_layers))
        try:
            out = stage_forward(self, batch, capture_layers, self.drafter)
            if self.layout.pp == 1:
                return out.hidden, out.captured
            if batch.num_rows == 0:  # middle chunks: don't wait for the last stage (see Engine._prefill_step)
                return torch.empty(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device), {}
            last = (self.layout.pp - 1) * self.layout.tp
            hidden = recv((batch.num_rows, self.cfg.hidden_size), self.dtype, self.device, last)
        except BaseException:
            # The workers are inside this forward's collectives; a next step's would pair up with
            # them (wrong results or a hang). Same policy as a dead worker: stop, let `pdflash up` restart.
            # A worker that just died is usually why: give its exit a moment to be seen, to name it.
            self._local.wait_exit(timeout=1.0)
            self._stop_instance("rank 0 failed in the middle of a forward; the ranks are out of step", exc_info=True)
        # The captured states stay on their stages; their share of the draft context went down
        # the pipeline and waits on the last stage for PipelineProposer.append_context.
        return hidden, {}

    def forward_static(self, token_ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                       attn: StaticAttn, capture_layers: tuple[int, ...] = (),
                       state_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The workers run StepBatches, not static buffers: the same causal step as one (rows
        unpadded: a parallel runner replays no graphs), through forward()."""
        self.check_static(attn, state_slots)
        T, page = attn.tokens_per_row, self.page_size
        kv_len = attn.kv_len.tolist()
        tables = attn.page_table.tolist()
        batch = StepBatch([n - T for n in kv_len], [T] * len(kv_len),
                          [table[:-(-n // page)] for table, n in zip(tables, kv_len)], token_ids.tolist(), None,
                          None if state_slots is None else state_slots.tolist(),
                          state_block=self.state_pool is not None and T > 1)
        return self.forward(batch, capture_layers)

    def reserve_blocks(self, rows: int, block: int) -> None:
        if self.state_pool is not None:  # every rank keeps its KDA heads' share of a verify block
            self._broadcast(ReserveBlocks(rows, block))
        super().reserve_blocks(rows, block)

    def commit_block(self, state_slots: torch.Tensor, count: torch.Tensor, block: int) -> None:
        """Every rank advances its own layers' and heads' slots by the same counts; the command
        queue runs it after the verify forward on each rank and before the next one."""
        if self.state_pool is not None:
            self._broadcast(CommitBlock(state_slots.tolist(), count.tolist(), block))
        super().commit_block(state_slots, count, block)

    # ---- DFlash under pipeline parallelism ------------------------------------------------------
    def load_pipeline_drafter(self, path: str, drafter: Drafter, num_pages: int) -> None:
        self.drafter = drafter
        for f in self._call_all(lambda r: ("drafter", r), LoadDrafter(path, num_pages, drafter.dtype)):
            f.result(STARTUP_TIMEOUT_S)

    def append_draft_context(self, rows: list[int], positions: list[int], slots: list[int]) -> None:
        self._broadcast(AppendContext(rows, positions, slots))

    # ---- reading the KV back -------------------------------------------------------------------
    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """These pages of the whole model's KV, every rank's layers and heads put in place."""
        parts = [super().read_pages(pages)] + self._read_all("kv", pages)
        cfg = self.cfg
        kv = torch.empty(cfg.num_layers, cfg.kv_planes, len(pages), self.page_size, cfg.num_kv_heads,
                         cfg.cache_head_dim, dtype=self.dtype)
        for r, part in enumerate(parts):
            layers, heads = self.layout.with_rank(r).layers(cfg), self.layout.with_rank(r).kv_heads(cfg)
            kv[layers.start:layers.stop, :, :, :, heads.start:heads.stop] = part
        return kv

    def read_draft_pages(self, pages: list[int]) -> torch.Tensor:
        """These pages of the draft KV held by the last stage (pipeline-parallel DFlash)."""
        return next(part for part in self._read_all("draft_kv", pages) if part is not None)

    def _read_all(self, name: str, pages: list[int]) -> list[torch.Tensor | None]:
        job = next(self._jobs)
        return [f.result(STARTUP_TIMEOUT_S) for f in self._call_all(lambda r: ("pages", job, r), ReadPages(name, pages, job))]

    # ---- transfers -----------------------------------------------------------------------------
    def start_transfer(self, config: MooncakeConfig, local: bool) -> list[RankEndpoint]:
        """Each worker starts its own Mooncake engine and registers its buffers (and, `local`, writes
        by local copy where it can); their endpoints in rank order (rank 0's is the service's own)."""
        return [f.result(STARTUP_TIMEOUT_S)
                for f in self._call_all(lambda r: ("endpoint", r), StartTransfer(config, local))]

    def write(self, rank: int, writes: Writes, peers: Peers) -> Future:
        """Worker `rank` writes these entries from its KV into decode sessions (by local copy to
        `peers`); resolves to what it moved (Moved)."""
        job = next(self._jobs)
        fut = self._expect(("write", job, rank))
        with self._lock:  # after every command sent so far, e.g. the draft KV of this room
            cmd = WriteJob(job, writes, peers, self._sent)
            if rank in self._local.ranks:
                self._local.write(rank, cmd)
            else:
                self._links[self.nodes.node_of(self.layout.world, rank)].send(RemoteWrite(rank, cmd))
        return fut

    # ---- lifetime ------------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """This host's worker processes."""
        return [p.pid for p in self._local.procs]

    def close(self) -> None:
        self._closing = True
        self._broadcast(Stop())
        dist.destroy_process_group()
        self._local.join(30)
        for link in self._links.values():
            link.close()

    # ---- plumbing ------------------------------------------------------------------------------
    def _broadcast(self, cmd) -> None:
        with self._lock:
            self._local.put(cmd)
            for link in self._links.values():
                link.send(cmd)
            self._sent += 1

    def _call_all(self, key, cmd) -> list[Future]:
        futures = [self._expect(key(r)) for r in range(1, self.layout.world)]
        self._broadcast(cmd)
        return futures

    def _expect(self, key: tuple) -> Future:
        fut: Future = Future()
        with self._lock:
            self._pending[key] = fut
        return fut

    def _read_replies(self) -> None:
        while True:
            self._deliver(self._local.get_reply())

    def _deliver(self, reply: Reply) -> None:
        with self._lock:
            fut = self._pending.pop(reply.key, None)
        if fut is None:
            return
        if reply.error is not None:
            fut.set_exception(WorkerError(reply.error))
        else:
            fut.set_result(reply.value)

    def _watch_workers(self) -> None:
        self._local.wait_exit()
        if self._closing:
            return
        self._stop_instance("a worker exited")

    def _node_lost(self, why: str) -> None:
        """Another node is gone: the model is incomplete and the ranks left may be stuck in a
        collective with it, for good. Stop the instance, with a grace in which the lost node's
        ranks stop themselves before what waited on them fails (KV writes in flight: D may then
        reuse those pages)."""
        if self._closing:
            return
        self._stop_instance(why, grace_s=lost_grace_s(self.nodes.timeout_s))

    def _stop_instance(self, why: str, exc_info: bool = False, grace_s: float = 0.0) -> None:
        """Out of service at once (the service's on_lost); after grace_s this host's ranks are
        killed and whatever waited on the ranks fails, the requests in flight too; EXIT_GRACE_S
        later exit non-zero, so that `pdflash up` restarts the instance whole (an instance over several
        nodes that is not being closed starts over in place instead). Names a dead worker
        if any: its death is the cause whatever failed on rank 0 because of it. Never returns."""
        if not self._stopping.acquire(blocking=False):
            threading.Event().wait()  # another thread (rank watch, node link, engine) is stopping it
        dead = self._local.dead() if self._local else []
        if dead:
            why, exc_info = f"worker {dead[0].name} exited with code {dead[0].exitcode}; the model is incomplete", False
        logger.critical("%s; this instance is out of service, stopping it", why, exc_info=exc_info)
        if self.on_lost is not None:
            self.on_lost(why, grace_s)
        time.sleep(grace_s)
        if self._local:  # before anything fails: no rank of ours writes into pages D may reuse
            self._local.kill()
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(WorkerError(why))
        time.sleep(EXIT_GRACE_S)  # for the failures to reach D and the router
        if self.nodes.multi and not self._closing:
            restart_in_place(why)  # waits for the nodes again: restarting a lost one is enough
        os._exit(1)

