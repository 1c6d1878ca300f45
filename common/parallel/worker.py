"""A worker rank of a parallel runner (common.parallel.driver): one process per (stage, TP rank)
other than the driver. It owns its layers' and heads' weights and KV cache, runs its part of
each forward pass the driver announces, and writes its KV into decode's memory when told.

Two queues from the driver: `commands` (forward passes and set-up, in order, main thread) and
`writes` (KV transfers, a thread of their own, so a transfer overlaps the next prefill step).
Everything the driver waits for comes back on the shared `replies` queue as a Reply.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch

from common.dflash.drafter import Drafter
from common.dflash.proposer import DFlashProposer, to_device
from common.kv.buffers import RankEndpoint
from common.model.config import ModelConfig
from common.model.transformer import CPU_FP32_TRANSPOSED_ENV, cpu_fp32_transposed
from common.parallel.stage import init_ranks, stage_forward
from common.runner.layout import RankLayout
from common.runner.model_runner import ModelRunner, StepBatch
from common.transfer.local import LocalWriter
from common.transfer.mooncake import MooncakeConfig, MooncakeEngine
from common.transfer.plan import Writes
from common.transfer.writer import Peers, RankWriter

logger = logging.getLogger(__name__)


# ---- messages (pickled over multiprocessing queues) --------------------------------------------
@dataclass
class PackedTensors:
    """Named tensors in one flat byte tensor: it travels to a worker as one shared-memory
    segment (one file descriptor; the forkserver passes at most a few hundred)."""

    flat: torch.Tensor  # uint8
    index: list[tuple[str, torch.dtype, tuple[int, ...], int]]  # name, dtype, shape, byte offset

    @classmethod
    def pack(cls, tensors: dict[str, torch.Tensor]) -> "PackedTensors":
        index, offset = [], 0
        for name, t in tensors.items():
            index.append((name, t.dtype, tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // 64) * 64  # keep every tensor aligned
        # In shared memory from the start: else the first worker's start copies it there.
        flat = torch.empty(offset, dtype=torch.uint8).share_memory_()
        for (name, dtype, shape, start), t in zip(index, tensors.values()):
            flat[start:start + t.numel() * t.element_size()].view(dtype).view(shape).copy_(t)
        return cls(flat, index)

    def unpack(self) -> dict[str, torch.Tensor]:
        return {name: self.flat[start:start + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
                for name, dtype, shape, start in self.index}


@dataclass
class WorkerSpec:
    layout: RankLayout
    cfg: ModelConfig
    tensors: PackedTensors  # the whole model's, shared by every worker; each keeps its slices
    dtype: str
    device: str
    num_pages: int
    page_size: int
    init_method: str  # torch.distributed rendezvous
    backend: str  # "gloo" (CPU) or "nccl" (GPU)
    state_slots: int  # KDA state slots, as many as the driver's: the batch names them by index
    host: str  # this host's address for peers: its Mooncake segments
    shared_kv: bool  # transfer buffers in memory a P on this host can open (a decode instance's)
    # The starting process's common.model.transformer.cpu_fp32_transposed(): every rank of an
    # instance computes its replicated few-row products alike (timed per rank, they may not).
    cpu_fp32_transposed: bool


@dataclass
class Forward:
    batch: StepBatch
    capture_layers: tuple[int, ...]


@dataclass
class ReserveBlocks:
    """Scratch for verify blocks of up to rows x block tokens (ModelRunner.reserve_blocks)."""
    rows: int
    block: int


@dataclass
class CommitBlock:
    """After a verify block: row i's state slot advances by its first counts[i] tokens
    (ModelRunner.commit_block), on this rank's KDA layers and heads."""
    state_slots: list[int]
    counts: list[int]
    block: int


@dataclass
class LoadDrafter:
    """Pipeline parallel DFlash: every stage keeps the drafter for its fc columns; the last
    stage's TP rank 0 also holds the draft KV cache."""
    path: str
    num_pages: int
    dtype: torch.dtype  # the driver's drafter's (common.dflash.drafter.draft_dtype), resolved once for every stage


@dataclass
class AppendContext:
    """Last stage: draft KV for these rows of the last forward's fc sum, at these positions/slots."""
    rows: list[int]
    positions: list[int]
    slots: list[int]


@dataclass
class ReadPages:
    """This rank's part of these pages of buffer `name` ("kv", or "draft_kv" where it is held)."""
    name: str
    pages: list[int]
    job: int


@dataclass
class StartTransfer:
    config: MooncakeConfig  # every rank the same, but for local_hostname: its own host's (WorkerSpec.host)
    local: bool  # write by local copy to D ranks whose buffers open here


@dataclass
class Stop:
    pass


@dataclass
class WriteJob:
    job: int
    writes: Writes  # to decode ranks
    peers: Peers  # those of them on our host
    # Start once this many commands are done: the driver learns that a room's prefill is done
    # from the last stage's hidden states, before that rank has run the AppendContext that
    # writes the room's draft KV (and before other ranks' queues are necessarily drained).
    after: int


@dataclass
class Reply:
    key: tuple  # ("ready" | "endpoint" | "drafter", rank) or ("write" | "pages", job, rank)
    value: Any = None
    error: str | None = None


