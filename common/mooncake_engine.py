"""Thin wrapper around the Mooncake Transfer Engine (`mooncake.engine.TransferEngine`).

Why a wrapper: the raw binding signals failure with negative return codes (it never raises),
picks TCP or RDMA from the host's topology rather than from the `protocol` argument, and
reads its settings from environment variables. This class turns all three into explicit
config and exceptions. One engine per process; peers address it by `session_id`.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.buffers import PagedKVBuffer, SlotStateBuffer
from common.transfer_plan import TransferEntry, split_batches

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S = 30, 5
# Completion polling backs off from POLL_MIN_S to POLL_MAX_S: a small room is noticed within
# tens of microseconds, and a large one costs at most a millisecond of lateness.
POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3
_INSTALL_HINT = (
    "install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA); "
    "it needs the system package libibverbs1 (apt-get install libibverbs1)"
)


class TransferError(RuntimeError):
    """Mooncake refused or failed a registration or transfer."""


@dataclass(frozen=True)
class MooncakeConfig:
    local_hostname: str = "127.0.0.1"  # address peers reach this host on (compute network)
    metadata_server: str = P2P_HANDSHAKE  # or "http://host:port/metadata", "etcd://host:port"
    protocol: str = "tcp"  # "tcp" or "rdma"
    device_name: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1"; empty = all
    # Seconds before a write gives up, plus 1 s per GiB written, at least 5 (the rule of
    # Mooncake's own synchronous calls). None: MC_TRANSFER_TIMEOUT, else Mooncake's 30.
    transfer_timeout_s: int | None = None
    # TCP connections per peer (Mooncake's MC_TCP_LANES_PER_PEER, which wins when set; its own
    # default is 4, its maximum 16). A lane carries one entry at a time and waits for the
    # receiver's acknowledgement before its next, so more lanes keep more bytes moving: on a
    # 2-vCPU VM 16 lanes moved a 2K-token room at 0.30-0.91 of plain TCP's rate against 0.28-0.44
    # with 4 (docs/PERFORMANCE.md).
    tcp_lanes_per_peer: int = 16

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")


def check_allocator_env(environ: Mapping[str, str] = os.environ) -> None:
    """Mooncake cannot register memory from PyTorch's expandable segments ("Bad address",
    Mooncake issue 2511), so refuse that allocator setting up front."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in environ.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                raise TransferError(
                    f"{var}={environ[var]!r}: Mooncake cannot register memory from expandable "
                    "segments (Mooncake issue 2511); remove expandable_segments:True"
                )


def _load_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # also covers a missing libibverbs.so.1
        raise ImportError(f"cannot import mooncake.engine ({e}); {_INSTALL_HINT}") from e
    return TransferEngine


