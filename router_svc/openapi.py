"""The router's HTTP routes, and the OpenAPI 3.1 document (`GET /openapi.json`) made from them: each
request body's schema is its pydantic model's, the same model that validates it, so the document
cannot drift from what the router accepts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from router_svc import auth
from router_svc.errors import ErrorBody
from router_svc.openai_api import ChatBody, CompletionBody
from router_svc.sglang_api import GenerateBody

SCHEMAS = "#/components/schemas/{model}"
OBJECT = {"application/json": {"schema": {"type": "object"}}}
# Generation answers one JSON object, or server-sent events when the body says "stream": true:
# each event's data is a JSON object (an error's too), the last one's is "[DONE]".
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
GENERATED = OBJECT | {"text/event-stream": {"schema": SSE_EVENT}}
# What a generation route may answer besides 200, and why.
GENERATION_ERRORS = {400: "invalid request (the message names the field)", 500: "a bug in the router",
                     502: "a backend is down or failed", 503: "no free KV pages on a backend: retry later",
                     504: "a backend took too long (bootstrap, transfer, or the request timeout)"}


class Health(BaseModel):
    status: str  # "ok" or "unhealthy"
    down: list[str]  # "ROLE HOST:PORT: why" of each backend that is not ok


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    name: str  # HttpApi's handler, the operationId and, for generation, the metrics' endpoint label
    summary: str
    body: type[BaseModel] | None = None  # the request body's model
    ok: dict[str, Any] | type[BaseModel] = field(default_factory=lambda: OBJECT)  # a 200's content, or its JSON
    errors: dict[int, str] = field(default_factory=lambda: {500: "a bug in the router"})
    error_model: type[BaseModel] = ErrorBody

    @property
    def open(self) -> bool:
        return self.path in auth.OPEN_PATHS


ROUTES = (
    Route("POST", "/generate", "generate", "Generate (SGLang's native API)", GenerateBody, GENERATED,
          GENERATION_ERRORS),
    Route("POST", "/v1/completions", "completions", "Completion (OpenAI)", CompletionBody, GENERATED,
          GENERATION_ERRORS),
    Route("POST", "/v1/chat/completions", "chat", "Chat completion (OpenAI)", ChatBody, GENERATED, GENERATION_ERRORS),
    Route("GET", "/v1/models", "models", "The one model served (OpenAI)"),
    Route("GET", "/health", "health", "Whether every backend is up", ok=Health, errors={503: "a backend is down"},
          error_model=Health),
    Route("GET", "/server_info", "server_info", "Configuration, backends' health and served figures"),
    Route("GET", "/metrics", "metrics", "Prometheus metrics", ok={"text/plain": {"schema": {"type": "string"}}}),
    Route("GET", "/openapi.json", "openapi", "This document"),
)
GENERATION_ROUTES = tuple(r.name for r in ROUTES if r.body is not None)


def document(secured: bool) -> dict[str, Any]:
    """With `secured` (the router has an API key) every route but the open ones needs the bearer token."""
    models = {m for r in ROUTES for m in (r.body, r.ok, r.error_model) if isinstance(m, type)}
    refs, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                    ref_template=SCHEMAS)
    json = lambda model: {"application/json": {"schema": refs[model, "validation"]}}  # noqa: E731
    paths: dict[str, dict] = {}
    for r in ROUTES:
        errors = r.errors | ({401: "missing or wrong API key"} if secured and not r.open else {})
        responses = {"200": {"description": "OK", "content": json(r.ok) if isinstance(r.ok, type) else r.ok}} | {
            str(status): {"description": why, "content": json(r.error_model)} for status, why in sorted(errors.items())}
        op: dict[str, Any] = {"operationId": r.name, "summary": r.summary, "responses": responses}
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": json(r.body)}
        if secured and not r.open:
            op["security"] = [{"bearer": []}]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    components: dict[str, Any] = {"schemas": defs.get("$defs", {})}
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {"openapi": "3.1.0", "info": {"title": "pdflash router", "version": "1"},
            "paths": paths, "components": components}
