"""Greedy output through the real stack (`pdflash up`, real gRPC; P and D on one host, so the KV
is copied into D's shared memory, not sent over Mooncake: test_faults.py keeps that) equals the
in-process runner (`common.engine.engine.Engine` over the same weights) token for token: one request at a
time and 16 at once; pd (with --spec dflash, which is lossless, and `--verify-transfer`: every
page D received is checksummed against what P sent) and colocated with two replicas (the
session's shared stacks, conftest.py). Page size 16, so prompts of 15/16/17, 31/32/33, 63/64/65
tokens start, fill and overflow pages, and decoding crosses page boundaries. The pd stack prefills
in chunks of 40 tokens and sends each chunk's whole pages while the next computes: prompts of 65
tokens and more arrive in several writes, each page once (D's byte count and checksums say so)."""
from __future__ import annotations

import concurrent.futures
import random
import re
import uuid
from dataclasses import dataclass

import openai
import pytest
import requests
from conftest import once_per_run

from pd_stack import Stack

pytestmark = pytest.mark.slow

PAGE = 16
LAYERS = 30  # the embedded SmolLM2-135M
DRAFT_LAYERS = 4  # its shipped drafter
MAX_NEW = 16


@dataclass(frozen=True)
class Case:
    kind: str  # "ids": /generate input_ids; "text": /generate text; "chat": OpenAI chat completions
    prompt: tuple[int, ...] | str
    max_new_tokens: int = MAX_NEW
    ignore_eos: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind}{len(self.prompt)}"


def _random_ids(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 49000) for _ in range(n))


BOUNDARY = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97]  # tokens, around page size 16 (and 64)
CASES = (
    [Case("ids", _random_ids(n, seed=n), ignore_eos=True) for n in BOUNDARY]
    + [Case("ids", _random_ids(200, seed=7), max_new_tokens=9), Case("ids", _random_ids(47, seed=3), max_new_tokens=1)]
    + [Case("text", t) for t in ("The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4,",
                                 "Once upon a time, in a small village by the sea, there lived")]
    + [Case("chat", m) for m in ("What is 2+3?", "Name three colours.", "Write a haiku about rain.")]
)


@dataclass(frozen=True)
class Expected:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str


@pytest.fixture(scope="module")
def expected(embedded_weights, embedded_tokenizer, tmp_path_factory) -> dict[Case, Expected]:
    """Every case through an in-process Engine: the reference, once per run (the two stacks'
    tests may run on different workers). All at once: decoding in a batch gives each request what
    it gives alone (the sixteen-at-once test below holds the stacks to that as well), and one
    batch is several times faster on a CPU."""
    return once_per_run(tmp_path_factory, "pd-equivalence-expected",
                        lambda: in_process(embedded_weights, embedded_tokenizer))


def in_process(embedded_weights, embedded_tokenizer) -> dict[Case, Expected]:
    from common.engine.engine import Engine
    from common.engine.request import Request
    from common.engine.sampling import SamplingParams
    from common.model.tokenizer import IncrementalDecoder
    from common.runner.model_runner import ModelRunner

    cfg, tensors = embedded_weights
    assert cfg.num_layers == LAYERS
    tok = embedded_tokenizer
    engine = Engine(ModelRunner(cfg, tensors, num_pages=160, page_size=PAGE), tok.eos_token_ids)
    reqs, texts = {}, {}
    for case in CASES:
        if case.kind == "ids":
            ids = list(case.prompt)
        elif case.kind == "text":
            ids = tok.encode(case.prompt)
        else:
            ids = tok.apply_chat_template([{"role": "user", "content": case.prompt}])
        params = SamplingParams(max_new_tokens=case.max_new_tokens, ignore_eos=case.ignore_eos)
        reqs[case] = Request(uuid.uuid4().hex, ids, params, IncrementalDecoder(tok))
        texts[reqs[case].rid] = ""
    for outputs in engine.run(reqs.values()):
        for o in outputs:
            texts[o.req.rid] += o.text
    assert engine.runner.pool.num_free == engine.runner.pool.num_pages
    return {case: Expected(r.prompt_ids, r.output_ids, texts[r.rid]) for case, r in reqs.items()}


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The session's shared stacks (conftest.py): pd (with --spec dflash) and two colocated replicas."""
    return shared_stack


