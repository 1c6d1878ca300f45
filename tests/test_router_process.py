"""The router as a real process: `RouterProcess` (used by the other test_router_* files) and the
tests of its command line and lifecycle."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from common.parallel.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_TIMEOUT_S = 300  # no model to load, but imports alone took over 120 s on a loaded 2-core machine


class RouterProcess:
    """`python -m router_svc` on free ports; waits for its ready line. Output is kept for asserts."""

    def __init__(self, *args: str):
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_addr = f"127.0.0.1:{self.grpc_port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router_svc", "--host", "127.0.0.1", "--port", str(self.port),
             "--grpc-port", str(self.grpc_port), *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(READY_TIMEOUT_S) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("router did not start:\n" + self.output)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "router ready" in line:
                self._ready.set()
        self._ready.set()  # exited: don't wait for a ready line that will never come

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def dead_backend_args() -> list[str]:
    """pd flags pointing at ports where nothing listens: enough for anything checked before dispatch."""
    return ["--policy", "pd", "--prefill", f"127.0.0.1:{free_port()}", "--decode", f"127.0.0.1:{free_port()}"]


@pytest.mark.parametrize("args, complaint", [
    (["--policy", "pd", "--decode", "127.0.0.1:1"], "--policy pd needs"),
    (["--policy", "round_robin", "--prefill", "127.0.0.1:1", "--replicas", "127.0.0.1:2"], "round_robin needs"),
    (["--policy", "pd", "--prefill", "nohost", "--decode", "127.0.0.1:1"], "is not host:port"),
    (["--policy", "magic"], "invalid choice"),
    (dead_backend_args() + ["--request-timeout", "0"], "must be positive"),
    (dead_backend_args() + ["--transfer-deadline", "-1"], "must be positive"),
    (dead_backend_args() + ["--model", "/nonexistent/model"], "unknown model path"),
])
def test_bad_command_line_exits_with_one_line(args: list[str], complaint: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "router_svc", "--port", str(free_port()), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert complaint in proc.stderr
    assert "Traceback" not in proc.stderr


def test_port_in_use_exits_with_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "router_svc", "--host", "127.0.0.1", "--port", str(port),
                               *dead_backend_args()], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "router: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_starts_quickly_and_stops_cleanly_on_sigterm() -> None:
    start = time.monotonic()
    with RouterProcess(*dead_backend_args()) as router:
        startup = time.monotonic() - start
        assert f"http://127.0.0.1:{router.port}" in router.output
        assert router.stop() == 0
    assert startup < 30, f"startup took {startup:.1f} s"
    assert "Traceback" not in router.output
