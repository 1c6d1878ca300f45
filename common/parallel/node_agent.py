"""A node other than node 0 of a multi-node instance (common.parallel.cluster): it starts this
host's worker ranks and relays between them and the driver on node 0, over the control link
(common.parallel.node_link). It serves no requests.

It ends when the driver says Stop (exit code 0) or when it loses the driver, or one of its own
ranks dies (exit code 1, `why` says what, its ranks killed at once: the instance re-forms, see
common.parallel.rejoin).
"""
from __future__ import annotations

import logging
import threading

import torch

from common.model.config import ModelConfig
from common.model.transformer import cpu_fp32_transposed
from common.parallel.cluster import Nodes, local_device
from common.parallel.local_ranks import LocalRanks
from common.parallel.node_link import Link, RemoteWrite, connect_head, instance_key
from common.parallel.worker import PackedTensors, Stop, WorkerSpec
from common.runner.layout import RankLayout, check_parallel

logger = logging.getLogger(__name__)


class NodeAgent:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], *, tp: int, pp: int, ep: int, dtype: str,
                 device: str, num_pages: int, page_size: int, state_slots: int, nodes: Nodes, startup_timeout_s: float,
                 shared_kv: bool):
        check_parallel(cfg, tp, pp, ep)
        layout = RankLayout(tp, pp, 0, ep)
        nodes.check(layout.world)
        self.ranks = nodes.ranks(layout.world)
        self.exit_code = 0
        self.why = ""  # what ended it, with exit code 1
        self.done = threading.Event()
        self._stopping = False
        self._local: LocalRanks | None = None
        packed = PackedTensors.pack(tensors)  # before the link: its heartbeats must not wait behind this copy
        conn = connect_head(nodes, instance_key(nodes, layout, cfg.name, num_pages), startup_timeout_s)
        # Heartbeats from now on (the ranks' start-up takes a while); the driver sends nothing
        # else before our ranks have joined its process group.
        self._link = Link(conn, f"node 0 ({nodes.control_addr[0]})", self._on_message, self._lost, nodes.timeout_s)
        self._link.start()
        backend = "nccl" if device.startswith("cuda") else "gloo"
        # This host's ranks choose alike (common.model.transformer.cpu_fp32_transposed); another
        # host's BLAS may round differently anyway.
        transposed = backend == "gloo" and cpu_fp32_transposed()
        self._local = LocalRanks([
            WorkerSpec(layout.with_rank(r), cfg, packed, dtype, local_device(device, r - self.ranks.start), num_pages,
                       page_size, nodes.init_method, backend, state_slots, nodes.host_ip, shared_kv, transposed)
            for r in self.ranks])
        threading.Thread(target=self._relay_replies, name="rank-replies", daemon=True).start()
        threading.Thread(target=self._watch_workers, name="rank-watch", daemon=True).start()

    def stop(self) -> None:
        """This node is asked to stop on its own: its ranks go, and with them the instance."""
        self._lost("this node was stopped")

    def _on_message(self, msg) -> None:
        if isinstance(msg, RemoteWrite):
            self._local.write(msg.rank, msg.job)
            return
        if isinstance(msg, Stop):  # ranks that exit and a link that closes from now on are this stop
            self._stopping = True
            threading.Thread(target=self._finish, name="stop", daemon=True).start()
        self._local.put(msg)

    def _finish(self) -> None:
        self._local.join(30)
        self._link.close()
        self.done.set()

    def _relay_replies(self) -> None:
        while True:
            self._link.send(self._local.get_reply())

    def _watch_workers(self) -> None:
        self._local.wait_exit()
        if not self._stopping:
            dead = self._local.dead()[0]
            self._lost(f"worker {dead.name} exited with code {dead.exitcode}")

    def _lost(self, why: str) -> None:
        if self.done.is_set() or self._stopping:
            return
        logger.critical("%s; stopping this node's ranks %d-%d (the instance re-forms)", why,
                        self.ranks.start, self.ranks.stop - 1)
        if self._local is not None:
            self._local.kill()
        self.why = why
        self.exit_code = 1
        self.done.set()
