"""What a service does about the other ranks and nodes of a parallel instance.

Node 0 serves the instance; when a worker rank dies or a node of it is lost, `watch_nodes` takes
it out of service: health NOT_SERVING at once (the router stops routing to it), the requests in
flight failed with the reason (once a lost node's ranks have stopped), then the driver exits, or,
for an instance over several nodes, starts over in place and waits for the nodes again
(ParallelRunner, common.parallel.rejoin).

Every other node runs `serve_node`: its ranks, and the standard gRPC health on --host:--port
(SERVING once joined to node 0), nothing else; it starts over in place too when it loses node 0
or a rank of its own, unless it was told to stop.
"""
from __future__ import annotations

import argparse
import asyncio
import logging

from grpc_health.v1 import health, health_pb2

from common.parallel.driver import ParallelRunner
from common.parallel.rejoin import restart_in_place
from common.runner.model_runner import ModelRunner
from common.service.engine_loop import EngineLoop
from common.service.grpc_process import serve_grpc
from common.service.loader import ModelOptions, start_node
from common.service.tls import Tls


def watch_nodes(runner: ModelRunner, loop: EngineLoop, checks: health.aio.HealthServicer) -> None:
    if not isinstance(runner, ParallelRunner):
        return
    aio = asyncio.get_running_loop()

    def lost(why: str, grace_s: float) -> None:  # on the thread that saw it
        loop.take_out_of_service(why, grace_s)
        aio.call_soon_threadsafe(aio.create_task, checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING))

    runner.on_lost = lost


async def serve_node(args: argparse.Namespace, opts: ModelOptions, role: str, log: logging.Logger,
                     stop: asyncio.Event) -> None:
    """Run this host's ranks until node 0 stops them, or this node is stopped (exit code 1)."""
    nodes = args.nodes
    log.info("node %d of %d of a %s instance: waiting for node 0 at %s", nodes.node_rank, nodes.nnodes, role,
             nodes.dist_init_addr)
    agent = await asyncio.to_thread(start_node, opts)
    server = await serve_grpc(args.host, args.port, lambda s: None, Tls.from_args(args))
    log.info("node %d of %d: runs ranks %d-%d of the %s instance; node 0 (%s) serves its requests, this node only "
             "its gRPC health on %s:%d", nodes.node_rank, nodes.nnodes, agent.ranks.start, agent.ranks.stop - 1, role,
             nodes.dist_init_addr.rpartition(":")[0], args.host, args.port)
    finished = asyncio.ensure_future(asyncio.to_thread(agent.done.wait))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({finished, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not finished.done():
        agent.stop()
    stopped.cancel()
    await server.stop(grace=1)
    if agent.exit_code and not stop.is_set():
        restart_in_place(agent.why)
    if agent.exit_code:
        raise SystemExit(agent.exit_code)
