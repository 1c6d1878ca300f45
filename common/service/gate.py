"""A service's gRPC from the moment its process starts: until the instance can serve (the model
loading, the nodes of an instance over several hosts joining, again after a lost node, see
common.parallel.rejoin) its port answers at once rather than refusing connections: the standard
health NOT_SERVING, and every call of the service, its own Health too, UNAVAILABLE saying why.
Once open, the calls go to the servicer."""
from __future__ import annotations

from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2

from common.parallel.cluster import Nodes
from common.parallel.rejoin import not_serving_why
from common.service.grpc_process import serve_grpc
from common.service.tls import Tls


async def serve_gated(host: str, port: int, service: str, nodes: Nodes,
                      tls: Tls | None) -> tuple[grpc.aio.Server, "Gate", health.aio.HealthServicer]:
    """The service's server, its gate shut (saying what this process waits for) and its health."""
    checks = health.aio.HealthServicer()
    gate = Gate(service, not_serving_why(nodes))
    return await serve_grpc(host, port, gate.add_to, tls, checks, serving=False), gate, checks


class Gate(grpc.GenericRpcHandler):
    def __init__(self, service: str, why: str):
        self.why = why  # why the instance is not serving yet
        self._prefix = f"/{service}/"
        self._methods: dict[str, grpc.RpcMethodHandler] | None = None  # the servicer's, once open

    def add_to(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((self,))

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if not details.method.startswith(self._prefix):
            return None
        if self._methods is not None:
            return self._methods.get(details.method[len(self._prefix):])
        # Whatever the method's shape, a call ends with its status: no request to read, no reply.
        return grpc.unary_unary_rpc_method_handler(self._refuse)

    async def open(self, add_servicer: Callable[[Any, Any], None], servicer: Any,
                   checks: health.aio.HealthServicer) -> None:
        """From now on the calls go to `servicer`, added by its generated add_*Servicer_to_server."""
        methods = _Methods()
        add_servicer(servicer, methods)
        self._methods = methods.handlers
        await checks.set("", health_pb2.HealthCheckResponse.SERVING)

    async def _refuse(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"not in service yet: {self.why}")


class _Methods:
    """Takes what a generated add_*Servicer_to_server registers on a server."""

    def __init__(self):
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same methods come registered by name below

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = handlers
