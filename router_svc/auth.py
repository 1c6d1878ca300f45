"""The router's API key (`--api-key`, `PDFLASH_API_KEY`): every HTTP route but /health and
/openapi.json, and every RouterService RPC, needs `Authorization: Bearer <key>`, as with SGLang and
vLLM. /health and the standard gRPC health service stay open: load balancers and `pdflash up` probe
them keyless. /openapi.json says only what every pdflash router accepts, and client generators
fetch it before they have a key."""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web

from router_svc.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/openapi.json"})
GRPC_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def authorized(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest: the time taken says nothing about how much of the key a guess got right
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def unauthorized() -> ApiError:
    return ApiError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                    "authentication_error", grpc.StatusCode.UNAUTHENTICATED)


def http_middleware(key: str):
    @web.middleware
    async def check_key(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                        ) -> web.StreamResponse:
        if request.path in OPEN_PATHS or authorized(request.headers.get("Authorization"), key):
            return await handler(request)
        err = unauthorized()
        return web.json_response(err.body(), status=err.status, headers={"WWW-Authenticate": "Bearer"})

    return check_key


class GrpcAuth(grpc.aio.ServerInterceptor):
    def __init__(self, key: str):
        self.key = key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(GRPC_HEALTH_PREFIX):
            return handler
        if authorized(dict(details.invocation_metadata or ()).get("authorization"), self.key):
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_refuse_stream)
        return grpc.unary_unary_rpc_method_handler(_refuse)


async def _refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
    err = unauthorized()
    await context.abort(err.grpc_code, err.message)


async def _refuse_stream(request: bytes, context: grpc.aio.ServicerContext):
    await _refuse(request, context)
    yield  # never reached: makes this an async generator, as a streaming handler must be
