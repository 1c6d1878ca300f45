"""Freezing a process for fault tests: SIGSTOP, then wait until every thread has stopped.

The kernel stops a process's threads one by one: the thread chosen to take SIGSTOP must be
scheduled before it stops the others, and on a loaded host another thread (a Mooncake or gRPC
I/O thread woken by incoming bytes) can still run meanwhile and answer its peer. A test that
acts on the frozen process as soon as `kill` returns then sees it answer now and then."""
from __future__ import annotations

import os
import signal
import time


def _all_threads_stopped(pid: int) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]  # the name, in parentheses, may hold spaces
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if state != "T":
            return False
    return True


def freeze(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP `pid` and return once all its threads are stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} sent SIGSTOP still has running threads after {timeout_s} s")
        time.sleep(0.001)

