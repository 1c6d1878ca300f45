"""`common.tools.bench.stack.Stack` (what `bench ab` and the tests' stacks start): a port drawn for
the router and taken by another process before the router bound it costs a start, not the run."""
from __future__ import annotations

import socket

import pytest
import requests

from common.parallel import ports
from common.tools.bench import stack as bench_stack

pytestmark = pytest.mark.slow


def test_a_port_taken_before_the_router_binds_it_starts_the_stack_again(monkeypatch, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", ports.free_port_pair()))
    taken.listen()
    drawn = [taken.getsockname()[1]]
    monkeypatch.setattr(bench_stack, "free_port_pair", lambda: drawn.pop(0) if drawn else ports.free_port_pair())
    s = bench_stack.Stack(["--mode", "colocated", "--kv-pages", "16"], log_path=str(tmp_path / "stack.log"))
    assert s.own_port  # a port given with --port is the caller's: that one is never changed
    try:
        with s:
            assert s.port != taken.getsockname()[1]
            assert requests.get(s.url + "/health", timeout=30).status_code == 200
    finally:
        taken.close()
