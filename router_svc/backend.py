"""One P or D instance as the router sees it: its channel, stub and Health."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from common.service.grpc_process import peer_channel
from common.service.tls import Tls
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

CONTROL_RPC_TIMEOUT_S = 5.0  # Health and Abort


@dataclass(frozen=True)
class BackendHealth:
    role: str
    addr: str
    reply: pb.HealthReply | None  # None: the Health RPC failed
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.reply is not None and self.reply.ok


@dataclass
class Backend:
    role: str  # "prefill", "decode" or "replica" (a decode service that prefills locally)
    addr: str  # gRPC host:port
    channel: grpc.aio.Channel
    stub: Any  # PrefillServiceStub or DecodeServiceStub; both have Health and Abort

    @classmethod
    def connect(cls, role: str, addr: str, tls: Tls | None = None) -> Backend:
        channel = peer_channel(addr, tls)  # connects lazily, so backends may start later
        stub = pb_grpc.PrefillServiceStub(channel) if role == "prefill" else pb_grpc.DecodeServiceStub(channel)
        return cls(role, addr, channel, stub)

    @property
    def label(self) -> str:
        return f"{self.role} {self.addr}"

    async def health(self, timeout: float = CONTROL_RPC_TIMEOUT_S) -> BackendHealth:
        try:
            reply = await self.stub.Health(pb.HealthRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return BackendHealth(self.role, self.addr, None, f"{e.code().name}: {e.details()}")
        return BackendHealth(self.role, self.addr, reply)
