"""The router in front of the real services (`pdflash up`, embedded model, CPU): every API gives
the same greedy output, concurrent requests keep their own rooms, and a client that leaves
mid-stream gets its room aborted (D's pages all free again)."""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import time
from typing import Any

import grpc
import openai
import pytest
import requests

from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

from pd_stack import Stack

pytestmark = pytest.mark.slow
if not all(importlib.util.find_spec(f"{svc}.__main__") for svc in ("prefill_svc", "decode_svc")):
    pytest.skip("prefill_svc / decode_svc have no __main__ yet", allow_module_level=True)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Water boils at",
           "Once upon a time", "The largest planet is", "Roses are red,", "import numpy as"]


def backends(stack: Stack) -> list[dict]:
    return requests.get(stack.url + "/server_info", timeout=30).json()["backends"]


def wait_all_pages_free(stack: Stack, timeout: float = 10) -> None:
    """As the router reports it (its /server_info), which is part of what this file tests."""
    deadline = time.monotonic() + timeout
    while True:
        healths = [b["health"] for b in backends(stack)]
        if all(h["freePages"] == h["totalPages"] and not h.get("running") for h in healths):
            return
        assert time.monotonic() < deadline, f"pages not freed: {healths}"
        time.sleep(0.2)


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The session's shared stacks (conftest.py): pd (with --spec dflash) and two colocated replicas."""
    return shared_stack


def generate(stack: Stack, text: str, max_new_tokens: int = 16) -> dict:
    resp = requests.post(stack.url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_every_api_gives_the_same_greedy_output(stack: Stack) -> None:
    ref = generate(stack, PROMPTS[0])
    assert ref["meta_info"]["completion_tokens"] == len(ref["output_ids"]) > 0
    with grpc.insecure_channel(f"127.0.0.1:{stack.port + 1}") as channel:
        chunks = list(pb_grpc.RouterServiceStub(channel).Generate(pb.RouterGenerateRequest(
            text=PROMPTS[0], sampling=pb.SamplingParams(max_new_tokens=16)), timeout=120))
    assert [t for c in chunks for t in c.token_ids] == ref["output_ids"]
    assert "".join(c.text for c in chunks) == ref["text"]
    assert chunks[-1].meta.prompt_tokens == ref["meta_info"]["prompt_tokens"]

    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert out.choices[0].text == ref["text"]
    streamed = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ref["text"]

    events = requests.post(stack.url + "/generate", stream=True, timeout=120, json={
        "text": PROMPTS[0], "stream": True, "sampling_params": {"max_new_tokens": 16}}).iter_lines()
    last = [json.loads(line[6:]) for line in events if line and line != b"data: [DONE]"][-1]
    assert last["text"] == ref["text"] and last["output_ids"] == ref["output_ids"]


def test_chat_through_the_openai_client(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == out.choices[0].message.content
    assert out.choices[0].message.content and out.usage.prompt_tokens > len(messages[0]["content"]) // 4


def test_concurrent_requests_keep_their_own_rooms(stack: Stack) -> None:
    alone = {p: generate(stack, p)["output_ids"] for p in PROMPTS[:4]}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: generate(stack, p)["output_ids"], PROMPTS[:4] * 2))
    assert together == [alone[p] for p in PROMPTS[:4] * 2]
    wait_all_pages_free(stack)


def test_client_leaving_mid_stream_frees_the_room(stack: Stack) -> None:
    body: dict[str, Any] = {"text": PROMPTS[4], "stream": True,
                            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with requests.post(stack.url + "/generate", json=body, stream=True, timeout=120) as resp:
        lines = resp.iter_lines()
        next(lines)  # generation is under way
    wait_all_pages_free(stack)
    assert generate(stack, PROMPTS[0])["output_ids"]  # and the stack serves the next request
    metrics = requests.get(stack.url + "/metrics", timeout=30).text
    assert 'status="cancelled"' in metrics and "pdflash_time_to_first_token_seconds_count" in metrics
