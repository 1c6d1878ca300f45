"""The router's published API (`GET /openapi.json`, built from the request models that validate the
bodies) against what it does: schemathesis sends requests the document allows and requests it
forbids, to a real router in front of real replicas, and every answer must be documented: no 5xx,
a status, content type and body the document lists, and every request the schema forbids refused."""
from __future__ import annotations

from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from router_svc.openapi import ROUTES

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 30  # per route and mode
MAX_TOKENS = 4  # CPU generation is slow: every request the fuzzer sends stops after a few tokens
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")  # OpenAI's; SGLang's is sampling_params.max_new_tokens


@pytest.fixture(scope="module")
def api(colocated_stack) -> schemathesis.BaseSchema:
    """The session's shared colocated stack (conftest.py): the cheapest real backend."""
    api = schemathesis.openapi.from_url(colocated_stack.url + "/openapi.json")
    api.hook(map_body)
    return api


def capped(body: dict, key: str) -> None:
    """Absent (a chat generates to the end of the context), null or above the cap: set to the cap.
    Other values stay: they are what a negative case is testing."""
    value = body.get(key)
    if value is None or (type(value) is int and MAX_TOKENS < value <= 2**31 - 1):
        body[key] = MAX_TOKENS


def map_body(context: Any, body: Any) -> Any:
    if isinstance(body, dict):
        if context.operation.path == "/generate":
            if isinstance(body.get("sampling_params", {}), dict):
                capped(body.setdefault("sampling_params", {}), "max_new_tokens")
        else:
            for key in TOKEN_FIELDS:
                capped(body, key)
    return body


# Each route once with bodies its schema allows, and each route with a body once more with bodies it forbids.
CASES = [(r.method, r.path, mode) for r in ROUTES
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:2 if r.body else 1]]


@pytest.mark.parametrize("method, path, mode", CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_router_answers_as_its_openapi_document_says(api: schemathesis.BaseSchema, method: str, path: str,
                                                      mode: GenerationMode) -> None:
    @given(api[path][method].as_strategy(mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def check(case: schemathesis.Case) -> None:
        # Every check but one: the schema cannot say that prompt + max tokens must fit the context,
        # or which token ids the vocabulary has, so a request it allows may still rightly be a 400.
        case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=120)

    check()


def test_openapi_document_is_open_and_lists_every_route(colocated_stack) -> None:
    doc = requests.get(colocated_stack.url + "/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                 "/server_info", "/metrics", "/openapi.json"}
    chat = doc["components"]["schemas"]["ChatBody"]
    assert chat["additionalProperties"] is False and "messages" in chat["required"]
    assert "securitySchemes" not in doc["components"]  # this stack has no API key
