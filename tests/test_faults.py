"""Faults in a real pd stack (`pdflash up --no-local-transfer`: real processes, gRPC and Mooncake
over TCP, which P and D on one host would otherwise skip for a local copy): P killed
mid-request, a Mooncake transfer that fails because D dies under it, D dead, bootstrap and
transfer deadlines, a client that leaves, and explicit Abort on D and on P.

For each: the client gets a clear error (HTTP status + message, or a gRPC status) well within the
deadline; P and D free the room's pages (every pool back to all-free, read from each service's
own Health RPC); and the stack then serves the next request with the same output as before.

One stack for the whole module (transfer deadline 120 s: the long prompt's prefill on a busy
2-core machine takes tens of seconds). P prefills in chunks of 256 tokens: an abort takes effect
between steps, so a room aborted mid-prefill stops after its chunk instead of computing the whole
prompt.
The deadline cases use a second router (no model: seconds to start) in front of the same P and D
with a 5 s transfer deadline, which the services take from each request."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import aiohttp
import grpc
import pytest
import requests
from test_router_process import RouterProcess

from common.parallel.ports import free_port
from common.service.grpc_process import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from common.tools.bench.client import Response, post_generate
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

from freeze import freeze
from pd_stack import ROOT, Stack, running

pytestmark = pytest.mark.slow

DEADLINE_S = 120.0  # the stack's transfer deadline
PEER_ABORT_TIMEOUT_S = 2.0  # D's attempts at P's Abort (10 s by default): short, so the test waits less
SHORT_DEADLINE_S = 5.0  # the second router's
PEER_KEEPALIVE_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000  # a hung peer's calls fail within it
# Prefill takes seconds (~8 s of one core): long enough to be seen prefilling, frozen or aborted
# mid-way, and for a short room to start decoding before it ends; three tests compute it whole.
LONG = [random.Random(1).randrange(100, 49000) for _ in range(1500)]
SHORT = [504, 3458, 314, 4649, 314, 13, 198]  # "The capital of France is ..."-like ids
pool = concurrent.futures.ThreadPoolExecutor(8)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("--mode", "pd", "--no-local-transfer", "--page-size", "16", "--kv-pages", "512", "--chunk-size", "256",
                 "--deadline", str(DEADLINE_S),
                 "--request-timeout", "300", "--peer-abort-timeout", str(PEER_ABORT_TIMEOUT_S)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[int]:
    """The short prompt's greedy output before any fault: every recovery must reproduce it."""
    out = stack.generate(SHORT, max_new_tokens=12)
    assert out["meta_info"]["transfer_transport"] == "mooncake"  # --no-local-transfer, although on one host
    return out["output_ids"]


@pytest.fixture(scope="module")
def short_router(stack: Stack) -> Iterator[RouterProcess]:
    with RouterProcess("--policy", "pd", "--prefill", stack.worker("prefill").addr, "--decode",
                       stack.worker("decode").addr, "--transfer-deadline", str(SHORT_DEADLINE_S),
                       "--request-timeout", "60") as r:
        yield r


def serves_next_request(stack: Stack, reference: list[int]) -> None:
    stack.wait_healthy()
    assert stack.generate(SHORT, max_new_tokens=12)["output_ids"] == reference
    stack.wait_all_pages_free()


def post(url: str, ids: list[int], max_new_tokens: int = 4, timeout: float = 300, **extra) -> requests.Response:
    return requests.post(url + "/generate", timeout=timeout, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra})


def wait_until(what: str, cond, timeout: float, stack: Stack | None = None, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"\n{stack.tail()}" if stack else ""))
        time.sleep(every)


def health(stack: Stack, role: str) -> pb.HealthReply:
    return stack.worker(role).health(timeout=5)


def prefilling(stack: Stack) -> bool:
    """P is computing a prompt and D has reserved (and bootstrapped) pages for it."""
    p, d = health(stack, "prefill"), health(stack, "decode")
    return p.running == 1 and d.free_pages < d.total_pages


