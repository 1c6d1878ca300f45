"""Multi-host PD on one machine: every node of the users' PD profile (deploy/profiles/pd-8node.env,
at reduced size) and the router each in a network namespace of their own (10.200.0.0/24 on a
bridge in the router's namespace; nothing is added to the host's own network), started by
deploy/pd.sh over its `netns:` nodes, Mooncake over TCP between them. One stack serves every
check (its steps are listed on the test): a start costs most of the test's time. The users' DP2
profiles (deploy/profiles/dp2-tp32*.env) start the same way, at reduced size, in a test of their own.

Needs root and `ip netns`; skipped otherwise.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_hosts import REPO, Namespaces, namespaces, netns_available, sh

from common.model.cache import CACHE_ROOT

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
NEW_TOKENS = 12
# The room's bootstrap + transfer deadline (DEADLINE: the router hands it to P and D): a failed
# transfer must reach the client within it. It also bounds a prompt's prefill over P's two hosts
# before its KV starts to flow, with the other worker's stacks on the same two cores.
DEADLINE_S = 25
# The router's timeout of a whole request, decoding included (REQUEST_TIMEOUT): longer, so that
# what a cut fails is ended by P's and D's own deadline, and a request that has its KV is not
# failed by how slowly the loaded cores decode. At DEADLINE_S it once failed one of the requests
# after the links were back (a full-suite run): "decode ...: Stream removed (Deadline Exceeded)",
# which gRPC said, in a check of ours, only when the deadline passed after D's first chunk; D sends
# that once the KV has come (decode_svc/service.py).
# Below smoke_from_router's 60 s: a hang still ends in the router's 504.
REQUEST_TIMEOUT_S = 2 * DEADLINE_S
STARTS_OVER = "starts over in place"  # a node process re-forming its instance (common.parallel.rejoin)
# A clear failure: the router's 5xx naming the P or D that failed ("decode 10.200.0.3:32000: ...")
NAMES_A_BACKEND = re.compile(r"HTTP 5\d\d: .*\b(prefill|decode) 10\.200\.0\.\d+:\d+")


class Reference:
    """`pdflash generate`'s greedy output for PROMPT (DFlash is lossless: the plain one), computed
    in the background while the first stack starts; of the embedded model unless `model` is given."""

    def __init__(self, model: Path | None = None):
        self._proc = subprocess.Popen([sys.executable, "-m", "common.tools.cli", "generate", "--prompt", PROMPT,
                                       "--max-new-tokens", str(NEW_TOKENS), "--json", "--device", "cpu",
                                       *(["--model", str(model)] if model else [])],
                                      stdout=subprocess.PIPE, text=True, cwd=REPO)
        self._ids: list[int] | None = None

    def output_ids(self) -> list[int]:
        if self._ids is None:
            self._ids = json.loads(self._proc.communicate(timeout=300)[0])["output_ids"]
        return self._ids

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


@pytest.fixture(scope="module")
def reference():
    why = netns_available()
    if why:
        pytest.skip(why)
    ref = Reference()
    try:
        yield ref
    finally:
        ref.close()


@pytest.fixture
def cluster_namespaces():
    """P over two hosts, D over three (the embedded model's heads split over TP 3, not 2)."""
    yield from namespaces(prefill=2, decode=3)


def netns_settings(ns: Namespaces, results: Path) -> list[str]:
    """KEY=VALUE: the nodes are the namespaces, processes on CPU run the embedded model (and its
    shipped drafter) over Mooncake TCP, with deadlines short enough for a test."""
    nodes = lambda hosts: ",".join(f"netns:{h}={ns.ip[h]}" for h in hosts)
    return [
        "LAUNCHER=process", f"PYTHON={sys.executable}",
        f"PREFILL_NODES={nodes(ns.prefill)}", f"DECODE_NODES={nodes(ns.decode)}",
        f"PREFILL_NODES_PER_INSTANCE={len(ns.prefill)}", f"DECODE_NODES_PER_INSTANCE={len(ns.decode)}",
        f"ROUTER_NODE=netns:{ns.r}={ns.ip[ns.r]}", f"RESULTS_DIR={results}",
        "MODEL_NAME=", "DRAFT_MODEL_NAME=", "DTYPE=fp32", "DEVICE=cpu", "KV_PAGES=64", "CHUNK_SIZE=512",
        f"DEADLINE={DEADLINE_S}", f"REQUEST_TIMEOUT={REQUEST_TIMEOUT_S}",
        "MOONCAKE_PROTOCOL=tcp", "RDMA_DEVICES=", "MC_TRANSFER_TIMEOUT=5", "COMPOSE_OVERLAYS=",
        # Each of pd.sh's health probes starts a Python process: every 0.5 s they took most of a
        # core from the start-ups they waited for.
        "START_TIMEOUT=300", "STOP_TIMEOUT=15", "POLL_INTERVAL=2",
        f"SMOKE_PROMPT={PROMPT}", f"SMOKE_MAX_NEW_TOKENS={NEW_TOKENS}",
        "BENCH_TOOL=builtin", "BENCH_INPUT_LEN=64", "BENCH_OUTPUT_LEN=4", "BENCH_CONCURRENCY=2", "BENCH_NUM=2",
        # The namespaces share one kernel, so P and D would see one host and copy the KV locally,
        # past the links this test cuts: they are hosts that talk over the network here.
        "PREFILL_EXTRA_ARGS=--no-local-transfer", "DECODE_EXTRA_ARGS=--no-local-transfer",
    ]


def pd(command: str, profile: Path | str, *settings: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return finished(pd_started(command, profile, *settings), timeout)


def finished(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        ended(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ended(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def pd_started(command: str, profile: Path | str, *settings: str) -> subprocess.Popen:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "RUN_ID": "netns-test"}
    return subprocess.Popen([str(REPO / "deploy" / "pd.sh"), command, str(profile), *settings], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def client(ns: Namespaces, *args: str, timeout: float = 120) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    r = ns.run_in(ns.r, sys.executable, "deploy/tools/client.py", *args, timeout=timeout)
    elapsed = time.monotonic() - t0
    try:
        return r.returncode, json.loads(r.stdout), elapsed
    except json.JSONDecodeError:
        raise AssertionError(f"client printed no JSON (rc {r.returncode}): {r.stdout}\n{r.stderr}")


def smoke_from_router(ns: Namespaces, url: str, prompt: str, max_new_tokens: int) -> subprocess.Popen:
    """One request from the router's namespace, in the background; it prints its answer or error as JSON."""
    return subprocess.Popen(["ip", "netns", "exec", ns.r, sys.executable, "deploy/tools/client.py", "smoke", "--url", url,
                             "--prompt", prompt, "--max-new-tokens", str(max_new_tokens), "--timeout", "60"],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)


def wait_serving(ns: Namespaces, addr: str, within_s: float) -> None:
    """Until the gRPC health of `addr` says SERVING, asked from the router's namespace by one
    process (`pd.sh status` every second would start a Python process per service each time)."""
    code = (
        "import sys, time, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g\n"
        "stub, deadline = g.HealthStub(grpc.insecure_channel(sys.argv[1])), time.monotonic() + float(sys.argv[2])\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        "        if stub.Check(h.HealthCheckRequest(), timeout=2).status == h.HealthCheckResponse.SERVING: sys.exit(0)\n"
        "    except grpc.RpcError: pass\n"
        "    time.sleep(0.5)\n"
        "sys.exit(1)\n")
    r = ns.run_in(ns.r, sys.executable, "-c", code, addr, str(within_s), timeout=within_s + 60)
    assert r.returncode == 0, f"{addr} not serving within {within_s:.0f} s: {r.stderr[-2000:]}"


def refusal(ns: Namespaces, addr: str, within_s: float = 60) -> str:
    """What P's node 0 answers while it is not serving (common.service.gate): its Health call's
    status and message, once the port answers at all (a process starting over takes a moment)."""
    code = (
        "import sys, time, grpc; from protos import pdflash_pb2 as pb, pdflash_pb2_grpc as g\n"
        "stub, deadline = g.PrefillServiceStub(grpc.insecure_channel(sys.argv[1])), time.monotonic() + float(sys.argv[2])\n"
        "while True:\n"
        "    try:\n"
        "        stub.Health(pb.HealthRequest(), timeout=2); print('SERVING'); break\n"
        "    except grpc.RpcError as e:\n"
        "        if e.details().startswith('not in service yet') or time.monotonic() > deadline:\n"
        "            print(e.code().name, e.details()); break\n"
        "    time.sleep(0.3)\n")
    return ns.run_in(ns.r, sys.executable, "-c", code, addr, str(within_s), timeout=within_s + 60).stdout.strip()


def pools_free(ns: Namespaces, prefill: bool = True) -> list[tuple[int, int]]:
    """(free, total) KV pages of P (unless not `prefill`) and D, asked from the router's namespace."""
    targets = ([f"('{ns.ip[ns.p]}:31000', g.PrefillServiceStub)"] if prefill else []) \
        + [f"('{ns.ip[ns.d]}:32000', g.DecodeServiceStub)"]
    code = (
        "import sys; import grpc; from protos import pdflash_pb2 as pb, pdflash_pb2_grpc as g\n"
        f"for addr, stub in ({', '.join(targets)},):\n"
        "    r = stub(grpc.insecure_channel(addr)).Health(pb.HealthRequest(), timeout=5)\n"
        "    print(r.free_pages, r.total_pages)\n")
    out = ns.run_in(ns.r, sys.executable, "-c", code).stdout.split()
    return [(int(out[i]), int(out[i + 1])) for i in range(0, len(out), 2)]


# The users' PD profile at reduced size: the same structure (P over several hosts with pipeline
# stages, D over several hosts with TP, DFlash, router apart), fewer ranks, CPU, the embedded
# model. Everything else comes from deploy/profiles/pd-8node.env as it is.
PD_8NODE_REDUCED = ["PREFILL_TP=1", "PREFILL_PP=2", "PREFILL_EP=", "DECODE_TP=3", "DECODE_EP=",
                    # CPU: no GPU memory to take a fraction of (--kv-pages instead), no RDMA, no bond0
                    "PREFILL_MEM_FRACTION=", "DECODE_MEM_FRACTION=", "NCCL_SOCKET_IFNAME=", "GLOO_SOCKET_IFNAME=",
                    "NCCL_IB_HCA=", "CHUNK_SIZE=64"]


def test_pd_8node_profile_spanning_hosts_loses_a_node(reference, cluster_namespaces, tmp_path):
    """deploy/profiles/pd-8node.env at reduced size: P with PP 2 over two hosts, D with TP 3 over
    three (--nnodes), router in a sixth, DFlash:
    1. started P -> D -> router; a greedy request equals `pdflash generate` (DFlash is lossless:
       the plain reference)
    2. the P <-> D links are slowed, a long prompt's KV transfer starts, a burst of short requests
       follows, the links are cut: the long one's client gets an HTTP 5xx within the deadline, and
       each short one answers correctly or fails likewise naming its P or D; once the links are
       back the stack is healthy, every KV pool is all free and a burst of requests answers correctly
    3. the link between the two P hosts is cut while a prompt's activations cross it: the client
       gets an HTTP 5xx within the deadline, the router sees P down and refuses the next request
       at once (503: no prefill instance in service), both P nodes start over in place (same
       pid) and wait for each other, D's pages are all back
    4. P's second node dies for good (its process killed) and the link comes back: `pd.sh
       restart` of that node alone brings P back (node 0 and D untouched), and the next request
       through the router equals the reference
    5. stop: nothing is left running (no process in any of the hosts) or listening
    """
    ns = cluster_namespaces
    results = tmp_path / "results"
    profile = "pd-8node"
    settings = [*netns_settings(ns, results), *PD_8NODE_REDUCED]
    p0, p1 = ns.prefill
    try:
        started = pd("start", profile, *settings)
        assert started.returncode == 0, started.stdout + started.stderr
        out = started.stdout
        # P healthy before D starts, D healthy before the router starts
        assert out.index("wait until prefill0-rank0 is healthy") < out.index("-m decode_svc") \
            < out.index("wait until decode0-rank0 is healthy") < out.index("-m router_svc")
        assert f"ip netns exec {ns.p} bash -c" in out and f"ip netns exec {ns.d} bash -c" in out
        for rank in range(1, 3):  # every node of D runs its own share of the ranks
            assert f"decode0-rank{rank} on netns:{ns.decode[rank]}" in out
        ref = reference.output_ids()
        url = f"http://{ns.ip[ns.r]}:30000"

        # 1. P's stages and D's TP ranks on different hosts answer like the in-process engine
        rc, got, _ = client(ns, "smoke", "--url", url, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS))
        assert rc == 0 and got["output_ids"] == ref, (got, ref)

        # 2. slow what enters D's hosts so the KV transfer of a prompt takes seconds, then cut
        # every P <-> D route mid-transfer (tbf, not netem: kernels without sch_netem are common)
        into_d = [f"v{len(ns.prefill) + i}br" for i in range(len(ns.decode))]  # bridge ports towards D
        for port in into_d:
            sh("ip", "netns", "exec", ns.r, "tc", "qdisc", "add", "dev", port, "root", "tbf", "rate", "4mbit",
               "burst", "64kb", "latency", "500ms")
        # ~160 tokens: ~7 MB of fp32 KV, about 5 s over D's three 4 Mbit/s links. What the step
        # needs is a transfer that takes seconds; a short prompt keeps its prefill (three chunks
        # over P's two hosts) well inside the deadline on two loaded cores.
        long_prompt = " ".join(f"item {i}," for i in range(40))
        base = ns.tx_bytes(into_d)
        t0 = time.monotonic()
        req = smoke_from_router(ns, url, long_prompt, 4)
        while ns.tx_bytes(into_d) - base < 2_000_000:  # KV bytes are flowing into D
            assert req.poll() is None, f"the request ended before its transfer was cut: {req.communicate()[0]}"
            assert time.monotonic() - t0 < 90, "the KV transfer never started"
            time.sleep(0.05)
        burst = [smoke_from_router(ns, url, PROMPT, NEW_TOKENS) for _ in range(3)]  # in flight at the cut too
        cut = time.monotonic()
        routes = ns.cross_routes(ns.prefill, ns.decode)
        for host, peer in routes:
            sh("ip", "-n", host, "route", "add", "blackhole", f"{ns.ip[peer]}/32")
        failed = json.loads(req.communicate(timeout=90)[0])
        took = time.monotonic() - cut
        assert req.returncode == 1 and NAMES_A_BACKEND.match(failed["error"]), failed  # a clean error, not a hang
        assert took < DEADLINE_S + 3, f"the error came {took:.1f} s after the cut (deadline {DEADLINE_S} s)"
        for r in burst:  # each answered before the cut, or failed as clearly and in time
            got = json.loads(r.communicate(timeout=90)[0])
            assert got.get("output_ids") == ref or NAMES_A_BACKEND.match(got.get("error", "")), got
        # Each of the burst's deadlines runs from when the router took it up, on loaded cores seconds
        # after it was sent (28.1 s after the cut once, on three test workers); a hang runs to the
        # router's REQUEST_TIMEOUT_S.
        took = time.monotonic() - cut
        assert took < DEADLINE_S + 10, f"the burst ended {took:.1f} s after the cut (deadline {DEADLINE_S} s)"
        for host, peer in routes:
            sh("ip", "-n", host, "route", "del", "blackhole", f"{ns.ip[peer]}/32")
        for port in into_d:
            sh("ip", "netns", "exec", ns.r, "tc", "qdisc", "del", "dev", port, "root")
        # P and D stay in service (a stalled transfer holds no heartbeat up: common.parallel.node_link);
        # were a node of either lost, its instance would re-form, a start-up's time: allow for it.
        wait_serving(ns, f"{ns.ip[ns.p]}:31000", 150)
        wait_serving(ns, f"{ns.ip[ns.d]}:32000", 150)
        deadline = time.monotonic() + 60
        while (status := pd("status", profile, *settings, timeout=120)).returncode != 0:
            assert time.monotonic() < deadline, ("stack not healthy after the links came back:\n"
                                                 + status.stdout[-3000:] + status.stderr[-2000:])
            time.sleep(1)
        deadline = time.monotonic() + 45
        while (pools := pools_free(ns)) and any(free != total for free, total in pools):
            assert time.monotonic() < deadline, f"KV pages still held after the failed room: {pools}"
            time.sleep(1)
        burst = [smoke_from_router(ns, url, PROMPT, NEW_TOKENS) for _ in range(3)]
        for r in burst:
            got = json.loads(r.communicate(timeout=120)[0])
            assert r.returncode == 0 and got["output_ids"] == ref, got

        # 3. cut P0 <-> P1 (routes to nothing, both ways: packets vanish, nothing is reset) once a
        # long prompt's activations are crossing it
        long_prompt = " ".join(f"item {i}," for i in range(150))
        logs = results / "netns-test" / "logs"
        starts = lambda name: (logs / f"{name}.log").read_text().count(STARTS_OVER)
        before = {n: starts(n) for n in ("prefill0-rank0", "prefill0-rank1", "decode0-rank0")}
        base = ns.tx_bytes(["v1br"])
        t0 = time.monotonic()
        req = subprocess.Popen(["ip", "netns", "exec", ns.r, sys.executable, "deploy/tools/client.py", "smoke",
                                "--url", url, "--prompt", long_prompt, "--max-new-tokens", "4", "--timeout", "60"],
                               stdout=subprocess.PIPE, text=True, cwd=REPO)
        while ns.tx_bytes(["v1br"]) - base < 300_000:  # into P1: a chunk's activations are ~150 KB
            assert req.poll() is None, "the request ended before the link was cut"
            assert time.monotonic() - t0 < 60, "the prefill never started"
            time.sleep(0.02)
        cut = time.monotonic()
        sh("ip", "-n", p0, "route", "add", "blackhole", f"{ns.ip[p1]}/32")
        sh("ip", "-n", p1, "route", "add", "blackhole", f"{ns.ip[p0]}/32")
        failed = json.loads(req.communicate(timeout=90)[0])
        took = time.monotonic() - cut
        assert req.returncode == 1 and failed["error"].startswith("HTTP 5"), failed
        assert took < DEADLINE_S, f"the error came {took:.1f} s after the cut (deadline {DEADLINE_S} s)"
        health = ns.run_in(ns.r, "curl", "-s", f"{url}/health").stdout
        assert f"{ns.ip[p0]}:31000" in health and "unhealthy" in health, health
        rc, refused, took = client(ns, "smoke", "--url", url, "--prompt", PROMPT, "--max-new-tokens", "2")
        assert rc == 1 and refused["error"].startswith("HTTP 503") and "no prefill instance in service" in refused["error"]
        assert took < 10, f"refused after {took:.1f} s"
        pids = {n: pid_of(results, n) for n in before}
        deadline = time.monotonic() + 30
        while not all(starts(n) > before[n] for n in ("prefill0-rank0", "prefill0-rank1")):
            assert time.monotonic() < deadline, "P's nodes did not start over within 30 s of the cut"
            time.sleep(0.5)
        head_log = (logs / "prefill0-rank0.log").read_text()
        assert "no word for" in head_log and "out of service" in head_log, head_log[-3000:]
        # while it waits for P1, P0's port answers and says why it does not serve
        said = refusal(ns, f"{ns.ip[p0]}:31000")
        assert said.startswith("UNAVAILABLE not in service yet: re-forming after: node 1") \
            and "waiting for nodes 1-1 to join" in said, said
        assert "stopping this node's ranks" in (logs / "prefill0-rank1.log").read_text()
        deadline = time.monotonic() + 30
        while (pools := pools_free(ns, prefill=False)) and any(free != total for free, total in pools):
            assert time.monotonic() < deadline, f"D's KV pages still held after the failed room: {pools}"
            time.sleep(1)

        # 4. P1's container dies for good, the link comes back, and only P1 is started again
        os.kill(pids["prefill0-rank1"], signal.SIGKILL)
        sh("ip", "-n", p0, "route", "del", "blackhole", f"{ns.ip[p1]}/32")
        sh("ip", "-n", p1, "route", "del", "blackhole", f"{ns.ip[p0]}/32")
        restarted = pd("restart", profile, "prefill0-rank1", *settings)
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        wait_serving(ns, f"{ns.ip[p0]}:31000", 240)  # a start-up's time: minutes on a loaded 2-core machine
        deadline = time.monotonic() + 60
        while (status := pd("status", profile, *settings, timeout=120)).returncode != 0:
            assert time.monotonic() < deadline, ("P not back after its lost node was restarted:\n"
                                                 + status.stdout[-3000:] + (logs / "prefill0-rank0.log").read_text()[-3000:])
            time.sleep(1)
        assert pid_of(results, "prefill0-rank0") == pids["prefill0-rank0"] and pd_alive(results, "prefill0-rank0")
        assert pid_of(results, "decode0-rank0") == pids["decode0-rank0"]
        assert starts("decode0-rank0") == before["decode0-rank0"]  # D was not touched
        rc, got, _ = client(ns, "smoke", "--url", url, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS))
        assert rc == 0 and got["output_ids"] == ref, got
    finally:
        stopped = pd("stop", profile, *settings)
    assert_nothing_left(stopped, results)  # 5.
    assert_no_process_left(ns)


def assert_nothing_left(stopped: subprocess.CompletedProcess, results: Path) -> None:
    """`pd.sh stop` succeeded and left nothing listening."""
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    for f in (results / "netns-test" / "metadata").glob("after-stop-*.txt"):
        assert f.read_text().strip() == "", f"{f.name}: {f.read_text()}"
    assert not list((results / "netns-test" / "pids").glob("*.pid"))


def assert_no_process_left(ns: Namespaces) -> None:
    """Once every stack is stopped, no process of any host is left (a rank process included)."""
    deadline = time.monotonic() + 10  # the last SIGKILLed may take a moment to go
    while (left := ns.pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left in the hosts after pd.sh stop: {left}"


def pid_of(results: Path, name: str) -> int:
    return int((results / "netns-test" / "pids" / f"{name}.pid").read_text())


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """MODEL_DIR for the DP2 profiles: `tiny`, a random-weight Llama checkpoint whose 4 heads and 2
    KV heads split over TP 2 (the embedded model's 9 and 3 split only over 3 or 9), with the
    embedded model's tokenizer; `tiny-dflash`, a random drafter of it with the profile's block
    (16). Its tokenizer is read once here, so the services starting together find it in the
    cache (common.model.tokenizer), which keeps it no longer than the test."""
    why = netns_available()
    if why:
        pytest.skip(why)
    from common.model.shapes import SHAPES
    from common.model.tokenizer import Tokenizer
    from common.model.source import resolve_model
    from tiny_models import save_random_checkpoint, save_random_drafter

    root = tmp_path_factory.mktemp("models")
    cfg = save_random_checkpoint(str(root / "tiny"), Tokenizer(resolve_model(None)).folder, num_layers=4,
                                 vocab=SHAPES["embedded"].vocab_size)
    save_random_drafter(cfg, (1, 2), str(root / "tiny-dflash"), block_size=16)
    cached = Path(Tokenizer(resolve_model(str(root / "tiny"))).folder)
    try:
        yield root
    finally:
        if cached.is_relative_to(CACHE_ROOT):
            shutil.rmtree(cached, ignore_errors=True)


@pytest.fixture
def replica_namespaces():
    """dp2-tp32-dflash's four hosts (two replicas over two each), then dp2-tp32's three."""
    yield from namespaces(prefill=4, decode=3)


# The users' DP2 profiles at reduced size: DP 2 replicas with TP over several hosts behind a
# round-robin router; TP 2 over 2 hosts, CPU, a random-weight model that splits so (tiny_models).
# Nothing is cut in these stacks, so a request has a minute rather than the fault test's
# deadline, which DFlash requests in flight together can overrun on a 2-core machine under load.
DP2_TP32_REDUCED = ["REPLICA_NODES_PER_INSTANCE=2", "REPLICA_TP=2", "REPLICA_EP=", "REPLICA_MEM_FRACTION=",
                    "DECODE_MEM_FRACTION=", "NCCL_SOCKET_IFNAME=", "GLOO_SOCKET_IFNAME=", "NCCL_IB_HCA=", "CHUNK_SIZE=64",
                    "REQUEST_TIMEOUT=60", "MODEL_NAME=tiny", "DRAFT_MODEL_NAME=tiny-dflash"]


def test_dp2_tp32_profiles_spanning_hosts(tiny_models, replica_namespaces, tmp_path):
    """deploy/profiles/dp2-tp32-dflash.env and dp2-tp32.env at reduced size, both as the users run
    them, DP 2: two replicas with TP 2 over two hosts each behind one round-robin router. Started at
    the same time, both routers in an eighth host; dp2-tp32's two replicas share their first host
    (two instances' node 0 on one host, each meeting its nodes on ports of its own):
    1. per stack, two requests at once go one to each replica (the router's /server_info: each
       replica served one, with DFlash's verify steps in dp2-tp32-dflash, none in dp2-tp32) and
       equal `pdflash generate` of the same model (DFlash is lossless: the plain reference)
    2. stop: nothing is left running in any of the hosts, or listening.
    """
    ns = replica_namespaces
    url = lambda port: f"http://{ns.ip[ns.r]}:{port}"
    d0, d1, d2 = ns.decode
    stacks = {  # profile: (its hosts, two per replica; its router's port)
        "dp2-tp32-dflash": (ns.prefill, 30000),
        "dp2-tp32": ([d0, d1, d0, d2], 30010),  # the router's gRPC takes its HTTP port + 1
    }
    settings = {profile: [*netns_settings(ns, tmp_path / profile), *DP2_TP32_REDUCED, f"MODEL_DIR={tiny_models}",
                          f"ROUTER_PORT={port}", "REPLICA_NODES=" + ",".join(f"netns:{h}={ns.ip[h]}" for h in hosts)]
                for profile, (hosts, port) in stacks.items()}
    # replica i's node 0 serves it on REPLICA_PORT + i and meets its node on DIST_PORT + 2i (and + 1)
    heads = {profile: [f"{ns.ip[h]}:{33000 + i}" for i, h in enumerate(hosts[::2])]
             for profile, (hosts, _) in stacks.items()}
    starting = {}
    reference = Reference(tiny_models / "tiny")
    try:
        starting = {profile: pd_started("start", profile, *settings[profile]) for profile in stacks}
        for profile, proc in starting.items():
            started = finished(proc)
            out = started.stdout
            assert started.returncode == 0, f"{profile}:\n{out}{started.stderr}"
            hosts = stacks[profile][0]
            for i, host in enumerate(hosts):  # every host runs its share of its replica's ranks
                assert f"replica{i // 2}-rank{i % 2} on netns:{host}" in out
                assert f"--nnodes 2 --node-rank {i % 2} --dist-init-addr {ns.ip[hosts[i - i % 2]]}:{29500 + i // 2 * 2} " in out
            assert f"--policy round_robin --replicas {','.join(heads[profile])} " in out
            assert ("--spec dflash" in out) == profile.endswith("dflash")
        ref = reference.output_ids()

        # 1. at once: the second goes to the replica with none in flight (one after the other, they take turns)
        requests = {profile: [smoke_from_router(ns, url(port), PROMPT, NEW_TOKENS) for _ in heads[profile]]
                    for profile, (_, port) in stacks.items()}
        for profile, (_, port) in stacks.items():
            for r in requests[profile]:
                got = json.loads(r.communicate(timeout=180)[0])
                assert r.returncode == 0 and got["output_ids"] == ref, (profile, got, ref)
            info = json.loads(ns.run_in(ns.r, "curl", "-s", f"{url(port)}/server_info").stdout)
            served = {b["addr"]: b["served"] for b in info["backends"]}
            assert sorted(served) == sorted(heads[profile]), (profile, info["backends"])
            assert all(s and s["requests_ok"] == 1 and bool(s["spec"]) == profile.endswith("dflash")
                       for s in served.values()), (profile, served)
    finally:
        reference.close()
        for proc in starting.values():  # a start that failed the test leaves the other one going
            ended(proc)
        stopping = {profile: pd_started("stop", profile, *settings[profile]) for profile in stacks}
        stopped = {profile: finished(proc) for profile, proc in stopping.items()}
    for profile in stacks:  # 2.
        assert_nothing_left(stopped[profile], tmp_path / profile)
    assert_no_process_left(ns)


def pd_alive(results: Path, name: str) -> bool:
    try:
        os.kill(pid_of(results, name), 0)
    except (FileNotFoundError, ProcessLookupError):
        return False
    return True
