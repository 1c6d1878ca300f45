"""The router's HTTP API (aiohttp): routes, JSON in and out, and one error shape for everything."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from common.engine.sampling import InvalidRequest
from protos import pdflash_pb2 as pb
from router_svc import auth, openai_api, openapi, sglang_api, sse
from router_svc.dispatch import ROUTE_HEADER
from router_svc.errors import INVALID, ApiError, internal, invalid
from router_svc.frontend import Frontend, Job
from router_svc.generation import Generation
from router_svc.metrics import CONTENT_TYPE

log = logging.getLogger("router_svc")

MAX_BODY_BYTES = 64 << 20  # long prompts as token-id lists outgrow aiohttp's 1 MiB default

FormatEvents = Callable[[Generation, pb.GenerateChunk], list[dict]]  # the SSE events of one chunk


class HttpApi:
    def __init__(self, frontend: Frontend, info: dict[str, Any], api_key: str | None = None):
        self.frontend = frontend
        self.api_key = api_key
        self.info = info  # static facts for /server_info (policy, ports, backends)
        self.model = frontend.model.name
        self.created = int(time.time())
        self.document = openapi.document(secured=api_key is not None)
        frontend.metrics.track_routes(frontend.dispatcher)  # per-backend figures in /metrics, /server_info

    def app(self) -> web.Application:
        checks = [auth.http_middleware(self.api_key)] if self.api_key else []  # the key first, before any work
        app = web.Application(middlewares=[*checks, self._errors], client_max_size=MAX_BODY_BYTES)
        for route in openapi.ROUTES:
            app.router.add_route(route.method, route.path, getattr(self, route.name), name=route.name)
        return app

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = sglang_api.parse(await _read_json(request))
        return await self._serve(request, "generate", req.job, req.stream,
                                 sglang_api.stream_events, sglang_api.response)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "completions", openai_api.parse_completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "chat", openai_api.parse_chat)

    async def _openai(self, request: web.Request, endpoint: str,
                      parse: Callable[[Any], openai_api.OpenAIRequest]) -> web.StreamResponse:
        req = parse(await _read_json(request))
        return await self._serve(
            request, endpoint, req.job, req.stream,
            lambda gen, chunk: openai_api.stream_events(req, gen, chunk, self.model),
            lambda gen: openai_api.response(req, gen, self.model))

    async def _serve(self, request: web.Request, endpoint: str, job: Job, stream: bool,
                     events: FormatEvents, response: Callable[[Generation], dict]) -> web.StreamResponse:
        pin = self.frontend.dispatcher.pin(request.headers.get(ROUTE_HEADER))
        gen = self.frontend.start(endpoint, job)
        chunks = self.frontend.run(gen, pin)
        if stream:
            return await sse.stream(request, chunks, lambda chunk: events(gen, chunk))
        async with aclosing(chunks):
            async for _ in chunks:
                pass
        return web.json_response(response(gen))

    # ---- status -----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(openai_api.models(self.model, self.created, self.frontend.model.max_context))

    async def health(self, request: web.Request) -> web.Response:
        backends = await self.frontend.dispatcher.health()
        down = [f"{h.role} {h.addr}: {h.error or 'not ok'}" for h in backends if not h.ok]
        body = openapi.Health(status="unhealthy" if down else "ok", down=down)
        return web.json_response(body.model_dump(), status=503 if down else 200)

    async def server_info(self, request: web.Request) -> web.Response:
        backends = await self.frontend.dispatcher.health()
        model = self.frontend.model
        # Figures of the requests that passed this router: fleet-wide, and per backend (a pd
        # request counts on its P and its D). Accept lengths: docs/BENCHMARKS.md.
        served = self.frontend.metrics.snapshot()
        return web.json_response(self.info | {
            "model": model.name, "max_context": model.max_context, "vocab_size": model.vocab_size,
            # The backends' dtype is theirs to choose: bytes for each one they may use.
            "kv_bytes_per_token": {"bfloat16": 2 * model.kv_values_per_token, "float32": 4 * model.kv_values_per_token},
            "state_bytes_per_request": model.state_bytes_per_request,
            "backends": [{"role": h.role, "addr": h.addr, "ok": h.ok, "error": h.error or None,
                          "health": MessageToDict(h.reply, always_print_fields_with_no_presence=True)
                          if h.reply else None,
                          "served": served["backends"].get((h.role, h.addr))} for h in backends],
            "fleet": served["fleet"],
        })

    async def metrics(self, request: web.Request) -> web.Response:
        self.frontend.metrics.update_backends(await self.frontend.dispatcher.health())
        return web.Response(body=self.frontend.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self.document)

    # ---- errors -----------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        headers: dict[str, str] = {}
        try:
            return await handler(request)
        except InvalidRequest as e:
            endpoint = request.match_info.route.name
            err = self.frontend.reject(endpoint, e) if endpoint in openapi.GENERATION_ROUTES else invalid(str(e))
        except ApiError as e:  # from a backend; already counted by the frontend
            err = e
        except web.HTTPException as e:  # no such route or method, body too large
            if e.status < 400:
                raise
            err = ApiError(e.status, e.text or e.reason, "not_found_error" if e.status == 404 else INVALID)
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}  # a 405 must name the methods
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            err = internal()
        return web.json_response(err.body(), status=err.status, headers=headers)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        raise InvalidRequest("the request body is empty; expected a JSON object")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except ValueError as e:  # includes bad UTF-8
        raise InvalidRequest(f"invalid JSON: {e}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
