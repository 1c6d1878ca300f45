"""The router's published API (`GET /openapi.json`, built from the request models that validate the
bodies) against what it does, to a real router in front of real replicas. Every answer must be
documented (no 5xx; a status, content type and body the document lists) and a 200 must carry no
error (a streamed answer's events included). Three kinds of request: schemathesis's, from the
document, allowed and forbidden (most of those it allows are still refused: the schema cannot say
that a prompt needs a token or that ids must fit the vocabulary); and bodies built here that the
router must serve, covering every option of each generation route. The negative control puts a
crash into an in-process router's handlers, reachable only by a body it serves, and the same
checks must catch it."""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import requests
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance
from schemathesis.core.failures import FailureGroup

from common.parallel.ports import free_port
from router_svc import config, server
from common.engine.sampling import InvalidRequest
from router_svc.frontend import Job
from router_svc.http_server import HttpApi
from router_svc.openapi import ROUTES
from router_svc.params import INT32_MAX, SEED_MAX

pytestmark = pytest.mark.slow

GENERATED_EXAMPLES = 10  # per route and mode: mostly refusals, which are cheap
SERVED_EXAMPLES = 8  # per generation route: each is a generation
MAX_TOKENS = 2  # CPU generation is slow: every request the fuzzer sends stops after a few tokens
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")  # OpenAI's; SGLang's is sampling_params.max_new_tokens


@pytest.fixture(scope="module")
def api(colocated_stack) -> schemathesis.BaseSchema:
    """The session's shared colocated stack (conftest.py): the cheapest real backend."""
    return _schema(colocated_stack.url)


@pytest.fixture(scope="module")
def vocab_size(colocated_stack) -> int:
    return requests.get(colocated_stack.url + "/server_info", timeout=30).json()["vocab_size"]


def _schema(url: str) -> schemathesis.BaseSchema:
    api = schemathesis.openapi.from_url(url + "/openapi.json")
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


def no_error_in_a_200(ctx: Any, response: Any, case: schemathesis.Case) -> None:
    """A 200 is an answer, not an error in disguise: a streamed one is JSON events ending in
    [DONE], none of them an error (a failure after the headers went out is sent as one)."""
    if response.status_code != 200 or case.operation.path not in GENERATION_PATHS:
        return
    if not (isinstance(case.body, dict) and case.body.get("stream")):
        assert "error" not in json.loads(response.content), response.content[:500]
        return
    events = [e.removeprefix("data: ") for e in response.content.decode().split("\n\n") if e.strip()]
    assert events and events[-1] == "[DONE]", f"the stream does not end in [DONE]: {events[-3:]}"
    errors = [e for e in events[:-1] if "error" in json.loads(e)]
    assert not errors, f"error events in a 200 stream: {errors}"


def served(ctx: Any, response: Any, case: schemathesis.Case) -> None:
    """For bodies built to be served (schemathesis's own check skips cases it did not generate)."""
    assert response.status_code == 200, f"a body the router must serve got {response.status_code}: " \
                                        f"{response.content[:300]!r}"


def fuzz(strategy: st.SearchStrategy, max_examples: int, must_serve: bool) -> None:
    """Send every case `strategy` makes and check its answer. `must_serve`: every body is one the
    router must serve (a 200); otherwise it may refuse one the schema allows, as said above."""

    @given(strategy)
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(additional_checks=[no_error_in_a_200, *[served] * must_serve],
                               excluded_checks=[positive_data_acceptance], timeout=120)

    check()


# ---- schemathesis's requests --------------------------------------------------------------------

# Each route once with bodies its schema allows, and each route with a body once more with bodies it forbids.
CASES = [(r.method, r.path, mode) for r in ROUTES
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:2 if r.body else 1]]


