"""RouterService over gRPC (same path as HTTP, for clients that want no HTTP) and the standard
gRPC health service."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.engine.sampling import InvalidRequest
from common.service.messages import sampling_from_proto
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc
from router_svc.auth import GrpcAuth
from router_svc.errors import ApiError, internal
from router_svc.frontend import Frontend, Job

log = logging.getLogger("router_svc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RouterService"].full_name


class RouterServicer(pb_grpc.RouterServiceServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    async def Generate(self, request: pb.RouterGenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateChunk]:
        try:
            prompt = tuple(request.input_ids) or request.text
            gen = self.frontend.start("grpc", Job(prompt, sampling_from_proto(request.sampling)))
        except InvalidRequest as e:
            err = self.frontend.reject("grpc", e)
            await context.abort(err.grpc_code, err.message)
        try:
            async with aclosing(self.frontend.run(gen)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except ApiError as e:
            await context.abort(e.grpc_code, e.message)
        except Exception:
            log.exception("RouterService.Generate failed")
            err = internal()
            await context.abort(err.grpc_code, err.message)


async def start(frontend: Frontend, host: str, port: int, api_key: str | None = None) -> grpc.aio.Server:
    server = grpc.aio.server(interceptors=[GrpcAuth(api_key)] if api_key else None)
    pb_grpc.add_RouterServiceServicer_to_server(RouterServicer(frontend), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    for service in ("", SERVICE_NAME):  # "" = the whole server
        await checks.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server
