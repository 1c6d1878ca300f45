"""The nodes' control link (common.parallel.node_link) between two real processes over TCP: a
loaded node is not a lost one, a stuck one is.

A process frozen by SIGSTOP stands for a host too loaded to schedule it, the extreme of heavy CPU
load: its kernel still acknowledges what reaches it. A listens and its message handler blocks for
good (a rank too busy to take its command); B connects; both with the same --node-timeout.
(A cut link, which acknowledges nothing, is lost within the timeout: tests/test_deploy_netns.py.)
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.parallel.node_link import PATIENCE
from common.parallel.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1.0

PEER = """
import multiprocessing.connection as mpc, sys, threading
from common.parallel import node_link
role, port, silence = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
addr = ("127.0.0.1", port)
if role == "listen":
    conn = mpc.Listener(addr, authkey=node_link._AUTHKEY).accept()
else:
    conn = mpc.Client(addr, authkey=node_link._AUTHKEY)
block = lambda msg: threading.Event().wait()  # a handler that never returns
link = node_link.Link(conn, "peer", block, lambda why: print("lost:", why, flush=True), silence)
link.start()
link.send("a command")
print("up", flush=True)
threading.Event().wait()
"""


def peer(role: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, role, str(port), str(TIMEOUT_S)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)


def said(proc: subprocess.Popen, within_s: float) -> str:
    """The next line `proc` prints within `within_s` seconds, or ''."""
    ready, _, _ = select.select([proc.stdout], [], [], within_s)
    return proc.stdout.readline().strip() if ready else ""


def test_a_loaded_node_is_not_lost_a_stuck_one_is():
    port = free_port()
    a = peer("listen", port)
    b = None
    try:
        time.sleep(0.5)  # A listens
        b = peer("connect", port)
        assert said(a, 60) == "up" and said(b, 60) == "up"
        # A's handler is stuck on B's command: A still hears B's beats
        assert said(a, 2 * TIMEOUT_S) == ""
        # A is not scheduled for three times the timeout: B's beats wait in A's socket, so A's own
        # stall is not B's silence; B hears nothing, but A's host acknowledges its beats
        os.kill(a.pid, signal.SIGSTOP)
        time.sleep(3 * TIMEOUT_S)
        os.kill(a.pid, signal.SIGCONT)
        assert said(a, 2 * TIMEOUT_S) == "" and said(b, 0.1) == ""
        # B stays frozen: A gives it PATIENCE times the timeout, then calls it stuck
        os.kill(b.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        lost = said(a, (PATIENCE + 3) * TIMEOUT_S)
        took = time.monotonic() - t0
        assert lost.startswith("lost: peer: no word for") and "its process is stuck" in lost, lost
        assert (PATIENCE - 1) * TIMEOUT_S < took < (PATIENCE + 3) * TIMEOUT_S, took
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.kill()  # stopped or not
                proc.wait()
