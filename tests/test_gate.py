"""Node 0 of an instance over several nodes answers while it waits for them (common.service.gate):
its standard health NOT_SERVING, and every call of its service, streaming ones too,
UNAVAILABLE saying what it waits for, from the moment its process starts. Here decode's node 0
of a TP 3 instance over three nodes, the other two never started."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.parallel.ports import free_ports
from protos import pdflash_pb2 as pb
from protos import pdflash_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
WAITING = "not in service yet: starting: loading the model, waiting for nodes 1-2 to join"


@pytest.fixture
def lone_head():
    port, dist = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "decode_svc", "--port", str(port), "--device", "cpu", "--kv-pages", "8",
                             "--tp", "3", "--nnodes", "3", "--node-rank", "0", "--dist-init-addr", f"127.0.0.1:{dist}"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
