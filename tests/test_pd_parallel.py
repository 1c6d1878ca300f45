"""The PD stack with parallel instances (`pdflash up --prefill-pp/--prefill-tp/--decode-tp`,
real processes, gRPC; P and D on one host, so each rank copies into D's ranks' shared memory)
gives the same greedy tokens as the in-process runner: every
pipeline stage and TP rank of P writes its own layers' and heads' KV straight into D's TP
ranks, and the last stage sends the draft KV (--spec dflash); --verify-transfer checks every
page of the whole model on D. A split the model cannot take is refused at start-up. A D worker
rank killed under load fails every room of that D, decoding or waiting for its KV, naming the
rank, and P (which survives) gets every page back."""
from __future__ import annotations

import concurrent.futures
import random
import subprocess
import sys
import time
import uuid

import pytest
import requests

from common.tools.bench.soak_fault import process_of
from pd_stack import ROOT, Stack

pytestmark = pytest.mark.slow

PAGE = 16
MAX_NEW = 12
LAYERS, DRAFT_LAYERS = 30, 4  # the embedded SmolLM2-135M and its shipped drafter
PROMPTS = [[random.Random(n).randrange(100, 49000) for _ in range(n)] for n in (1, 17, 33, 70)]
STACK_ARGS = ["--page-size", str(PAGE), "--kv-pages", "128", "--chunk-size", "32", "--deadline", "240",
              "--request-timeout", "600", "--verify-transfer"]


@pytest.fixture(scope="module")
def expected(embedded_weights, embedded_tokenizer) -> list[list[int]]:
    from common.engine.engine import Engine
    from common.engine.request import Request
    from common.engine.sampling import SamplingParams
    from common.runner.model_runner import ModelRunner

    cfg, tensors = embedded_weights
    engine = Engine(ModelRunner(cfg, tensors, num_pages=32, page_size=PAGE), embedded_tokenizer.eos_token_ids)
    reqs = [Request(uuid.uuid4().hex, ids, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)) for ids in PROMPTS]
    engine.run_all(reqs)
    return [r.output_ids for r in reqs]


def test_parallel_stack_equals_in_process(expected: list[list[int]]) -> None:
    """P: 2 stages x TP 3 (6 processes), D: TP 3, DFlash (lossless: the plain greedy tokens)."""
    # The block pinned: measuring step costs through three ranks is not what this test is for.
    split = ["--prefill-pp", "2", "--prefill-tp", "3", "--decode-tp", "3", "--spec", "dflash", "--spec-block", "16"]
    stack = Stack("--mode", "pd", *STACK_ARGS, *split)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched, chunked prefill
            results = list(pool.map(lambda ids: stack.generate(ids, MAX_NEW, ignore_eos=True), PROMPTS))
        for ids, got, want in zip(PROMPTS, results, expected):
            assert got["output_ids"] == want
            assert got["meta_info"]["transfer_transport"] == "local"  # every rank, into every D rank
            # D checksummed every (layer, k/v, page) of the target and draft KV that P's ranks wrote.
            assert got["meta_info"]["verified_pages"] == (LAYERS + DRAFT_LAYERS) * 2 * -(-len(ids) // PAGE)
        stack.wait_all_pages_free()
        a_dead_decode_rank_fails_every_room_of_its_instance(stack)  # last: the D restarts
    finally:
        stack.stop()
    stack.assert_clean_log()


def a_dead_decode_rank_fails_every_room_of_its_instance(stack: Stack) -> None:
    """Kill D's worker rank 1 while one room decodes on D and another waits for its KV (P is
    still prefilling it): both fail at once with a 502 that names D and the rank (the waiting one
    used to end 2 s later with D's exit, as a connection reset), and P's pool is whole again."""
    p, d = stack.worker("prefill"), stack.worker("decode")
    decoding_pages = d.health().free_pages

    def post(ids: list[int], max_new_tokens: int) -> requests.Response:
        return requests.post(stack.url + "/generate", timeout=300, json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decoding = pool.submit(post, PROMPTS[1], 1000)
        _wait_until("the first room decoding on D", lambda: d.health().running == 1)
        decoding_pages -= d.health().free_pages
        waiting = pool.submit(post, [random.Random(7).randrange(100, 49000) for _ in range(600)], 4)

        def both_in_flight() -> bool:
            ph, dh = p.health(), d.health()
            return ph.running == 1 and dh.running == 1 and dh.free_pages < dh.total_pages - decoding_pages

        _wait_until("P prefilling the second room while D decodes the first and waits for the second's KV",
                    both_in_flight)
        process_of(stack.pid(d), 1).kill()
        killed = time.monotonic()
        for room in (decoding, waiting):
            resp = room.result()
            assert time.monotonic() - killed < 30, "the room failed only with the instance's exit or later"
            assert resp.status_code == 502, resp.text
            message = resp.json()["error"]["message"]
            assert message.startswith(f"decode {d.addr}: worker pdflash-rank1 exited with code -9"), message
    _wait_until("P's pool whole", lambda: (h := p.health()).free_pages == h.total_pages and h.running == 0)


def _wait_until(what: str, cond, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_tp3_prefill_into_tp1_decode_by_local_copy(expected: list[list[int]]) -> None:
    """P: TP 3 (one KV head per rank), D: TP 1 (all three) on the same host: each P rank copies
    its head of every token into D's shared memory (entries per token: the batched gather), and
    D checksums every page."""
    stack = Stack("--mode", "pd", *STACK_ARGS, "--prefill-tp", "3")
    try:
        for ids, want in list(zip(PROMPTS, expected))[1:3]:
            got = stack.generate(ids, MAX_NEW, ignore_eos=True)
            assert got["output_ids"] == want
            assert got["meta_info"]["transfer_transport"] == "local"
            assert got["meta_info"]["verified_pages"] == LAYERS * 2 * -(-len(ids) // PAGE)
        stack.wait_all_pages_free()
    finally:
        stack.stop()
    stack.assert_clean_log()


def test_unsplittable_tp_refused_at_start_up() -> None:
    """9 query heads over TP 2: P exits at once with the reason, and so does `pdflash up`."""
    out = subprocess.run([sys.executable, "-m", "common.tools.cli", "up", "--port", "1", "--prefill-tp", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "9 attention heads do not split over TP 2" in out.stderr
    assert "prefill0 exited with code 2 during start-up" in out.stderr
