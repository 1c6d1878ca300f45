"""`pdflash up` as a real process for the PD tests (test_pd_*.py, test_faults.py): start it on a
free port, find its workers (router `GET /server_info`) and their process ids, and read their
page pools through each service's own gRPC `Health`."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import psutil
import requests

from common.service.tls import Tls, blocking_channel
from common.tools.bench.stack import Stack as UpStack
from router_svc.dispatch import ROUTE_HEADER
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UP_TIMEOUT_S = 420  # each service loads the model; the machine may be busy with other tests


@dataclass(frozen=True)
class Worker:
    role: str  # "prefill", "decode" or "replica"
    addr: str  # gRPC host:port
    tls: Tls | None = None  # the stack's --tls-* files: our certificate, to get through mutual TLS

    @property
    def port(self) -> int:
        return int(self.addr.rsplit(":", 1)[1])

    def stub(self, channel: grpc.Channel):
        return pb_grpc.PrefillServiceStub(channel) if self.role == "prefill" else pb_grpc.DecodeServiceStub(channel)

    def health(self, timeout: float = 10) -> pb.HealthReply:
        with blocking_channel(self.addr, self.tls) as channel:
            return self.stub(channel).Health(pb.HealthRequest(), timeout=timeout)


class Stack(UpStack):
    """`pdflash up ARGS`, started at once on free ports; its output is kept for messages."""

    def __init__(self, *args: str, timeout: float = UP_TIMEOUT_S):
        super().__init__(args, timeout=timeout)
        # With --api-key every route but /health needs it; with --tls-* every worker wants a certificate.
        self.headers = {"Authorization": f"Bearer {self.flag('--api-key')}"} if "--api-key" in args else {}
        tls = Tls(*(open(self.flag(f), "rb").read() for f in ("--tls-cert", "--tls-key", "--tls-ca"))) \
            if "--tls-ca" in args else None
        self.start()
        info = requests.get(self.url + "/server_info", headers=self.headers, timeout=30).json()
        self.policy = info["policy"]  # "pd" or "round_robin"
        self.workers = [Worker(b["role"], b["addr"], tls) for b in info["backends"]]

    def flag(self, name: str) -> str:
        return self.args[self.args.index(name) + 1]

    def assert_clean_log(self) -> None:
        """No service logged a traceback or an unretrieved asyncio exception."""
        out = "".join(self.lines)
        for bad in ("Traceback", "never retrieved", "was destroyed but it is pending"):
            assert bad not in out, f"{bad!r} in the stack's output:\n" + out[max(0, out.index(bad) - 3000):][:6000]

    # ---- workers -------------------------------------------------------------------------------
    def worker(self, role: str) -> Worker:
        return next(w for w in self.workers if w.role == role)

    def pid(self, worker: Worker) -> int:
        """The process serving `worker` now (the launcher restarts a dead one on the same port)."""
        for child in psutil.Process(self.proc.pid).children():
            try:
                cmd = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "--port" in cmd and cmd[cmd.index("--port") + 1] == str(worker.port) and child.is_running() \
                    and child.status() != psutil.STATUS_ZOMBIE:
                return child.pid
        raise LookupError(f"no process for {worker.role} {worker.addr}:\n{self.tail()}")

    def pools(self) -> dict[str, tuple[int, int, int]]:
        """addr -> (free pages, total pages, running) from each worker's own Health RPC."""
        out = {}
        for w in self.workers:
            h = w.health()
            out[w.addr] = (h.free_pages, h.total_pages, h.running)
        return out

    def wait_all_pages_free(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                pools = self.pools()
                if all(free == total and not running for free, total, running in pools.values()):
                    return
            except grpc.RpcError as e:
                pools = f"Health failed: {e.code().name} {e.details()}"
            if time.monotonic() > deadline:
                raise AssertionError(f"pages not all free after {timeout} s: {pools}\n{self.tail()}")
            time.sleep(0.2)

    def wait_healthy(self, timeout: float = UP_TIMEOUT_S) -> float:
        """Until the router sees every backend up (its /health is 200); returns the seconds waited."""
        start = time.monotonic()
        while True:
            try:
                if requests.get(self.url + "/health", timeout=10).status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() - start > timeout:
                raise AssertionError(f"stack not healthy after {time.monotonic() - start:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def served(self) -> dict[str, int]:
        """Requests each instance has served, by address (the router's own count)."""
        info = requests.get(self.url + "/server_info", headers=self.headers, timeout=30).json()
        return {b["addr"]: b["served"]["requests_ok"] if b["served"] else 0 for b in info["backends"]}

    # ---- requests ------------------------------------------------------------------------------
    def generate(self, input_ids: list[int], max_new_tokens: int = 8, timeout: float = 300,
                 headers: dict[str, str] | None = None, **params) -> dict:
        resp = requests.post(self.url + "/generate", headers=self.headers | (headers or {}), timeout=timeout, json={
            "input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **params}})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def generate_on(self, pair: tuple[int, int], input_ids: list[int], max_new_tokens: int, **params) -> dict:
        """`input_ids` generated by P instance pair[0] and D instance pair[1] (0-based, in the
        order of --prefill-*/--decode-* sizes), pinned by the route header (--allow-route-header)."""
        return self.generate(input_ids, max_new_tokens, headers={ROUTE_HEADER: "p={},d={}".format(*pair)}, **params)


def serve_alone(n: int, serve: Callable[[tuple[int, int]], dict]) -> list[dict]:
    """serve(pair) for each of the n x n (P, D) pairs, n at a time, no two at once sharing a P or
    a D instance: each request is alone on both its instances (D decodes it at batch 1). The
    results in (P, D) order."""
    out: dict[tuple[int, int], dict] = {}
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for shift in range(n):
            pairs = [(p, (p + shift) % n) for p in range(n)]
            out |= dict(zip(pairs, pool.map(serve, pairs)))
    return [out[pair] for pair in sorted(out)]


def pair_prompt(pair: tuple[int, int], prompts: int = 3) -> int:
    """Which of `prompts` prompts a (P, D) pair of an n x n pair test serves alone: at each
    round of serve_alone the n pairs serve different ones, and each P and each D serves them all."""
    return sum(pair) % prompts


@contextlib.contextmanager
def running(*args: str) -> Iterator[Stack]:
    """`pdflash up ARGS` for the block; at its end no service may have logged a traceback."""
    s = Stack(*args)
    try:
        yield s
    finally:
        s.stop()
    s.assert_clean_log()