@pytest.mark.parametrize("method, path, mode", CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_router_answers_as_its_openapi_document_says(api: schemathesis.BaseSchema, method: str, path: str,
                                                      mode: GenerationMode) -> None:
    fuzz(api[path][method].as_strategy(mode), GENERATED_EXAMPLES, must_serve=False)


# ---- bodies the router must serve ---------------------------------------------------------------

GENERATION_PATHS = tuple(r.path for r in ROUTES if r.body is not None)
short_text = st.text(max_size=24)
budget = st.integers(1, MAX_TOKENS)


def _bodies(path: str, vocab_size: int) -> st.SearchStrategy[dict]:
    """Bodies of `path` the router must serve, with a small token budget: every option, in every
    shape it takes, at values it accepts. Each body sets most options (each one in three bodies of
    four, null in the fourth, as OpenAI clients send), so that a few bodies reach the code behind
    every option; leaving options out is what schemathesis's bodies do."""
    ids = st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=32)
    sampling = {"temperature": st.just(0) | st.floats(0, 4), "top_p": st.floats(0, 1, exclude_min=True),
                "top_k": st.integers(-1, 100) | st.just(INT32_MAX),
                "stop": short_text | st.lists(short_text, max_size=3),
                "stop_token_ids": st.lists(st.integers(0, vocab_size - 1), max_size=3),
                "seed": st.integers(0, SEED_MAX), "ignore_eos": st.booleans()}
    stream = {"stream": st.booleans()}
    if path == "/generate":
        prompt = (st.fixed_dictionaries({"text": st.text(min_size=1, max_size=64)})
                  | st.fixed_dictionaries({"input_ids": ids}))
        params = st.fixed_dictionaries({"max_new_tokens": budget} | often(sampling))
        return st.tuples(prompt, st.fixed_dictionaries({"sampling_params": params} | often(stream))).map(_merged)
    # max_completion_tokens wins over max_tokens: either, or both with any valid max_tokens.
    tokens = (st.fixed_dictionaries({"max_tokens": budget}) | st.fixed_dictionaries({"max_completion_tokens": budget})
              | st.fixed_dictionaries({"max_completion_tokens": budget, "max_tokens": st.integers(1, INT32_MAX)}))
    openai = sampling | stream | {
        "model": short_text, "user": short_text,
        "stream_options": st.fixed_dictionaries(often({"include_usage": st.booleans()})),
        "n": st.just(1), "frequency_penalty": st.sampled_from([0, 0.0]), "presence_penalty": st.sampled_from([0, 0.0]),
        "logit_bias": st.just({})}
    if path == "/v1/completions":
        prompt = st.text(min_size=1, max_size=64) | ids
        extra = {"echo": st.just(False), "best_of": st.just(1), "suffix": st.just(""), "logprobs": st.none()}
        first = st.fixed_dictionaries({"prompt": prompt | st.lists(prompt, min_size=1, max_size=1)})
    else:
        part = st.fixed_dictionaries({"type": st.just("text")} | often({"text": short_text}))
        message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                         "content": short_text | st.lists(part, max_size=3)}
                                        | often({"name": short_text}))
        extra = {"logprobs": st.just(False), "top_logprobs": st.none(), "tools": st.just([]),
                 "tool_choice": st.just("none"), "response_format": st.just({"type": "text"})}
        first = st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)})
    return st.tuples(first, tokens, st.fixed_dictionaries(often(openai | extra))).map(_merged)


