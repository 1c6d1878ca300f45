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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.transfer_plan import TransferEntry, split_batches

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
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
    # Seconds before a synchronous transfer gives up (Mooncake adds 1 s per GiB and
    # floors it at 5). None keeps Mooncake's default (30 s) or MC_TRANSFER_TIMEOUT.
    transfer_timeout_s: int | None = None

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

    def start(self) -> None:
        check_allocator_env()
        cfg = self.config
        # The engine reads these when it is built/initialized; there is no API argument.
        if cfg.transfer_timeout_s is not None:
            os.environ["MC_TRANSFER_TIMEOUT"] = str(cfg.transfer_timeout_s)
        if cfg.protocol == "tcp":
            # Without it a host with RDMA cards silently uses RDMA whatever `protocol` says.
            os.environ["MC_FORCE_TCP"] = "1"
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

    def unregister(self, addr: int) -> None:
        if addr not in self._registered:
            raise TransferError(f"address {addr:#x} was never registered")
        rc = self._started().unregister_memory(addr)
        if rc != 0:
            raise TransferError(f"Mooncake unregister_memory({addr:#x}) failed (rc={rc})")
        del self._registered[addr]

    def write(self, peer_session_id: str, entries: Sequence[TransferEntry]) -> int:
        """Copy every entry from local memory into `peer_session_id`'s registered memory, in
        synchronous batches of at most 1024 entries. Returns the bytes moved; raises
        TransferError on the first failed batch (earlier batches have landed)."""
        engine = self._started()
        moved = 0
        batches = split_batches(entries)
        for i, batch in enumerate(batches):
            lengths = [e.length for e in batch]
            rc = engine.batch_transfer_sync_write(
                peer_session_id, [e.src_addr for e in batch], [e.dst_addr for e in batch], lengths
            )
            if rc != 0:  # 0 is the only success code; failures come back as -1, not exceptions
                raise TransferError(
                    f"Mooncake write to {peer_session_id} failed (rc={rc}) in batch {i + 1}/{len(batches)} "
                    f"of {len(batch)} entries; {moved} bytes landed before it"
                )
            moved += sum(lengths)
        return moved

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


def _has_rdma_device(topology_json: str) -> bool:
    # Shape: {"cpu:0": [[preferred HCAs], [other HCAs]], "cuda:0": [...], ...}
    return any(hca for lists in json.loads(topology_json).values() for hcas in lists for hca in hcas)
