"""`pdflash up ARGS` as a child process for the length of a `with` block (for `bench ab`)."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from common.bench.report import REPO_ROOT

UP_TIMEOUT_S = 900.0  # every process loads the model; a busy machine is slow
STOP_TIMEOUT_S = 60.0


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 both free (the router serves HTTP on p, gRPC on p + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((host, port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports found")


class Stack:
    """Starts `pdflash up` with `up_args` (plus --port if not given), waits for its "is up" line,
    and on exit stops it with SIGTERM (its own process group is killed if it does not stop)."""

    def __init__(self, up_args: str, log_path: str, timeout: float = UP_TIMEOUT_S):
        self.args = shlex.split(up_args)
        if "--port" not in self.args:
            self.args += ["--port", str(free_port_pair())]
        port = int(self.args[self.args.index("--port") + 1])
        host = self.args[self.args.index("--host") + 1] if "--host" in self.args else "127.0.0.1"
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> "Stack":
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        print(f"starting: pdflash up {shlex.join(self.args)}  (log: {self.log_path})", flush=True)
        start = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "common.cli", "up", *self.args], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        up = threading.Event()
        log = open(self.log_path, "w")

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            with log:
                for line in self.proc.stdout:
                    log.write(line)
                    log.flush()
                    if "pdflash is up" in line:
                        up.set()
            up.set()

        threading.Thread(target=pump, daemon=True).start()
        if not up.wait(self.timeout) or self.proc.poll() is not None:
            self.__exit__()
            raise RuntimeError(f"pdflash up {shlex.join(self.args)} did not come up; see {self.log_path}:\n"
                               + _tail(self.log_path))
        self.startup_s = time.monotonic() - start
        print(f"up in {self.startup_s:.0f} s: {self.url}", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only its children
            self.proc.wait()


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""
