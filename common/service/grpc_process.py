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
# A peer that hangs or sits behind a network cut neither answers nor closes the connection: without
# keepalive a call to it waits out its whole timeout (a decode stream: the router's request
# timeout, 10 minutes by default). With it, a call in flight pings every KEEPALIVE_TIME_MS, also
# while no data flows (a stalled stream), and fails UNAVAILABLE once a ping goes unanswered for
# KEEPALIVE_TIMEOUT_MS. gRPC's own threads answer pings, so a peer busy in a long step still does.
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 20_000, 20_000
PEER_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000),
                        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # else 60 s bounds the keepalive ping too
                        ("grpc.http2.max_pings_without_data", 0)]
# Our servers let those pings in: by default a server answers a client that pings more often than
# every 5 minutes without data with GOAWAY (too many pings), which would end a long stream.
SERVER_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                  ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2)]


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
    server = grpc.aio.server(options=SERVER_OPTIONS)
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