class MooncakeEngine:
    def __init__(self, config: MooncakeConfig):
        self.config = config
        self._engine: Any = None
        self._registered: dict[int, int] = {}  # addr -> length
        self._timeout_s = _timeout_s(config)

    def start(self) -> None:
        check_allocator_env()
        cfg = self.config
        # The engine reads these when it is built/initialized; there is no API argument.
        if cfg.protocol == "tcp":
            # Without it a host with RDMA cards silently uses RDMA whatever `protocol` says.
            os.environ["MC_FORCE_TCP"] = "1"
            os.environ.setdefault("MC_TCP_LANES_PER_PEER", str(cfg.tcp_lanes_per_peer))
        elif os.environ.get("MC_FORCE_TCP"):
            raise TransferError("protocol 'rdma' requested but MC_FORCE_TCP is set in the environment")
        engine = _load_engine_class()()
        if cfg.protocol == "rdma" and not _has_rdma_device(engine.get_local_topology(cfg.device_name or None)):
            # Mooncake would fall back to TCP without a word; RDMA was asked for.
            raise TransferError(f"protocol 'rdma' requested but no RDMA device found (filter {cfg.device_name!r})")
        rc = engine.initialize(cfg.local_hostname, cfg.metadata_server, cfg.protocol, cfg.device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize failed (rc={rc}) for host {cfg.local_hostname}, "
                f"metadata {cfg.metadata_server}, protocol {cfg.protocol}"
            )
        self._engine = engine
        logger.info("mooncake engine up: session %s, protocol %s", self.session_id, cfg.protocol)

    @property
    def session_id(self) -> str:
        """The name peers pass to `write`: with P2P handshake "host:rpc_port", otherwise the
        segment name this engine registered under the metadata server (its local hostname)."""
        engine = self._started()
        if self.config.metadata_server != P2P_HANDSHAKE:
            return self.config.local_hostname
        host = self.config.local_hostname
        if ":" in host and not host.startswith("["):  # IPv6, as Mooncake names it
            host = f"[{host}]"
        return f"{host}:{engine.get_rpc_port()}"

    def register(self, addr: int, length: int) -> None:
        rc = self._started().register_memory(addr, length)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({addr:#x}, {length}) failed (rc={rc})")
        self._registered[addr] = length

    def register_buffers(self, buffers: Iterable[PagedKVBuffer | SlotStateBuffer]) -> None:
        for buf in buffers:
            self.register(buf.base_addr, buf.length)

    def unregister(self, addr: int) -> None:
        if addr not in self._registered:
            raise TransferError(f"address {addr:#x} was never registered")
        rc = self._started().unregister_memory(addr)
        if rc != 0:
            raise TransferError(f"Mooncake unregister_memory({addr:#x}) failed (rc={rc})")
        del self._registered[addr]

    def write(self, peer_session_id: str, entries: Sequence[TransferEntry]) -> int:
        """Copy every entry from local memory into `peer_session_id`'s registered memory, at most
        MAX_BATCH_ENTRIES in flight at a time. Returns the bytes moved; raises TransferError if an
        entry fails or the write outlives its deadline (the timeout plus 1 s per GiB), in either
        case only once no entry is in flight any more (see _wait)."""
        engine = self._started()
        nbytes = sum(e.length for e in entries)
        deadline = time.monotonic() + self._timeout_s + nbytes / 2**30
        for i, batch in enumerate(batches := split_batches(entries)):
            where = f"write to {peer_session_id}, batch {i + 1}/{len(batches)} of {len(batch)} entries"
            in_flight, submit_error = _submit(engine, peer_session_id, batch)
            # Wait even after a failed submit: the entries already in flight still read our memory.
            _wait(engine, in_flight, deadline, where)
            if submit_error:
                raise TransferError(f"Mooncake {where}: {submit_error}")
        return nbytes

    def close(self) -> None:
        if self._engine is None:
            return
        for addr in list(self._registered):
            self.unregister(addr)
        self._engine = None  # the binding tears the engine down when it is collected

    def _started(self) -> Any:
        if self._engine is None:
            raise TransferError("Mooncake engine not started; call start() first")
        return self._engine


def _timeout_s(config: MooncakeConfig) -> int:
    timeout = config.transfer_timeout_s
    if timeout is None:
        timeout = int(os.environ.get("MC_TRANSFER_TIMEOUT", DEFAULT_TIMEOUT_S))
    return max(MIN_TIMEOUT_S, timeout)


# Every entry goes in as a batch of its own because transfer_check_status answers for one entry
# without blocking. The binding's calls that wait on a whole batch (batch_transfer_sync_write,
# get_batch_transfer_status) spin on a core until it is done; on a 2-core host that spinning
# thread takes the CPU that Mooncake's TCP thread needs to move the bytes.
def _submit(engine: Any, peer: str, batch: Sequence[TransferEntry]) -> tuple[list[int], str]:
    """Start every entry; stop at the first the engine refuses. Returns the ids in flight and,
    if one was refused, why."""
    ids = []
    for n, e in enumerate(batch):
        batch_id = engine.transfer_submit_write(peer, e.src_addr, e.dst_addr, e.length)
        if batch_id == 0:  # the binding's only failure value (ids are pointers)
            return ids, (f"entry {n + 1} ({e.length} bytes to {e.dst_addr:#x}) refused at submit (rc=0, "
                         f"e.g. peer unknown or unreachable); {len(ids)} entries were in flight")
        ids.append(batch_id)
    return ids, ""


def _wait(engine: Any, ids: list[int], deadline: float, where: str) -> None:
    """Sleep-poll until every id has finished, then report the first failure or a passed
    deadline. Never earlier: Mooncake cannot cancel an entry, so one still in flight when we
    give up could land later, in pages that are by then another room's (the caller frees both
    sides' pages once we return). A stalled entry ends when Mooncake's transport fails it
    (MC_TCP_PROGRESS_TIMEOUT_SEC on TCP, 30 s by default)."""
    pending, failed, pause = deque(ids), [], POLL_MIN_S
    late_by: float | None = None
    while pending:
        rc = engine.transfer_check_status(pending[0])
        # 1 done; -1 failed. -2 (Mooncake's own slice timeout, MC_SLICE_TIMEOUT) comes back while
        # slices are still queued, so that entry is still in flight: keep polling it.
        if rc in (1, -1):
            pending.popleft()
            if rc < 0:
                failed.append(rc)
            continue
        if late_by is None and time.monotonic() > deadline:
            late_by = time.monotonic()
            logger.warning("Mooncake %s: deadline passed with %d of %d entries unfinished; waiting for them "
                           "to finish or fail before giving the pages back", where, len(pending), len(ids))
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
    if late_by is not None:
        raise TransferError(f"Mooncake {where}: deadline passed before every entry had finished ({len(failed)} of "
                            f"{len(ids)} failed; the last finished {time.monotonic() - late_by:.1f} s after it)")
    if failed:
        raise TransferError(f"Mooncake {where}: {len(failed)} of {len(ids)} entries failed (rc={failed[0]})")


def _has_rdma_device(topology_json: str) -> bool:
    # Shape: {"cpu:0": [[preferred HCAs], [other HCAs]], "cuda:0": [...], ...}
    return any(hca for lists in json.loads(topology_json).values() for hcas in lists for hca in hcas)
