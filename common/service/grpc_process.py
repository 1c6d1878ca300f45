"""What every pdflash service process shares: logging, uvloop, a gRPC server with the
standard health service, and the options of channels between our own services."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.model.errors import ModelNotFound
from common.runner.layout import ParallelConfigError
from common.service.tls import Tls

# Channels between our own services (router -> P/D, D -> P, P -> D). gRPC's default reconnect
# backoff grows to 120 s, so a peer restarted by `pdflash up` would be refused for tens of seconds
# after it is back; between our processes, retrying every second at most is cheap.
PEER_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]


def peer_channel(addr: str, tls: Tls | None) -> grpc.aio.Channel:
    """An asyncio channel to another of our services (connects lazily); mutual TLS if given."""
    if tls is None:
        return grpc.aio.insecure_channel(addr, options=PEER_CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(addr, tls.channel_credentials(), options=PEER_CHANNEL_OPTIONS)


def setup_logging(role: str) -> logging.Logger:
    level = os.environ.get("PDFLASH_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    return logging.getLogger(role)


class ListenError(OSError):
    """The service's port cannot be listened on (in use, or not an address of this host)."""


async def serve_grpc(host: str, port: int, add_servicers, tls: Tls | None = None,
                     health_servicer: health.aio.HealthServicer | None = None, serving: bool = True) -> grpc.aio.Server:
    """Start a grpc.aio server with our servicers and the standard health service (SERVING, or
    NOT_SERVING until the caller says otherwise); with `tls`, only peers with a certificate
    signed by its CA get through the handshake."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20),
                                      ("grpc.max_send_message_length", 256 << 20)])
    add_servicers(server)
    health_servicer = health_servicer or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    try:
        bound = (server.add_insecure_port(address) if tls is None
                 else server.add_secure_port(address, tls.server_credentials()))
    except RuntimeError as e:  # grpc's word for a port in use
        raise ListenError(f"cannot listen on {host}:{port}: {e}") from None
    if bound == 0:
        raise ListenError(f"cannot listen on {host}:{port}")
    await server.start()
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set("", status)
    return server


def run_service(main_coro) -> None:
    """Run a service's async main on uvloop until SIGINT/SIGTERM, then stop it cleanly."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main_coro(stop)

    try:
        asyncio.run(runner())
    except (ParallelConfigError, ListenError, ModelNotFound) as e:  # a usage error: one line, no traceback
        print(f"python -m {sys.modules['__main__'].__spec__.parent}: error: {e}", file=sys.stderr)
        sys.exit(2)