def run_case(stack: Stack, case: Case) -> dict:
    """{"output_ids" (None for chat), "text", "prompt_tokens", "meta" (None for chat)}."""
    if case.kind == "chat":
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=600)
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": case.prompt}],
                                             max_tokens=case.max_new_tokens, temperature=0)
        return {"output_ids": None, "text": out.choices[0].message.content,
                "prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens,
                "meta": None}
    body = {"input_ids": list(case.prompt)} if case.kind == "ids" else {"text": case.prompt}
    body["sampling_params"] = {"max_new_tokens": case.max_new_tokens, "temperature": 0, "ignore_eos": case.ignore_eos}
    resp = requests.post(stack.url + "/generate", json=body, timeout=600)
    assert resp.status_code == 200, f"{case.name}: {resp.text}"
    r = resp.json()
    return {"output_ids": r["output_ids"], "text": r["text"], "prompt_tokens": r["meta_info"]["prompt_tokens"],
            "completion_tokens": r["meta_info"]["completion_tokens"], "meta": r["meta_info"]}


def check(stack: Stack, case: Case, got: dict, want: Expected) -> None:
    assert got["prompt_tokens"] == len(want.prompt_ids), case.name
    assert got["completion_tokens"] == len(want.output_ids), case.name
    if got["output_ids"] is not None:
        assert got["output_ids"] == want.output_ids, case.name
    assert got["text"] == want.text, case.name
    if stack.policy == "pd" and got["meta"] is not None:
        # P and D on one host: the KV (and draft KV) was copied into D's shared memory, not over Mooncake.
        assert got["meta"]["transfer_transport"] == "local", case.name
        # --verify-transfer: D checksummed every (layer, k/v, page) of the prompt that P wrote,
        # the target's layers and the drafter's.
        pages = -(-len(want.prompt_ids) // PAGE)
        assert got["meta"]["verified_pages"] == (LAYERS + DRAFT_LAYERS) * 2 * pages, case.name
        page_bytes = PAGE * 3 * 64  # tokens x kv heads x head dim (the drafter's: the same), x fp32 or bf16 bytes
        layer_bytes = LAYERS * 4 + DRAFT_LAYERS * 2  # the stack's drafter runs in bf16 (--draft-dtype)
        assert got["meta"]["transfer_bytes"] == layer_bytes * 2 * pages * page_bytes, case.name


def test_one_at_a_time_equals_in_process(stack: Stack, expected: dict[Case, Expected]) -> None:
    for case in CASES:
        check(stack, case, run_case(stack, case), expected[case])
    stack.wait_all_pages_free()


def test_sixteen_at_once_equal_in_process(stack: Stack, expected: dict[Case, Expected]) -> None:
    batch = [c for c in CASES if c.kind != "ids" or len(c.prompt) not in (1, 32, 33, 97)]
    assert len(batch) == 16 and {c.kind for c in batch} == {"ids", "text", "chat"}
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(lambda c: run_case(stack, c), batch))
    for case, got in zip(batch, results):
        check(stack, case, got, expected[case])
    stack.wait_all_pages_free()


def test_pages_go_to_decode_before_the_last_chunk_ends(pd_stack: Stack, expected: dict[Case, Expected]) -> None:
    """The 200-token prompt is five chunks: P's transfer log says it wrote pages before the last
    chunk ended (D bootstraps within the first chunks), and the output is the in-process one."""
    case = next(c for c in CASES if c.kind == "ids" and len(c.prompt) == 200)
    got = run_case(pd_stack, case)
    check(pd_stack, case, got, expected[case])
    line = next(ln for ln in pd_stack.lines if f"room {got['meta']['id']}: " in ln and "bytes to decode" in ln)
    writes, early = map(int, re.search(r"in (\d+) writes \((\d+) before the last chunk ended\)", line).groups())
    assert 1 <= early <= 4 and writes == early + 1, line
