"""Thin wrapper around the Mooncake Transfer Engine (`mooncake.engine.TransferEngine`).

Why a wrapper: the raw binding signals failure with negative return codes (it never raises),
picks TCP or RDMA from the host's topology rather than from the `protocol` argument, and
reads its settings from environment variables. This class turns all three into explicit
config and exceptions. One engine per process; peers address it by `session_id`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.kv.buffers import PagedKVBuffer, SlotStateBuffer
from common.transfer.plan import MAX_BATCH_ENTRIES, TransferEntry

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
    # Seconds a write may take, plus 1 s per GiB written, at least 5 (the rule of Mooncake's own
    # synchronous calls); past it nothing more is submitted, the entries in flight are waited
    # for, and the write fails. None: MC_TRANSFER_TIMEOUT, else Mooncake's 30.
    transfer_timeout_s: int | None = None
    # TCP connections per peer (Mooncake's MC_TCP_LANES_PER_PEER, or its older name
    # MC_TCP_MAX_CONNECTIONS_PER_PEER, wins when set; Mooncake's own default is 4, its range
    # 1-16). A lane carries one entry at a time and waits for the receiver's acknowledgement
    # before its next, so more lanes keep more bytes moving: on a 2-vCPU VM 16 lanes moved a
    # 2K-token room at 0.30-0.91 of plain TCP's rate against 0.28-0.44 with 4 (docs/PERFORMANCE.md).
    tcp_lanes_per_peer: int = 16
    tcp_in_flight_bytes: int = 8 << 20  # see in_flight_limit

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not 1 <= self.tcp_lanes_per_peer <= 16:  # outside it Mooncake silently uses 4
            raise ValueError(f"tcp_lanes_per_peer must be 1-16, got {self.tcp_lanes_per_peer}")

    def in_flight_limit(self, entry_bytes: float) -> int:
        """Entries a write keeps submitted at once. A TCP lane takes its next entry only once we
        have noticed the last one finish (we poll about every millisecond), so large entries
        need two per lane and small ones tcp_in_flight_bytes' worth queued; no more, because after
        a stall each queued entry ends only when Mooncake fails it. RDMA takes whole batches."""
        if self.protocol != "tcp":
            return MAX_BATCH_ENTRIES
        by_bytes = math.ceil(self.tcp_in_flight_bytes / max(entry_bytes, 1.0))
        return min(MAX_BATCH_ENTRIES, max(2 * self.tcp_lanes_per_peer, by_bytes))


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
        self._segment = ""  # with a metadata server: the name this engine registered under
        self._name_port: socket.socket | None = None

    def start(self) -> None:
        check_allocator_env()
        cfg = self.config
        # The engine reads these when it is built/initialized; there is no API argument.
        if cfg.protocol == "tcp":
            # Without it a host with RDMA cards silently uses RDMA whatever `protocol` says.
            os.environ["MC_FORCE_TCP"] = "1"
            if not any(v in os.environ for v in ("MC_TCP_LANES_PER_PEER", "MC_TCP_MAX_CONNECTIONS_PER_PEER")):
                os.environ["MC_TCP_LANES_PER_PEER"] = str(cfg.tcp_lanes_per_peer)
        elif os.environ.get("MC_FORCE_TCP"):
            raise TransferError("protocol 'rdma' requested but MC_FORCE_TCP is set in the environment")
        engine = _load_engine_class()()
        if cfg.protocol == "rdma" and not _has_rdma_device(engine.get_local_topology(cfg.device_name or None)):
            # Mooncake would fall back to TCP without a word; RDMA was asked for.
            raise TransferError(f"protocol 'rdma' requested but no RDMA device found (filter {cfg.device_name!r})")
        name = cfg.local_hostname
        if cfg.metadata_server != P2P_HANDSHAKE:
            # A metadata server names a segment by what initialize() is given. The ranks of a
            # parallel instance each run an engine, several on one host: each takes host:port
            # with a port it keeps bound while it lives, so no other engine of the host takes it.
            self._name_port = socket.socket()
            self._name_port.bind(("", 0))
            name = f"{_bracketed(cfg.local_hostname)}:{self._name_port.getsockname()[1]}"
        rc = engine.initialize(name, cfg.metadata_server, cfg.protocol, cfg.device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize failed (rc={rc}) for {name}, "
                f"metadata {cfg.metadata_server}, protocol {cfg.protocol}"
            )
        self._engine = engine
        self._segment = name
        logger.info("mooncake engine up: session %s, protocol %s", self.session_id, cfg.protocol)

    @property
    def session_id(self) -> str:
        """The name peers pass to `write`: with P2P handshake "host:rpc_port", otherwise the
        segment name this engine registered under the metadata server ("host:port", see start)."""
        engine = self._started()
        if self.config.metadata_server != P2P_HANDSHAKE:
            return self._segment
        return f"{_bracketed(self.config.local_hostname)}:{engine.get_rpc_port()}"

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

    # Every entry goes in as a batch of its own because transfer_check_status answers for one
    # entry without blocking. The binding's calls that wait on a whole batch
    # (batch_transfer_sync_write, get_batch_transfer_status) spin on a core until it is done; on
    # a 2-core host that thread takes the CPU that Mooncake's TCP thread needs to move the bytes.
    def write(self, peer_session_id: str, entries: Sequence[TransferEntry]) -> int:
        """Copy every entry from local memory into `peer_session_id`'s registered memory, keeping
        at most `config.in_flight_limit()` entries submitted. Returns the bytes moved. Raises
        TransferError if an entry is refused or fails, or if the deadline (the timeout plus 1 s per
        GiB) passes before every entry has been submitted; in every case only once no entry is in
        flight any more: Mooncake cannot cancel one, so an entry we stopped waiting for could land
        later in pages that are by then another room's (the caller frees both sides' pages once
        we return). A stalled entry ends when Mooncake's transport fails it
        (MC_TCP_PROGRESS_TIMEOUT_SEC on TCP, 30 s by default)."""
        engine = self._started()
        nbytes = sum(e.length for e in entries)
        deadline = time.monotonic() + self._timeout_s + nbytes / 2**30
        where = f"write of {len(entries)} entries to {peer_session_id}"
        limit = self.config.in_flight_limit(nbytes / max(len(entries), 1))
        pending: deque[int] = deque()
        submitted, failed, error, late_since, pause = 0, 0, "", None, POLL_MIN_S
        while True:
            # Keep the window full while all is well; after a refusal, a failure or the deadline,
            # only wait for what is in flight.
            while not (error or failed or late_since) and submitted < len(entries) and len(pending) < limit:
                batch_id, error = _submit(engine, peer_session_id, entries[submitted], submitted)
                if batch_id:
                    pending.append(batch_id)
                    submitted += 1
            if not pending:
                break
            rc = engine.transfer_check_status(pending[0])
            # 1 done; -1 failed. -2 (Mooncake's own slice timeout, MC_SLICE_TIMEOUT) comes back
            # while slices are still queued, so that entry is still in flight: keep polling it.
            if rc in (1, -1):
                pending.popleft()
                failed += rc < 0
                continue
            if late_since is None and submitted < len(entries) and time.monotonic() > deadline:
                late_since = time.monotonic()
                logger.warning("Mooncake %s: deadline passed with %d entries not yet submitted; waiting for the %d in "
                               "flight to finish or fail before giving the pages back", where,
                               len(entries) - submitted, len(pending))
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        problems = [error] if error else []
        if late_since is not None:
            problems.append(f"deadline passed with {len(entries) - submitted} entries not submitted (those in "
                            f"flight then took {time.monotonic() - late_since:.1f} s more to end)")
        if failed:
            problems.append(f"{failed} of the {submitted} submitted entries failed (rc=-1)")
        if problems:
            raise TransferError(f"Mooncake {where}: " + "; ".join(problems))
        if time.monotonic() > deadline:
            logger.warning("Mooncake %s: finished %.1f s after its deadline", where, time.monotonic() - deadline)
        return nbytes

    def close(self) -> None:
        if self._engine is None:
            return
        for addr in list(self._registered):
            self.unregister(addr)
        self._engine = None  # the binding tears the engine down when it is collected
        if self._name_port is not None:
            self._name_port.close()

    def _started(self) -> Any:
        if self._engine is None:
            raise TransferError("Mooncake engine not started; call start() first")
        return self._engine


def _bracketed(host: str) -> str:
    """IPv6 addresses in brackets, as Mooncake names them."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _timeout_s(config: MooncakeConfig) -> int:
    timeout = config.transfer_timeout_s
    if timeout is None:
        timeout = int(os.environ.get("MC_TRANSFER_TIMEOUT", DEFAULT_TIMEOUT_S))
    return max(MIN_TIMEOUT_S, timeout)


def _submit(engine: Any, peer: str, e: TransferEntry, n: int) -> tuple[int, str]:
    """Start entry number n: (its id, "") or (0, why the engine refused it)."""
    what = f"entry {n + 1} ({e.length} bytes to {e.dst_addr:#x}) refused at submit"
    try:
        batch_id = engine.transfer_submit_write(peer, e.src_addr, e.dst_addr, e.length)
    except Exception as exc:  # a binding that raises instead of returning 0
        return 0, f"{what} ({exc!r})"
    if batch_id == 0:  # the binding's only failure value (ids are pointers)
        return 0, f"{what} (rc=0, e.g. peer unknown or unreachable)"
    return batch_id, ""


def _has_rdma_device(topology_json: str) -> bool:
    # Shape: {"cpu:0": [[preferred HCAs], [other HCAs]], "cuda:0": [...], ...}
    return any(hca for lists in json.loads(topology_json).values() for hcas in lists for hca in hcas)
