"""The router skips an instance that is out of service and takes it back when it answers again.

A second router (no model: seconds to start) in front of the shared colocated stack's two
replicas; a replica is "out" by being frozen (SIGSTOP: its Health no longer answers), the case a
lost node or link looks like from the router. Which replica served a request is read from the
router's own per-backend figures (/server_info). The node-loss case (Health ok=false) is in
tests/test_deploy_netns.py."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import requests
from test_router_process import RouterProcess

from freeze import freeze as stop_process
from pd_stack import Stack, Worker

pytestmark = pytest.mark.slow

SHORT = [504, 3458, 314, 4649, 314, 13, 198]
OUT_WITHIN_S = 30  # poll 1 s + Health timeout 2 s, with margin for a busy 2-core machine


@pytest.fixture(scope="module")
def router(colocated_stack: Stack) -> Iterator[RouterProcess]:
    addrs = ",".join(w.addr for w in colocated_stack.workers)
    with RouterProcess("--policy", "round_robin", "--replicas", addrs, "--request-timeout", "120") as r:
        yield r


def served(router: RouterProcess) -> dict[str, int]:
    """Requests each replica served through this router (ok or failed)."""
    info = requests.get(router.url + "/server_info", timeout=30).json()
    return {b["addr"]: (b["served"] or {}).get("requests_ok", 0) + (b["served"] or {}).get("requests_failed", 0)
            for b in info["backends"]}


def generate(router: RouterProcess, timeout: float = 60) -> requests.Response:
    return requests.post(router.url + "/generate", timeout=timeout, json={
        "input_ids": SHORT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})


def wait_for_log(router: RouterProcess, line: str, times: int = 1, timeout: float = OUT_WITHIN_S) -> None:
    deadline = time.monotonic() + timeout
    while router.output.count(line) < times:
        assert time.monotonic() < deadline, f"{line!r} not in the router's log after {timeout} s:\n{router.output}"
        time.sleep(0.1)


def only_to(router: RouterProcess, worker: Worker, n: int = 4) -> None:
    """n requests all succeed, all on `worker`."""
    before = served(router)
    for _ in range(n):
        resp = generate(router)
        assert resp.status_code == 200, resp.text
    after = served(router)
    assert {a: after[a] - before[a] for a in after} == {a: n if a == worker.addr else 0 for a in after}, (before, after)


def test_out_of_service_instances_are_skipped_until_back(colocated_stack: Stack, router: RouterProcess) -> None:
    a, b = colocated_stack.workers
    pids = {w.addr: colocated_stack.pid(w) for w in (a, b)}
    before = served(router)
    for _ in range(4):
        assert generate(router).status_code == 200
    after = served(router)
    assert all(after[w.addr] - before[w.addr] == 2 for w in (a, b)), (before, after)  # round robin over both

    frozen: set[str] = set()

    def freeze(w: Worker) -> None:
        stop_process(pids[w.addr])
        frozen.add(w.addr)

    def thaw(w: Worker) -> None:
        os.kill(pids[w.addr], signal.SIGCONT)
        frozen.discard(w.addr)

    try:
        # 1. A does not answer: the router stops routing to it; B serves every request
        freeze(a)
        wait_for_log(router, f"replica {a.addr} is out of service")
        only_to(router, b)

        # 2. A is back, B is out: every request goes to A (so A was taken back)
        thaw(a)
        freeze(b)
        wait_for_log(router, f"replica {a.addr} is back in service")
        wait_for_log(router, f"replica {b.addr} is out of service")
        only_to(router, a)

        # 3. none in service: a clear 503 within the Health timeout, not a request stuck on a frozen replica
        freeze(a)
        wait_for_log(router, f"replica {a.addr} is out of service", times=2)
        start = time.monotonic()
        resp = generate(router)
        assert resp.status_code == 503, resp.text
        message = resp.json()["error"]["message"]
        assert "no replica instance in service" in message and f"replica {a.addr}" in message \
            and f"replica {b.addr}" in message, message
        assert time.monotonic() - start < 15

        # 4. both back: the next request is served (the router asks again before refusing it)
        thaw(a)
        thaw(b)
        assert generate(router).status_code == 200
    finally:
        for addr in list(frozen):
            os.kill(pids[addr], signal.SIGCONT)