def often(fields: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    return {name: st.one_of(value, value, value, st.none()) for name, value in fields.items()}


def _merged(parts: tuple[dict, ...]) -> dict:
    return {k: v for part in parts for k, v in part.items()}


def to_serve(api: schemathesis.BaseSchema, path: str, vocab_size: int) -> st.SearchStrategy[schemathesis.Case]:
    op = api[path]["POST"]
    return _bodies(path, vocab_size).map(lambda body: op.Case(body=body, media_type="application/json"))


@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_router_serves_every_option_of_its_generation_routes(api: schemathesis.BaseSchema, vocab_size: int,
                                                             path: str) -> None:
    fuzz(to_serve(api, path, vocab_size), SERVED_EXAMPLES, must_serve=True)


# ---- negative control ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """A bug in the router's request handler, for the accepted requests it `hits`: a crash before
    the answer (a 500), a crash after the headers went out (a 200 with an error event), or a
    refusal (a 400) of a body it must serve."""
    path: str
    hits: Callable[[Job, bool], bool]  # (the validated request, whether it streams)
    kind: str  # "crash", "crash mid-stream" or "refusal"
    caught_as: str  # what the fuzzer's report says


FAULTS = {
    "generate with stop strings crashes": Fault("/generate", lambda job, stream: bool(job.sampling.stop), "crash",
                                                "Server error"),
    "a completion of token ids crashes": Fault("/v1/completions", lambda job, stream: isinstance(job.prompt, tuple),
                                               "crash", "Server error"),
    "a streamed chat crashes mid-stream": Fault("/v1/chat/completions", lambda job, stream: stream, "crash mid-stream",
                                                "error events in a 200 stream"),
    "a chat with a seed is refused": Fault("/v1/chat/completions", lambda job, stream: job.sampling.seed is not None,
                                           "refusal", "a body the router must serve got 400"),
}


class FaultyApi(HttpApi):
    fault: Fault | None = None
    url = ""

    async def _serve(self, request: web.Request, endpoint: str, job: Job, stream: bool, events: Any,
                     response: Any) -> web.StreamResponse:
        fault = self.fault
        if fault is not None and request.path == fault.path and fault.hits(job, stream):
            if fault.kind == "refusal":
                raise InvalidRequest("injected refusal")
            if fault.kind == "crash":
                raise RuntimeError("injected fault")
            events = _crashing
        return await super()._serve(request, endpoint, job, stream, events, response)


def _crashing(*_: Any) -> list[dict]:
    raise RuntimeError("injected fault while streaming")


@contextmanager
def faulty_router(replicas: list[str]) -> Iterator[FaultyApi]:
    """The router in this process, in front of `replicas`, serving HTTP from a thread of its own."""
    port = free_port()
    cfg = config.parse_args(["--policy", "round_robin", "--replicas", ",".join(replicas), "--port", str(port)])

    async def start() -> tuple[web.AppRunner, FaultyApi]:
        api = FaultyApi(server.frontend(cfg), {})
        api.url = f"http://127.0.0.1:{port}"
        runner = web.AppRunner(api.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, api

    async def stop() -> None:
        await runner.cleanup()
        await api.frontend.dispatcher.close()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, api = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    try:
        yield api
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture(scope="module")
def faulty(colocated_stack) -> Iterator[FaultyApi]:
    with faulty_router([w.addr for w in colocated_stack.workers]) as api:
        yield api


@pytest.mark.parametrize("name", FAULTS)
def test_a_bug_behind_a_served_body_is_caught(faulty: FaultyApi, vocab_size: int, name: str) -> None:
    fault = FAULTS[name]
    faulty.fault = fault
    api = _schema(faulty.url)
    try:
        with pytest.raises(FailureGroup) as caught:
            fuzz(to_serve(api, fault.path, vocab_size), SERVED_EXAMPLES, must_serve=True)
    finally:
        faulty.fault = None
    assert fault.caught_as in str(caught.value), caught.value
    # Without the fault the same router serves the same bodies.
    fuzz(to_serve(api, fault.path, vocab_size), 2, must_serve=True)


def test_openapi_document_is_open_and_lists_every_route(colocated_stack) -> None:
    doc = requests.get(colocated_stack.url + "/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                 "/server_info", "/metrics", "/openapi.json"}
    chat = doc["components"]["schemas"]["ChatBody"]
    assert chat["additionalProperties"] is False and "messages" in chat["required"]
    assert "securitySchemes" not in doc["components"]  # this stack has no API key
