"""The nodes' control link (common.parallel.node_link) between two real processes over TCP: a
loaded node is not a lost one, a stuck one is.

A process frozen by SIGSTOP stands for a host too loaded to schedule it, the extreme of heavy CPU
load: its kernel still acknowledges what reaches it. A listens and its message handler blocks for
good (a rank too busy to take its command); B connects; both with the same --node-timeout. A
link cut between two network namespaces acknowledges nothing: lost within the timeout.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from freeze import freeze
from netns_hosts import namespaces, sh

from common.parallel.node_link import PATIENCE
from common.parallel.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1.0

PEER = """
import multiprocessing.connection as mpc, sys, threading, time
from common.parallel import node_link
role, host, port, silence = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
addr = (host, port)
if role == "listen":
    conn = mpc.Listener(addr, authkey=node_link._AUTHKEY).accept()
else:
    for _ in range(600):  # until A listens (a loaded machine starts it late)
        try:
            conn = mpc.Client(addr, authkey=node_link._AUTHKEY)
            break
        except ConnectionRefusedError:
            time.sleep(0.1)
block = lambda msg: threading.Event().wait()  # a handler that never returns
link = node_link.Link(conn, "peer", block, lambda why: print("lost:", why, flush=True), silence)
link.start()
link.send("a command")
print("up", flush=True)
threading.Event().wait()
"""


def peer(role: str, port: int, host: str = "127.0.0.1", netns: str | None = None) -> subprocess.Popen:
    inside = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.Popen([*inside, sys.executable, "-c", PEER, role, host, str(port), str(TIMEOUT_S)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)


def said(proc: subprocess.Popen, within_s: float) -> str:
    """The next line `proc` prints within `within_s` seconds, or ''."""
    ready, _, _ = select.select([proc.stdout], [], [], within_s)
    return proc.stdout.readline().strip() if ready else ""


def test_a_loaded_node_is_not_lost_a_stuck_one_is():
    port = free_port()
    a = peer("listen", port)
    b = None
    try:
        b = peer("connect", port)
        assert said(a, 60) == "up" and said(b, 60) == "up"
        # A's handler is stuck on B's command: A still hears B's beats
        assert said(a, 2 * TIMEOUT_S) == ""
        # A is not scheduled for three times the timeout: B's beats wait in A's socket, so A's own
        # stall is not B's silence; B hears nothing, but A's host acknowledges its beats
        freeze(a.pid)
        time.sleep(3 * TIMEOUT_S)
        os.kill(a.pid, signal.SIGCONT)
        assert said(a, 2 * TIMEOUT_S) == "" and said(b, 0.1) == ""
        # B stays frozen: A gives it PATIENCE times the timeout, then calls it stuck
        freeze(b.pid)
        t0 = time.monotonic()
        lost = said(a, (PATIENCE + 3) * TIMEOUT_S)
        took = time.monotonic() - t0
        assert lost.startswith("lost: peer: no word for") and "its process is stuck" in lost, lost
        assert (PATIENCE - 1) * TIMEOUT_S < took < (PATIENCE + 3) * TIMEOUT_S, took
    finally:
        ended(a, b)


def ended(*procs: subprocess.Popen | None) -> None:
    for proc in procs:
        if proc is not None:
            proc.kill()  # stopped or not
            proc.wait()


@pytest.fixture
def two_hosts():
    yield from namespaces(prefill=1, decode=1)


def test_a_cut_link_is_lost_within_the_timeout(two_hosts):
    ns = two_hosts  # A on one host, B on another
    a = peer("listen", 45000, ns.ip[ns.p], ns.p)
    b = None
    try:
        b = peer("connect", 45000, ns.ip[ns.p], ns.d)
        assert said(a, 60) == "up" and said(b, 60) == "up"
        t0 = time.monotonic()
        for host, peer_host in ((ns.p, ns.d), (ns.d, ns.p)):  # routes to nothing, both ways
            sh("ip", "-n", host, "route", "add", "blackhole", f"{ns.ip[peer_host]}/32")
        lost = said(a, 4 * TIMEOUT_S)
        assert lost.startswith("lost: peer: no word for") and "its link is cut" in lost, lost
        assert time.monotonic() - t0 < 3 * TIMEOUT_S
    finally:
        ended(a, b)