def bootstrapped(p: pb.HealthReply) -> bool:
    """P (its Health) is computing a prompt whose D has sent P its bootstrap (where to write): from
    here on, a frozen D blocks P's writes instead of P's wait for the bootstrap. One reply answers
    both: from two, the first could predate the room's arrival (no room, none awaiting) and the
    second show it prefilling with its bootstrap still to come."""
    return p.running == 1 and p.awaiting_bootstrap == 0


def transferring(p: pb.HealthReply) -> bool:
    """P (its Health) has finished the prompt and is writing its KV to D."""
    return p.running == 0 and p.writing > 0


def all_free(worker_health: pb.HealthReply) -> bool:
    return worker_health.free_pages == worker_health.total_pages and worker_health.running == 0


def assert_error(resp: requests.Response, status: int, *says: str) -> str:
    assert resp.status_code == status, resp.text
    message = resp.json()["error"]["message"]
    for s in says:
        assert s in message, message
    return message


# ---- the tests, in an order where each leaves the stack as it found it ---------------------------

def test_reference_output(stack: Stack, reference: list[int]) -> None:
    assert len(reference) == 12
    stack.wait_all_pages_free()


@pytest.mark.parametrize("ids, sampling, says", [
    ([], pb.SamplingParams(max_new_tokens=4), "empty"),
    (SHORT, pb.SamplingParams(max_new_tokens=0), "max_new_tokens"),
    (SHORT, pb.SamplingParams(max_new_tokens=-2), "max_new_tokens"),
    (SHORT, pb.SamplingParams(max_new_tokens=8190), "context"),
    ([5] * 8192, pb.SamplingParams(max_new_tokens=1), "context"),
    (SHORT, pb.SamplingParams(max_new_tokens=4, temperature=float("nan")), "temperature"),
    (SHORT, pb.SamplingParams(max_new_tokens=4, top_p=1.5), "top_p"),
], ids=["empty", "zero", "negative", "beyond-context", "long-prompt", "nan", "top_p"])
def test_services_refuse_bad_input(stack: Stack, ids: list[int], sampling: pb.SamplingParams, says: str) -> None:
    """The services check requests themselves (a gRPC client may skip the router)."""
    p, d = stack.worker("prefill"), stack.worker("decode")
    with grpc.insecure_channel(d.addr) as ch, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.DecodeServiceStub(ch).Generate(pb.GenerateRequest(
            room=uuid.uuid4().hex, input_ids=ids, sampling=sampling, prefill_addr=p.addr, deadline_s=10), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.details()
    with grpc.insecure_channel(p.addr) as ch, pytest.raises(grpc.RpcError) as info:
        pb_grpc.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(
            room=uuid.uuid4().hex, input_ids=ids, sampling=sampling, decode_addr=d.addr, deadline_s=10), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.details()
    stack.wait_all_pages_free()


def test_client_leaving_during_prefill_frees_both_sides(stack: Stack, reference: list[int]) -> None:
    body = json.dumps({"input_ids": LONG, "stream": True, "sampling_params": {"max_new_tokens": 8}}).encode()
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as client:
        client.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until("P prefilling the long prompt", lambda: prefilling(stack), 60, stack)
    # The client left before the first token. P can't stop a forward pass half way: its pages
    # return when the chunk's step ends.
    stack.wait_all_pages_free(timeout=DEADLINE_S)
    metrics = requests.get(stack.url + "/metrics", timeout=30).text
    assert 'pdflash_requests_total{endpoint="generate",status="cancelled"} 1.0' in metrics
    # P's handoffs as its Health reports them (none stuck here).
    p = stack.worker("prefill").addr
    for gauge in ("pdflash_backend_rooms_awaiting_bootstrap", "pdflash_backend_rooms_writing"):
        assert f'{gauge}{{backend="{p}",role="prefill"}} 0.0' in metrics, metrics
    serves_next_request(stack, reference)


def test_client_leaving_mid_stream_frees_both_sides(stack: Stack, reference: list[int]) -> None:
    with requests.post(stack.url + "/generate", stream=True, timeout=300, json={
            "input_ids": SHORT, "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)
        assert health(stack, "decode").running == 1
    stack.wait_all_pages_free()
    serves_next_request(stack, reference)


def test_decode_abort_mid_stream(stack: Stack, reference: list[int]) -> None:
    with requests.post(stack.url + "/generate", stream=True, timeout=300, json={
            "input_ids": SHORT, "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}) as resp:
        assert resp.status_code == 200
        events = (json.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: {"))
        room = next(events)["meta_info"]["id"]
        with grpc.insecure_channel(stack.worker("decode").addr) as ch:
            reply = pb_grpc.DecodeServiceStub(ch).Abort(pb.AbortRequest(room=room, reason="test"), timeout=10)
        assert reply.found
        start = time.monotonic()
        last = list(events)[-1]  # the stream ends by itself, with an error event
        assert time.monotonic() - start < 10
    assert "error" in last and "aborted" in last["error"]["message"], last
    stack.wait_all_pages_free()
    serves_next_request(stack, reference)


def direct_room(stack: Stack, ids: list[int], deadline_s: float = DEADLINE_S, max_new_tokens: int = 4,
                prefill_addr: str | None = None, ignore_eos: bool = False):
    """Drive one room the way the router does, over gRPC: P.Prefill and D.Generate together.
    Returns (room, P's reply future, D's chunks future); each future raises the RpcError if any."""
    room = uuid.uuid4().hex
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    p, d = stack.worker("prefill"), stack.worker("decode")
    if prefill_addr:
        p = type(p)("prefill", prefill_addr)

    def prefill() -> pb.PrefillReply:
        with grpc.insecure_channel(p.addr) as ch:
            return pb_grpc.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(
                room=room, input_ids=ids, sampling=sampling, decode_addr=d.addr, deadline_s=deadline_s), timeout=300)

    def generate() -> list[pb.GenerateChunk]:
        with grpc.insecure_channel(d.addr) as ch:
            return list(pb_grpc.DecodeServiceStub(ch).Generate(pb.GenerateRequest(
                room=room, input_ids=ids, sampling=sampling, prefill_addr=p.addr, deadline_s=deadline_s), timeout=300))

    return room, pool.submit(prefill), pool.submit(generate)


def test_prefill_abort_during_prefill(stack: Stack, reference: list[int]) -> None:
    room, prefill, generate = direct_room(stack, LONG)
    wait_until("P prefilling the long prompt", lambda: prefilling(stack), 60, stack)
    with grpc.insecure_channel(stack.worker("prefill").addr) as ch:
        assert pb_grpc.PrefillServiceStub(ch).Abort(pb.AbortRequest(room=room, reason="test"), timeout=10).found
    # P answers when the forward pass in progress ends (the abort is applied between steps).
    reply = prefill.result(timeout=DEADLINE_S)
    assert not reply.ok and "aborted" in reply.error
    with pytest.raises(grpc.RpcError) as info:
        generate.result(timeout=30)  # P told D (TransferDone ok=false): D ends the room at once
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "aborted" in info.value.details()
    stack.wait_all_pages_free()
    serves_next_request(stack, reference)


@pytest.mark.parametrize("ids, deadline_s, says", [
    (SHORT, 10.0, "prefill deadline exceeded: decode's bootstrap (where to write) never came"),
    (LONG, 2.0, f"of {len(LONG)} prompt tokens prefilled"),
], ids=["no-bootstrap", "mid-prefill"])
def test_prefill_deadline_says_what_it_waited_for(stack: Stack, ids: list[int], deadline_s: float, says: str) -> None:
    """P alone (no D ever hears of the room): the short prompt, prefilled well within its 10 s
    even on loaded cores, ends waiting for D's bootstrap; the long one (seconds of one core) ends
    mid-prefill at 2 s. P's reply says which, once the step in progress has ended (a chunk of the
    long prompt: seconds on loaded cores), not at the stack's 120 s, and its pages return."""
    start = time.monotonic()
    with grpc.insecure_channel(stack.worker("prefill").addr) as ch:
        reply = pb_grpc.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(
            room=uuid.uuid4().hex, input_ids=ids, sampling=pb.SamplingParams(max_new_tokens=4),
            decode_addr=stack.worker("decode").addr, deadline_s=deadline_s), timeout=60)
    assert not reply.ok and says in reply.error, reply.error
    assert time.monotonic() - start < deadline_s + 30
    stack.wait_all_pages_free()


def test_decode_abort_while_waiting_for_the_transfer(stack: Stack, reference: list[int]) -> None:
    room, prefill, generate = direct_room(stack, LONG)
    wait_until("P prefilling the long prompt", lambda: prefilling(stack), 60, stack)
    with grpc.insecure_channel(stack.worker("decode").addr) as ch:
        assert pb_grpc.DecodeServiceStub(ch).Abort(pb.AbortRequest(room=room, reason="test"), timeout=10).found
    with pytest.raises(grpc.RpcError) as info:
        generate.result(timeout=10)
    assert info.value.code() == grpc.StatusCode.ABORTED and "aborted" in info.value.details()
    # D asked P to abort the room too (P must not write into pages D gives back): P frees its pages.
    reply = prefill.result(timeout=DEADLINE_S)
    assert not reply.ok and "aborted: decode gave up on the room" in reply.error, reply.error
    stack.wait_all_pages_free()
    serves_next_request(stack, reference)


def test_bootstrap_timeout_with_prefill_frozen(stack: Stack, short_router: RouterProcess,
                                              reference: list[int]) -> None:
    pid = stack.pid(stack.worker("prefill"))
    freeze(pid)
    try:
        start = time.monotonic()
        resp = post(short_router.url, SHORT, timeout=60)
        took = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_error(resp, 504, "decode", "bootstrap")
    assert SHORT_DEADLINE_S - 0.5 < took < SHORT_DEADLINE_S + 5, took
    stack.wait_all_pages_free()
    serves_next_request(stack, reference)


def test_transfer_timeout(stack: Stack, short_router: RouterProcess, reference: list[int]) -> None:
    """Bootstrap completes, then P stalls mid-prefill (frozen, so the test does not depend on how
    fast this machine computes the prompt): the KV never arrives within the 5 s deadline. D gives
    up on the room but keeps its pages out of the pool while P, which could still write into them
    once it resumes, has not confirmed the abort, also after D's first attempt has timed out."""
    pid = stack.pid(stack.worker("prefill"))
    start = time.monotonic()
    call = pool.submit(post, short_router.url, LONG, timeout=60)
    wait_until("P prefilling the long prompt with D's bootstrap",
               lambda: bootstrapped(health(stack, "prefill")), 60, stack)
    freeze(pid)
    try:
        resp = call.result(timeout=60)
        took = time.monotonic() - start
        time.sleep(PEER_ABORT_TIMEOUT_S + 2)
        assert not all_free(health(stack, "decode")), "D freed the room's pages before P confirmed the abort"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_error(resp, 504, "did not finish within the deadline")
    assert took < SHORT_DEADLINE_S + 5, took
    stack.wait_all_pages_free(timeout=DEADLINE_S)  # P's pages: when its forward pass ends
    serves_next_request(stack, reference)


def test_prefill_killed_mid_request(stack: Stack, reference: list[int]) -> None:
    p = stack.worker("prefill")
    pid = stack.pid(p)
    call = pool.submit(post, stack.url, LONG)
    wait_until("P prefilling the long prompt", lambda: prefilling(stack), 60, stack)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    resp = call.result(timeout=DEADLINE_S)
    assert time.monotonic() - killed < 10
    assert_error(resp, 502, f"prefill {p.addr}")
    assert 'pdflash_transfer_failures_total{reason="backend_unavailable"}' in requests.get(stack.url + "/metrics").text
    wait_until("D's pages back", lambda: all_free(health(stack, "decode")), 30, stack)
    # pdflash up restarts P on the same port.
    wait_until("a new P process", lambda: _new_pid(stack, p, pid), 30, stack, every=0.5)
    _wait_serving(stack, p)
    serves_next_request(stack, reference)


def test_transfer_fails_when_decode_dies_under_it(stack: Stack, reference: list[int]) -> None:
    """A real Mooncake failure: D is frozen while P prefills, so P's write blocks; then D is killed.
    P's Mooncake write fails; P frees its pages and reports the failure in its reply."""
    d = stack.worker("decode")
    pid = stack.pid(d)
    streamed, streaming = stream_in_background(stack.url, SHORT)  # decoding on D when it dies
    wait_until("the streamed request's first tokens", lambda: streamed.ttft is not None, 60, stack)
    room, prefill, generate = direct_room(stack, LONG)
    wait_until("P prefilling the long prompt with D's bootstrap",
               lambda: bootstrapped(health(stack, "prefill")), 60, stack)
    freeze(pid)
    try:
        wait_until("P writing to D", lambda: transferring(health(stack, "prefill")), DEADLINE_S, stack, every=0.2)
        time.sleep(1)
        # pdflash up restarts a dead D at once: held until the checks of a dead D below are done, so
        # that a quick restart cannot serve the request meant to find D dead.
        freeze(stack.proc.pid)
        try:
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            _decode_found_dead(stack, d, prefill, generate, streamed, streaming, killed)
        finally:
            os.kill(stack.proc.pid, signal.SIGCONT)
    finally:  # also when a check failed: the tests after this one get a D that serves
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_until("a new D process", lambda: _new_pid(stack, d, pid), 30, stack, every=0.5)
        _wait_serving(stack, d)
    serves_next_request(stack, reference)


def test_stream_from_a_hung_decode_ends_without_waiting_for_the_request_timeout(stack: Stack,
                                                                               reference: list[int]) -> None:
    """D hangs mid-stream (SIGSTOP: it neither answers nor closes its connections, as behind a
    network cut). The router's keepalive pings on its channel to D go unanswered: the client's
    stream ends with an error naming D within the keepalive's window, not at the request timeout
    (300 s here). Once D resumes, the room it was decoding is gone and its pages are back."""
    d = stack.worker("decode")
    pid = stack.pid(d)
    streamed, streaming = stream_in_background(stack.url, SHORT)
    wait_until("the streamed request's first tokens", lambda: streamed.ttft is not None, 60, stack)
    freeze(pid)
    frozen = time.monotonic()
    try:
        streaming.result(timeout=120)
        took = time.monotonic() - frozen
    finally:
        os.kill(pid, signal.SIGCONT)
    assert streamed.error is not None and streamed.error.startswith("error mid-stream: ") \
        and f"decode {d.addr}" in streamed.error, streamed.error
    print(f"the stream ended {took:.1f} s after D hung: {streamed.error}")
    assert took < PEER_KEEPALIVE_S + 15, took
    stack.wait_all_pages_free()
    serves_next_request(stack, reference)


def _decode_found_dead(stack: Stack, d, prefill: concurrent.futures.Future, generate: concurrent.futures.Future,
                       streamed: Response, streaming: concurrent.futures.Future, killed: float) -> None:
    """What P, D's requests and the router say once D is dead (and not yet restarted)."""
    reply = prefill.result(timeout=DEADLINE_S)
    assert not reply.ok and "Mooncake write" in reply.error, reply.error
    print(f"P reported, {time.monotonic() - killed:.1f} s after D died: {reply.error}")
    assert time.monotonic() - killed < 45
    with pytest.raises(grpc.RpcError) as info:
        generate.result(timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # A stream D dies under ends with an SSE error event naming D (then [DONE]), which the
    # soak's client reports as such.
    streaming.result(timeout=30)
    assert streamed.error is not None and streamed.error.startswith("error mid-stream: ") \
        and f"decode {d.addr}" in streamed.error, streamed.error
    wait_until("P's pages back", lambda: all_free(health(stack, "prefill")), 30, stack)

    # A request through the router fails cleanly and names D: 502 if the router still tried D,
    # 503 once its health polling took D out of service.
    resp = post(stack.url, SHORT, timeout=60)
    assert resp.status_code in (502, 503) and d.addr in resp.text, resp.text
    wait_until("P's pages back", lambda: all_free(health(stack, "prefill")), 30, stack)


def stream_in_background(url: str, ids: list[int]) -> tuple[Response, concurrent.futures.Future]:
    """A streamed greedy request of many tokens, read by the soak's client in a thread; the
    Response fills in as events arrive."""
    r = Response(0)
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}}

    async def send() -> None:
        async with aiohttp.ClientSession() as session:
            await post_generate(session, url + "/generate", body, r)
    return r, pool.submit(asyncio.run, send())


def _new_pid(stack: Stack, worker, old: int) -> bool:
    try:
        return stack.pid(worker) != old
    except LookupError:
        return False


def _serving(worker) -> bool:
    try:
        return worker.health(timeout=2).ok
    except grpc.RpcError:
        return False


def _wait_serving(stack: Stack, worker) -> None:
    def up() -> bool:
        try:
            return worker.health(timeout=2).ok
        except grpc.RpcError:
            return False

    wait_until(f"{worker.role} serving again", up, 420, stack, every=0.5)
    # The router's channel to it retries at least every second (PEER_CHANNEL_OPTIONS), not after
    # gRPC's default backoff of up to 120 s.
    lag = stack.wait_healthy()
    print(f"{worker.role} back; the router saw it {lag:.1f} s later")
    assert lag < 5


B_TOKENS = 160
MOONCAKE_TIMEOUT_S = 5  # the second P's write deadline (Mooncake's floor): 1 s per GiB more


@pytest.fixture(scope="module")
def long_reference(stack: Stack) -> list[int]:
    """The short prompt's greedy output over B_TOKENS tokens, which the rooms decoding across a
    fault (B, C) must reproduce: computed once for the two tests that need it."""
    return stack.generate(SHORT, max_new_tokens=B_TOKENS, ignore_eos=True)["output_ids"]


@pytest.fixture(scope="module")
def second_prefill(stack: Stack, tmp_path_factory) -> Iterator[tuple[object, str]]:
    """A second P instance next to the stack's, its Mooncake writes given the shortest deadline;
    (its worker, its log file). Not known to the router: the tests drive rooms to it directly."""
    port = free_port()
    log = str(tmp_path_factory.mktemp("p2") / "prefill.log")
    with open(log, "w") as out:
        p2 = subprocess.Popen([sys.executable, "-m", "prefill_svc", "--port", str(port), "--page-size", "16",
                               "--kv-pages", "512"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env=os.environ | {"MC_TRANSFER_TIMEOUT": str(MOONCAKE_TIMEOUT_S)})
    try:
        worker = type(stack.worker("decode"))("prefill", f"127.0.0.1:{port}")
        wait_until("a second P", lambda: _serving(worker), 420, stack, every=0.5)
        yield worker, log
    finally:
        p2.terminate()
        p2.wait(30)


def test_late_write_of_an_aborted_room_lands_in_no_other_room(stack: Stack, reference: list[int],
                                                             long_reference: list[int], second_prefill) -> None:
    """D gives up on room A (Abort) while P is still computing A's long prompt; room B gets the
    pages A had on D and decodes. P's write of A's KV, when it comes, must not land in B's pages.
    B is prefilled by a second P instance so that it is decoding when P1 writes A's KV: B decodes
    B_TOKENS tokens, longer than P1 takes to finish A's prompt (a few seconds)."""
    d = stack.worker("decode")
    b_ids = SHORT
    p2_worker, _ = second_prefill
    a_ids = LONG
    room, prefill, generate = direct_room(stack, a_ids)
    wait_until("P prefilling the long prompt", lambda: prefilling(stack), 60, stack)
    with grpc.insecure_channel(d.addr) as ch:
        assert pb_grpc.DecodeServiceStub(ch).Abort(pb.AbortRequest(room=room, reason="test"), timeout=10).found
    with pytest.raises(grpc.RpcError):
        generate.result(timeout=10)
    # A's pages are back in D's pool (once P has confirmed the abort); the pool hands out the
    # pages freed last first, so B gets A's.
    wait_until("A's pages back on D", lambda: all_free(health(stack, "decode")), 30, stack)
    b_room, b_prefill, b_generate = direct_room(stack, b_ids, max_new_tokens=B_TOKENS,
                                                prefill_addr=p2_worker.addr, ignore_eos=True)
    chunks = b_generate.result(timeout=300)
    assert b_prefill.result(timeout=30).ok
    assert prefill.result(timeout=DEADLINE_S).ok is False
    got = [t for c in chunks for t in c.token_ids]
    assert got == long_reference
    stack.wait_all_pages_free()
    serves_next_request(stack, reference)


def test_write_past_its_deadline_ends_before_any_page_is_reused(stack: Stack, reference: list[int],
                                                                long_reference: list[int], second_prefill) -> None:
    """D is frozen while the second P writes room A's KV into it, past that write's Mooncake
    deadline; then D resumes. Mooncake cannot cancel an entry: P must not return from the write,
    nor free A's pages, nor tell D anything, while an entry is in flight (it asks Mooncake). Then
    A either fully landed (every entry was submitted before the deadline: the room succeeds) or
    fails with "deadline passed" (entries were still unsubmitted: P logged it), depending on
    how the plan merged A's pages into entries. Either way room B, decoding on D across the freeze,
    and room C, which gets A's pages on D right after, both produce the reference output: no byte
    of A's landed in another room's pages. Every page of D and of both P is back at the end."""
    p2, log = second_prefill
    d = stack.worker("decode")
    room, prefill, generate = direct_room(stack, LONG, prefill_addr=p2.addr)
    wait_until("P2 prefilling the long prompt with D's bootstrap",
               lambda: bootstrapped(p2.health(timeout=5)), 60, stack)
    # B over the test's own channel to D: the router's, which pings, would end B's stream once D
    # has been frozen past its keepalive (test_stream_from_a_hung_decode_...), as it should.
    _, b_prefill, b_generate = direct_room(stack, SHORT, max_new_tokens=B_TOKENS, ignore_eos=True)
    wait_until("B decoding on D", lambda: health(stack, "decode").running == 1, 60, stack)
    pid = stack.pid(d)
    freeze(pid)
    try:
        # P2 has finished the prompt and holds its pages: it is writing into the frozen D.
        wait_until("P2 writing to D", lambda: transferring(p2.health(timeout=5)), DEADLINE_S, stack, every=0.2)
        past = time.monotonic() + MOONCAKE_TIMEOUT_S + 3
        wait_until("P2's write past its deadline",
                   lambda: "deadline passed" in open(log).read() or time.monotonic() > past, 60, stack, every=0.2)
        assert transferring(p2.health(timeout=5)), "P2 gave its pages back with entries still in flight"
    finally:
        os.kill(pid, signal.SIGCONT)
    reply = prefill.result(timeout=DEADLINE_S)
    if reply.ok:  # every entry was in flight at the deadline and landed once D resumed
        assert [t for c in generate.result(timeout=60) for t in c.token_ids]
    else:
        assert "deadline passed" in reply.error, reply.error
        with pytest.raises(grpc.RpcError) as info:
            generate.result(timeout=30)
        assert "deadline passed" in info.value.details()
    print("room A " + ("landed late" if reply.ok else f"failed: {reply.error}"))
    # C starts while B still decodes: the pool hands it the pages A freed last.
    c = stack.generate(SHORT, max_new_tokens=B_TOKENS, ignore_eos=True)["output_ids"]
    assert b_prefill.result(timeout=30).ok
    assert [t for chunk in b_generate.result(timeout=300) for t in chunk.token_ids] == long_reference
    assert c == long_reference
    wait_until("P2's pages back", lambda: all_free(p2.health(timeout=5)), 30, stack)
    stack.wait_all_pages_free()
    serves_next_request(stack, reference)
