"""The nodes' control link (common.parallel.node_link) between two real processes over TCP: a
loaded node is not a lost one, a silent one is.

A process frozen by SIGSTOP stands for a host too loaded to schedule it: the extreme of heavy
CPU load. A listens, with a short --node-timeout, and its message handler blocks for good (a
rank too busy to take its command); B connects with a timeout longer than A is frozen, so that
it beats all along.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.parallel.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 2.0  # A's --node-timeout; B's is 3 times that (a beat every 1 s)

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


def peer(role: str, port: int, silence: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, role, str(port), str(silence)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)


def said(proc: subprocess.Popen, within_s: float) -> str:
    """The next line `proc` prints within `within_s` seconds, or ''."""
    ready, _, _ = select.select([proc.stdout], [], [], within_s)
    return proc.stdout.readline().strip() if ready else ""


def frozen(proc: subprocess.Popen, seconds: float) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(proc.pid, signal.SIGCONT)


def test_a_loaded_node_is_not_lost_a_silent_one_is():
    port = free_port()
    a = peer("listen", port, TIMEOUT_S)
    b = None
    try:
        time.sleep(0.5)  # A listens
        b = peer("connect", port, 3 * TIMEOUT_S)
        assert said(a, 60) == "up" and said(b, 60) == "up"
        # A's handler is stuck on B's command: A still hears B's beats
        assert said(a, 2 * TIMEOUT_S) == ""
        # A itself is not scheduled for twice its timeout: B's beats wait unread in A's
        # socket, so A's own stall does not count as B's silence
        frozen(a, 2 * TIMEOUT_S)
        assert said(a, 2 * TIMEOUT_S) == ""
        # negative control: B is the one that falls silent, and A says so within its timeout
        os.kill(b.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        lost = said(a, 4 * TIMEOUT_S)
        assert lost.startswith("lost: peer: no word for"), lost
        assert time.monotonic() - t0 < 3 * TIMEOUT_S
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.kill()
                proc.wait()