# ---- the worker process ------------------------------------------------------------------------
# How gloo's TCP transport words a peer process that died mid-collective.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def worker_main(spec: WorkerSpec, commands, writes, replies) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the driver stops us
    rank = spec.layout.rank
    logging.basicConfig(level=os.environ.get("PDFLASH_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    try:
        _serve(spec, commands, writes, replies)
    except Exception as e:
        # The driver sees this process exit and stops the service (see ParallelRunner). A
        # collective that failed because another rank is gone is that rank's failure, which the
        # driver reports: one line here, not a traceback that reads like a second fault.
        if isinstance(e, RuntimeError) and any(m in str(e) for m in PEER_GONE):
            logger.error("rank %d stopped: another rank of the instance is gone (%s)", rank, str(e).splitlines()[0])
        else:
            logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)


def _serve(spec: WorkerSpec, commands, writes, replies) -> None:
    layout = spec.layout
    os.environ[CPU_FP32_TRANSPOSED_ENV] = "1" if spec.cpu_fp32_transposed else "0"
    cpu_fp32_transposed.cache_clear()  # before any product: the forkserver may have chosen already
    if spec.backend == "gloo":  # ranks compute in lock step: share the cores, don't oversubscribe them
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, (os.cpu_count() or 1) // layout.world))
    reduce = init_ranks(layout, spec.init_method, spec.backend, spec.device)
    runner = ModelRunner(spec.cfg, spec.tensors.unpack(), dtype=spec.dtype, device=spec.device, num_pages=spec.num_pages,
                         page_size=spec.page_size, layout=layout, reduce=reduce, state_slots=spec.state_slots,
                         shared_kv=spec.shared_kv)
    del spec.tensors  # loaded into the model: let the driver's shared copy go
    replies.put(Reply(("ready", layout.rank)))
    drafter = draft = fc_sum = None
    done = _Done()
    while True:
        cmd = commands.get()
        if isinstance(cmd, Forward):
            out = stage_forward(runner, cmd.batch, cmd.capture_layers, drafter)
            if layout.is_last_stage and layout.pp > 1 and layout.tp_rank == 0 and cmd.batch.num_rows:
                torch.distributed.send(out.hidden.contiguous(), 0)  # the driver computes the logits
            fc_sum = out.fc_sum
        elif isinstance(cmd, ReserveBlocks):
            runner.reserve_blocks(cmd.rows, cmd.block)
        elif isinstance(cmd, CommitBlock):
            with torch.inference_mode():
                runner.commit_block(torch.tensor(cmd.state_slots, device=runner.device),
                                    torch.tensor(cmd.counts, device=runner.device), cmd.block)
        elif isinstance(cmd, AppendContext):
            if draft is not None:
                with torch.inference_mode():
                    host = torch.tensor([cmd.rows, cmd.positions, cmd.slots], dtype=torch.long)
                    index, positions, slots = to_device(host, runner.device)
                    draft.write_context(drafter.fuse_sum(fc_sum[index]), positions, slots)
        elif isinstance(cmd, ReadPages):
            holder = runner if cmd.name == "kv" else draft
            replies.put(Reply(("pages", cmd.job, layout.rank), holder and holder.read_pages(cmd.pages)))
        elif isinstance(cmd, LoadDrafter):
            drafter, draft = _load_drafter(cmd, runner)
            replies.put(Reply(("drafter", layout.rank)))
        elif isinstance(cmd, StartTransfer):
            mooncake = MooncakeEngine(replace(cmd.config, local_hostname=spec.host))
            mooncake.start()
            buffers = runner.describe_buffers() + (draft.describe_buffers() if draft is not None else [])
            mooncake.register_buffers(buffers)
            writer = RankWriter(mooncake, LocalWriter(runner.memory, runner.device) if cmd.local else None)
            threading.Thread(target=_write_loop, args=(writer, layout.rank, writes, replies, done), daemon=True).start()
            replies.put(Reply(("endpoint", layout.rank), RankEndpoint(layout.tp_rank, mooncake.session_id, buffers,
                                                                      runner.memory.regions)))
        elif isinstance(cmd, Stop):
            torch.distributed.destroy_process_group()
            return
        done.advance(runner.device)


class _Done:
    """How many commands the main thread has finished; the write thread waits on it. On CUDA a
    command has finished when its kernels are queued: the write thread also waits for the device
    to reach the end of the last one it counted (a prefill chunk's KV), not for the next chunk."""

    def __init__(self) -> None:
        self.count = 0
        self._ready: torch.cuda.Event | None = None
        self._cond = threading.Condition()

    def advance(self, device: torch.device) -> None:
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        with self._cond:
            self.count += 1
            self._ready = ready
            self._cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.count >= n)
            ready = self._ready
        if ready is not None:
            ready.synchronize()


def _load_drafter(cmd: LoadDrafter, runner: ModelRunner):
    drafter = Drafter.load(cmd.path, device=runner.device, dtype=cmd.dtype)
    layout = runner.layout
    draft = None
    if layout.is_last_stage and layout.tp_rank == 0:
        draft = DFlashProposer(drafter, runner, cmd.num_pages)  # for its draft KV tensor and writer
    return drafter, draft


def _write_loop(writer: RankWriter, rank: int, writes, replies, done: _Done) -> None:
    while True:
        job: WriteJob = writes.get()
        done.wait_for(job.after)
        try:
            replies.put(Reply(("write", job.job, rank), writer.write(job.writes, job.peers)))
        except Exception as e:
            replies.put(Reply(("write", job.job, rank), error=f"rank {rank}: {e}"))


def _die_with_parent() -> None:
    """A worker outlives a driver that crashed (or was SIGKILLed) only as a leak: have the kernel
    end it with its parent (Linux; elsewhere the dead driver's sockets end it at the next step)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
