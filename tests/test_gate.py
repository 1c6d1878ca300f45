"""Node 0 of an instance over several nodes answers while it waits for them (common.service.gate):
its standard health NOT_SERVING, and every call of its service, streaming ones too,
UNAVAILABLE saying what it waits for, from the moment its process starts. Here decode's node 0
of a TP 3 instance over three nodes, the other two never started. And what it does when another
instance's node 0 on its host already holds its rendezvous ports: it refuses at once."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.parallel.cluster import make_nodes
from common.parallel.ports import free_port_pair, free_ports
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
WAITING = "not in service yet: starting: loading the model, waiting for nodes 1-2 to join"


def node_0(port: int, dist: int) -> list[str]:
    return [sys.executable, "-m", "decode_svc", "--port", str(port), "--device", "cpu", "--kv-pages", "8",
            "--tp", "3", "--nnodes", "3", "--node-rank", "0", "--dist-init-addr", f"127.0.0.1:{dist}"]


@pytest.fixture
def lone_head():
    port, dist = free_ports(1)[0], free_port_pair()
    proc = subprocess.Popen(node_0(port, dist), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_node_0_answers_while_its_nodes_join(lone_head):
    proc, addr = lone_head
    with grpc.insecure_channel(addr) as ch:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e
                time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = pb_grpc.DecodeServiceStub(ch)
        calls = [lambda: stub.Health(pb.HealthRequest(), timeout=5),
                 lambda: next(stub.Generate(pb.GenerateRequest(room="r", input_ids=[1, 2]), timeout=5))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and refused.value.details() == WAITING
    assert proc.poll() is None  # still waiting for its nodes


@pytest.mark.parametrize("taken", [0, 1], ids=["rendezvous", "control-link"])
def test_node_0_refuses_rendezvous_ports_taken(taken):
    """PORT (the process group's store) or PORT + 1 (the nodes' control link) of --dist-init-addr
    already listened on, as by another instance's node 0 on the same host: node 0 exits at start
    with a usage error naming the port and the flag to change, before it loads the model, rather
    than let its nodes join the other instance (or wait for them until --dist-timeout)."""
    dist = free_port_pair()
    with socket.socket() as other:
        other.bind(("127.0.0.1", dist + taken))
        other.listen()
        r = subprocess.run(node_0(free_ports(1)[0], dist) + ["--dist-timeout", "30"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "usage: python -m decode_svc" in r.stderr, r.stderr[-3000:]  # refused by the check at start
    assert f"127.0.0.1:{dist + taken}, its " in r.stderr and "is taken: another instance's node 0" in r.stderr \
        and "another --dist-init-addr port" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_rendezvous_port_checks_are_plain_errors():
    """PORT + 1 must be a port too; an address that is not node 0's own says so (no traceback
    from the socket)."""
    with pytest.raises(ValueError, match=r"PORT must be in \[1, 65534\]"):
        make_nodes(2, 0, "127.0.0.1:65535", None)
    with pytest.raises(ValueError, match="must name an address of node 0's own host"):
        make_nodes(2, 0, f"192.0.2.1:{free_port_pair()}", "127.0.0.1")  # TEST-NET-1: no host has it
