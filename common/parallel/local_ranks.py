"""This host's worker ranks of a parallel instance (common.parallel.worker): one process each,
forked from a forkserver, each with its own command and write queues; their replies share one
queue. The driver (node 0) and the node agent (other nodes) both start theirs here."""
from __future__ import annotations

import multiprocessing.connection
import time

import torch.multiprocessing as mp

from common.parallel.worker import Reply, WorkerSpec, WriteJob, worker_main


class LocalRanks:
    def __init__(self, specs: list[WorkerSpec]):
        # forkserver: one clean process imports torch and this package once, and every worker
        # forks from it (a fresh interpreter per worker costs seconds each on a small machine).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["common.parallel.worker"])
        self.replies = ctx.SimpleQueue()
        self.procs, self._commands, self._writes = [], [], {}
        for spec in specs:
            commands, writes = ctx.SimpleQueue(), ctx.SimpleQueue()
            rank = spec.layout.rank
            proc = ctx.Process(target=worker_main, args=(spec, commands, writes, self.replies),
                               name=f"pdflash-rank{rank}", daemon=True)
            proc.start()
            self.procs.append(proc)
            self._commands.append(commands)
            self._writes[rank] = writes

    @property
    def ranks(self) -> list[int]:
        return list(self._writes)

    def put(self, cmd) -> None:
        """Every local rank gets `cmd`, in the order commands are put."""
        for q in self._commands:
            q.put(cmd)

    def write(self, rank: int, job: WriteJob) -> None:
        self._writes[rank].put(job)

    def get_reply(self) -> Reply:
        return self.replies.get()

    def wait_exit(self, timeout: float | None = None) -> None:
        """Until any of them has exited (or the timeout)."""
        multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=timeout)

    def dead(self) -> list:
        """Exited ranks, those a signal ended first: a rank killed from outside is the cause, and
        the ranks in a collective with it exit with code 1 on their own soon after, sometimes
        before the watch looks."""
        gone = [p for p in self.procs if not p.is_alive()]
        return sorted(gone, key=lambda p: p.exitcode is None or p.exitcode >= 0)

    def join(self, timeout: float) -> None:
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()

    def kill(self, wait_s: float = 10.0) -> None:
        """SIGKILL every rank, then wait up to wait_s until they are gone: a GPU's memory is free
        only then, and a process starting over in place (common.parallel.rejoin) needs it."""
        for p in self.procs:
            p.kill()
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
