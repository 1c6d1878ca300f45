"""The router's command line, parsed once into a frozen config."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from common.service.tls import Tls, add_tls_args

POLICIES = ("pd", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    host: str
    port: int  # HTTP
    grpc_port: int
    policy: str
    prefill: tuple[str, ...]  # pd: P instances' gRPC host:port
    decode: tuple[str, ...]  # pd: D instances; round_robin: the colocated replicas
    model: str | None  # None: the embedded default model
    request_timeout: float  # a whole request, from arrival to the last token
    transfer_deadline: float  # deadline_s given to P and D: bootstrap + KV transfer
    api_key: str | None  # clients must send `Authorization: Bearer <api_key>` (all but /health)
    tls: Tls | None  # mutual TLS towards P and D
    allow_route_header: bool = False  # requests may name their instances (tests and debugging)

    @property
    def roles(self) -> list[tuple[str, str]]:
        """(role, address) of every backend."""
        decode_role = "decode" if self.policy == "pd" else "replica"
        return [("prefill", a) for a in self.prefill] + [(decode_role, a) for a in self.decode]


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="python -m router_svc",
                                description="pdflash router: HTTP (SGLang + OpenAI) and gRPC in front of P/D")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve HTTP and gRPC on (0.0.0.0 or a node address to serve other hosts)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, help="RouterService port (default: --port + 1)")
    p.add_argument("--policy", choices=POLICIES, default="pd",
                   help="pd: pair a prefill and a decode instance; round_robin: colocated replicas")
    p.add_argument("--prefill", type=_addresses, default=(), help="pd: P addresses host:port[,host:port...]")
    p.add_argument("--decode", type=_addresses, default=(), help="pd: D addresses host:port[,...]")
    p.add_argument("--replicas", type=_addresses, default=(), help="round_robin: replica addresses host:port[,...]")
    p.add_argument("--model", help="GGUF file or Hugging Face folder (default: the embedded model)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request, end to end")
    p.add_argument("--transfer-deadline", type=float, default=60.0,
                   help="seconds P and D get for a room's bootstrap + KV transfer (the deadline_s they are sent)")
    p.add_argument("--api-key", default=os.environ.get("PDFLASH_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $PDFLASH_API_KEY)")
    p.add_argument("--allow-route-header", action="store_true",
                   help="tests and debugging: let a request name its instances with the header "
                        "`X-PDflash-Route: p=I,d=J` (0-based, in the order of --prefill and --decode)")
    add_tls_args(p)
    a = p.parse_args(argv)
    if a.policy == "pd" and (not a.prefill or not a.decode or a.replicas):
        p.error("--policy pd needs --prefill and --decode (and no --replicas)")
    if a.policy == "round_robin" and (not a.replicas or a.prefill or a.decode):
        p.error("--policy round_robin needs --replicas (and no --prefill/--decode)")
    if a.request_timeout <= 0 or a.transfer_deadline <= 0:
        p.error("--request-timeout and --transfer-deadline must be positive")
    return RouterConfig(
        host=a.host, port=a.port, grpc_port=a.grpc_port or a.port + 1, policy=a.policy,
        prefill=a.prefill, decode=a.decode or a.replicas, model=a.model, request_timeout=a.request_timeout,
        transfer_deadline=a.transfer_deadline, api_key=a.api_key, tls=Tls.from_args(a),
        allow_route_header=a.allow_route_header,
    )


def _addresses(value: str) -> tuple[str, ...]:
    addrs = tuple(a.strip() for a in value.split(",") if a.strip())
    for a in addrs:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"{a!r} is not host:port")
    return addrs
