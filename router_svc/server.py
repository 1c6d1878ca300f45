"""The router process: read the model's config and tokenizer, connect to the backends, serve HTTP
and gRPC until SIGINT/SIGTERM.

A request's path: http_server / grpc_server parse it (sglang_api, openai_api) -> frontend tokenizes
and validates -> dispatch picks P and D and fans the request out -> chunks flow back through
frontend (metrics) -> formatted as JSON or SSE (sse)."""
from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from common.model.tokenizer import Tokenizer
from common.model.source import resolve_model
from router_svc import grpc_server
from router_svc.config import RouterConfig
from router_svc.backend import Backend
from router_svc.dispatch import Dispatcher
from router_svc.frontend import Frontend
from router_svc.http_server import HttpApi
from router_svc.metrics import Metrics
from router_svc.model_info import read_model_info

log = logging.getLogger("router_svc")

SHUTDOWN_GRACE_S = 5.0  # for requests in flight at SIGTERM


def frontend(cfg: RouterConfig) -> Frontend:
    """The model's facts, its tokenizer and a dispatcher polling the backends (call it on the
    event loop that serves)."""
    src = resolve_model(cfg.model)
    model = read_model_info(src)
    tokenizer = Tokenizer(src)  # weights are never loaded here
    tokenizer.load_chat_template()  # the slow step (seconds): before the router says it is ready
    backends = [Backend.connect(role, addr, cfg.tls) for role, addr in cfg.roles]
    dispatcher = Dispatcher([b for b in backends if b.role == "prefill"],
                            [b for b in backends if b.role != "prefill"], cfg.request_timeout,
                            cfg.transfer_deadline, cfg.allow_route_header)
    dispatcher.start()
    return Frontend(model, tokenizer, dispatcher, Metrics())


async def serve(cfg: RouterConfig) -> None:
    front = frontend(cfg)
    info = {"policy": cfg.policy, "grpc_port": cfg.grpc_port, "request_timeout": cfg.request_timeout,
            "transfer_deadline": cfg.transfer_deadline,
            "prefill": list(cfg.prefill), "decode" if cfg.policy == "pd" else "replicas": list(cfg.decode)}
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its room.
    runner = web.AppRunner(HttpApi(front, info, cfg.api_key).app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    grpc_srv = await grpc_server.start(front, cfg.host, cfg.grpc_port, cfg.api_key)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    backends_desc = ", ".join(f"{role} {addr}" for role, addr in cfg.roles)
    print(f"pdflash router ready: http://{cfg.host}:{cfg.port} grpc {cfg.host}:{cfg.grpc_port} "
          f"policy={cfg.policy} model={front.model.name} backends: {backends_desc}", flush=True)
    await stop.wait()

    log.info("shutting down")
    # Requests still running after the grace period are cancelled, which aborts their rooms
    # (pdflash up stops the router before the workers, so the aborts reach them).
    await asyncio.gather(grpc_srv.stop(grace=SHUTDOWN_GRACE_S), runner.cleanup())
    await front.dispatcher.close()
