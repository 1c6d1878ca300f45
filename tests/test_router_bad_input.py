"""Bad input to the real router process answers 4xx with a JSON error message, never a 500 or a
traceback. The router validates before dispatching, so its backends here are dead addresses;
the few tests that do dispatch check that dead backends are a clear 503, not a crash."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_router_process import RouterProcess, dead_backend_args

from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

CONTEXT = 8192  # the embedded model's
LONG_IDS = [1] * (CONTEXT + 10)


@pytest.fixture(scope="module")
def router() -> Iterator[RouterProcess]:
    with RouterProcess(*dead_backend_args(), "--request-timeout", "5") as r:
        yield r
    assert "Traceback" not in r.output, r.output


def post(router: RouterProcess, path: str, body: Any) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(router.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30)


def assert_client_error(resp: requests.Response, status: int = 400, says: str = "") -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["message"] and error["type"], error
    assert says.lower() in error["message"].lower(), error["message"]
    return error


def sp(**params: Any) -> dict:
    return {"text": "Hello", "sampling_params": params}


GENERATE_CASES = [
    (b'{"text": "hi"', "invalid JSON"),
    (b"", "empty"),
    (b"\xff\xfe{}", "invalid JSON"),
    (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "NaN"),
    ([1, 2], "must be a JSON object"),
    ({}, "exactly one of text"),
    ({"text": "a", "input_ids": [1]}, "exactly one of text"),
    ({"text": ""}, "empty"),
    ({"input_ids": []}, "empty"),
    ({"text": 123}, "text must be a string"),
    ({"text": ["a", "b"]}, "text must be a string"),
    ({"input_ids": ["a"]}, "list of integers"),
    ({"input_ids": [1, True]}, "list of integers"),
    ({"input_ids": [10**9]}, "outside the vocabulary"),
    ({"input_ids": [-1]}, "outside the vocabulary"),
    ({"input_ids": LONG_IDS}, "context"),
    ({"text": "hi", "stream": "yes"}, "stream must be true or false"),
    ({"text": "hi", "rid": "x"}, "unknown or unsupported field"),
    ({"text": "hi", "sampling_params": "greedy"}, "sampling_params must be a JSON object"),
    (sp(max_new_tokens=0), "max_new_tokens"),
    (sp(max_new_tokens=-5), "max_new_tokens"),
    (sp(max_new_tokens="10"), "max_new_tokens must be an integer"),
    (sp(max_new_tokens=1.5), "max_new_tokens must be an integer"),
    (sp(max_new_tokens=CONTEXT), "exceeds the model's context"),
    (sp(max_new_tokens=10**30), "max_new_tokens"),
    (sp(temperature="hot"), "temperature must be a finite number"),
    (sp(temperature=-1), "temperature"),
    (b'{"text": "hi", "sampling_params": {"temperature": 1e999}}', "temperature must be a finite number"),
    (sp(top_p=0), "top_p"),
    (sp(top_p=1.5), "top_p"),
    (sp(top_k="x"), "top_k must be an integer"),
    (sp(top_k=-2), "top_k"),
    (sp(stop=5), "stop must be a string or a list of strings"),
    (sp(stop=["a", 1]), "stop must be"),
    (sp(stop_token_ids=["a"]), "stop_token_ids"),
    (sp(stop_token_ids=[10**9]), "outside the vocabulary"),
    (sp(seed=-1), "seed"),
    (sp(seed="x"), "seed must be an integer"),
    (sp(seed=2**70), "seed"),
    (sp(ignore_eos="yes"), "ignore_eos must be true or false"),
    (sp(frequency_penalty=0.5), "unknown or unsupported field"),
]


@pytest.mark.parametrize("body, says", GENERATE_CASES, ids=[f"gen{i}" for i in range(len(GENERATE_CASES))])
@pytest.mark.parametrize("stream", [False, True])
def test_generate_bad_input(router: RouterProcess, body: Any, says: str, stream: bool) -> None:
    if stream and isinstance(body, dict) and "stream" not in body:
        body = body | {"stream": True}
    assert_client_error(post(router, "/generate", body), says=says)


def msgs(content: Any = "Hello") -> list[dict]:
    return [{"role": "user", "content": content}]


COMPLETION_CASES = [
    ({"model": "m"}, "prompt is required"),
    ({"model": "m", "prompt": ""}, "empty"),
    ({"model": "m", "prompt": []}, "empty"),
    ({"model": "m", "prompt": 5}, "prompt must be"),
    ({"model": "m", "prompt": ["a", "b"]}, "batched prompts"),
    ({"model": "m", "prompt": [[1], [2]]}, "batched prompts"),
    ({"model": "m", "prompt": LONG_IDS}, "context"),
    ({"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "prompt": "hi", "max_tokens": CONTEXT}, "exceeds the model's context"),
    ({"model": "m", "prompt": "hi", "n": 2}, "n=2 is not supported"),
    ({"model": "m", "prompt": "hi", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "hi", "echo": True}, "echo"),
    ({"model": "m", "prompt": "hi", "logprobs": 5}, "logprobs"),
    ({"model": "m", "prompt": "hi", "temperature": "x"}, "temperature"),
    ({"model": "m", "prompt": "hi", "stop": 5}, "stop"),
    ({"model": "m", "prompt": "hi", "seed": 1.5}, "seed"),
    ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "hi", "stream": True, "stream_options": {"foo": 1}}, "stream_options"),
    ({"model": "m", "prompt": "hi", "presence_penalty": 1}, "presence_penalty"),
    ({"model": 5, "prompt": "hi"}, "model must be a string"),
    ({"model": "m", "prompt": "hi", "foo": 1}, "unknown or unsupported field(s) in the request body: foo"),
]

CHAT_CASES = [
    ({"model": "m"}, "messages is required"),
    ({"model": "m", "messages": []}, "non-empty list"),
    ({"model": "m", "messages": "hi"}, "non-empty list"),
    ({"model": "m", "messages": ["hi"]}, "messages[0] must be a JSON object"),
    ({"model": "m", "messages": [{"content": "hi"}]}, "role"),
    ({"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "content"),
    ({"model": "m", "messages": msgs(5)}, "content"),
    ({"model": "m", "messages": msgs([{"type": "image_url", "image_url": {"url": "x"}}])}, "only text parts"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi", "extra": 1}]}, "messages[0]"),
    ({"model": "m", "messages": msgs(), "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"model": "m", "messages": msgs(), "max_tokens": "many"}, "max_tokens"),
    ({"model": "m", "messages": msgs(), "max_tokens": CONTEXT}, "exceeds the model's context"),
    ({"model": "m", "messages": msgs("word " * CONTEXT)}, "context"),
    ({"model": "m", "messages": msgs(), "n": 3}, "n=3"),
    ({"model": "m", "messages": msgs(), "tools": [{"type": "function"}]}, "tools"),
    ({"model": "m", "messages": msgs(), "logprobs": True}, "logprobs"),
    ({"model": "m", "messages": msgs(), "top_p": -0.5}, "top_p"),
    ({"model": "m", "messages": msgs(), "frobnicate": True}, "frobnicate"),
]


@pytest.mark.parametrize("body, says", COMPLETION_CASES, ids=[f"cmpl{i}" for i in range(len(COMPLETION_CASES))])
def test_completions_bad_input(router: RouterProcess, body: Any, says: str) -> None:
    assert_client_error(post(router, "/v1/completions", body), says=says)


@pytest.mark.parametrize("body, says", CHAT_CASES, ids=[f"chat{i}" for i in range(len(CHAT_CASES))])
def test_chat_bad_input(router: RouterProcess, body: Any, says: str) -> None:
    assert_client_error(post(router, "/v1/chat/completions", body), says=says)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_invalid_json_everywhere(router: RouterProcess, path: str) -> None:
    assert_client_error(post(router, path, b"{not json"), says="invalid JSON")


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("kwargs, says", [
    ({"prompt": ""}, "empty"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": CONTEXT}, "context"),
    ({"prompt": "hi", "n": 2}, "n=2"),
    ({"prompt": "hi", "stream": True, "n": 2}, "n=2"),
    ({"prompt": "hi", "extra_body": {"foo": 1}}, "foo"),
])
def test_openai_client_completions_bad_request(client: openai.OpenAI, kwargs: dict, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", **kwargs)
    assert info.value.status_code == 400
    assert says in info.value.message


@pytest.mark.parametrize("kwargs, says", [
    ({"messages": []}, "non-empty"),
    ({"messages": msgs(), "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": msgs(), "n": 2}, "n=2"),
    ({"messages": msgs(), "temperature": -1}, "temperature"),
    ({"messages": [{"role": "robot", "content": "hi"}], "stream": True}, "role"),
])
def test_openai_client_chat_bad_request(client: openai.OpenAI, kwargs: dict, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", **kwargs)
    assert says in info.value.message


def test_unknown_route_and_method_are_json(router: RouterProcess) -> None:
    assert_client_error(requests.get(router.url + "/nope", timeout=10), status=404)
    assert_client_error(requests.get(router.url + "/generate", timeout=10), status=405)


@pytest.mark.parametrize("stream", [False, True])
def test_dead_backends_are_a_clear_503(router: RouterProcess, stream: bool) -> None:
    resp = post(router, "/generate", {"text": "hi", "stream": stream})
    error = assert_client_error(resp, status=503, says="instance in service")
    assert error["type"] == "no_instance_in_service"
    # each instance out named as every backend error names it: "ROLE HOST:PORT: ..."
    assert re.search(r"\b(prefill|decode) 127\.0\.0\.1:\d+: UNAVAILABLE", error["message"]), error["message"]


def test_dead_backend_through_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=msgs(), max_tokens=4)
    assert info.value.status_code == 503


def test_health_names_the_dead_backends(router: RouterProcess) -> None:
    resp = requests.get(router.url + "/health", timeout=30)
    assert resp.status_code == 503
    down = resp.json()["down"]
    assert len(down) == 2 and down[0].startswith("prefill ") and down[1].startswith("decode ")


def test_status_endpoints(router: RouterProcess) -> None:
    models = requests.get(router.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] and models["data"][0]["max_model_len"] == CONTEXT
    info = requests.get(router.url + "/server_info", timeout=30).json()
    assert info["policy"] == "pd" and len(info["backends"]) == 2
    assert all(b["ok"] is False and b["error"] for b in info["backends"])


def test_metrics_count_rejections(router: RouterProcess) -> None:
    post(router, "/generate", {"text": ""})
    post(router, "/generate", {"text": "hi"})  # dead backends
    resp = requests.get(router.url + "/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    samples = _samples(resp.text)
    assert samples['pdflash_requests_total{endpoint="generate",status="invalid_request_error"}'] >= 1
    assert samples['pdflash_requests_total{endpoint="generate",status="no_instance_in_service"}'] >= 1
    # a request that went nowhere is no failed transfer (test_faults.py counts a real one)
    assert not any(k.startswith("pdflash_transfer_failures_total{") and v for k, v in samples.items())
    assert any(k.startswith("pdflash_backend_up{") and v == 0 for k, v in samples.items())


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_grpc_router_rejects_bad_input_and_reports_health(router: RouterProcess) -> None:
    with grpc.insecure_channel(router.grpc_addr) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        for req, says in [
            (pb.RouterGenerateRequest(text="", sampling=pb.SamplingParams(max_new_tokens=4)), "empty"),
            (pb.RouterGenerateRequest(text="hi"), "max_new_tokens"),
            (pb.RouterGenerateRequest(input_ids=[10**9], sampling=pb.SamplingParams(max_new_tokens=4)), "vocabulary"),
            (pb.RouterGenerateRequest(input_ids=[-1], sampling=pb.SamplingParams(max_new_tokens=4)), "vocabulary"),
            (pb.RouterGenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=-1)), "max_new_tokens"),
            (pb.RouterGenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=CONTEXT)), "context"),
            (pb.RouterGenerateRequest(input_ids=LONG_IDS, sampling=pb.SamplingParams(max_new_tokens=4)), "context"),
            (pb.RouterGenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=4, temperature=-1)),
             "temperature"),
            (pb.RouterGenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=4, temperature=float("nan"))),
             "temperature"),
            (pb.RouterGenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=4, top_p=2)), "top_p"),
            (pb.RouterGenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=4, top_k=-3)), "top_k"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # valid, but the backends are dead
            list(stub.Generate(pb.RouterGenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=4)),
                               timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
