"""`pdflash up ARGS` as a child process for the length of a `with` block (for `bench ab`)."""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from common.parallel.ports import free_port_pair
from common.tools.bench.report import REPO_ROOT

UP_TIMEOUT_S = 900.0  # every process loads the model; a busy machine is slow
STOP_TIMEOUT_S = 60.0
PORT_ATTEMPTS = 3
# A port taken by another process: the router's bind error (Python's words) and a worker's (ours).
PORT_TAKEN = ("address already in use", "cannot listen on")


class Stack:
    """`pdflash up ARGS` as a child process (--port added if not given): `start()` (or `with`)
    waits for its "is up" line, `stop()` sends SIGTERM (its own process group is killed if it
    does not stop). Its output is kept in `lines` and, given `log_path`, also written there."""

    def __init__(self, up_args: str | Sequence[str], log_path: str | None = None, timeout: float = UP_TIMEOUT_S):
        self.args = shlex.split(up_args) if isinstance(up_args, str) else list(up_args)
        self.own_port = "--port" not in self.args  # ours to change if it is gone by the time the router binds it
        if self.own_port:
            self.args += ["--port", str(free_port_pair())]
        self.host = self.args[self.args.index("--host") + 1] if "--host" in self.args else "127.0.0.1"
        self.log_path = log_path
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.startup_s: float | None = None

    @property
    def port(self) -> int:
        return int(self.args[self.args.index("--port") + 1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Stack":
        """Up, or RuntimeError with the output's tail. Ports are drawn seconds before their
        processes bind them (the router's only once every worker is up): where another process
        took one meanwhile and the stack's port was ours to choose, it starts again on others."""
        attempt = 1
        while True:
            try:
                return self._start()
            except RuntimeError:
                taken = any(m in self.tail() for m in PORT_TAKEN)
                if not (taken and self.own_port and attempt < PORT_ATTEMPTS):
                    raise
            attempt += 1
            self.args[self.args.index("--port") + 1] = str(free_port_pair())
            print(f"a port was taken before its process bound it; starting again on {self.port}", flush=True)

    def _start(self) -> "Stack":
        where = f"  (log: {self.log_path})" if self.log_path else ""
        print(f"starting: pdflash up {shlex.join(self.args)}{where}", flush=True)
        start = time.monotonic()
        self.lines = []  # this start's output
        self.proc = subprocess.Popen([sys.executable, "-m", "common.tools.cli", "up", *self.args], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        up, ended = threading.Event(), threading.Event()  # its "is up" line; its output's end
        if self.log_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "w") if self.log_path else contextlib.nullcontext()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            with log:
                for line in self.proc.stdout:
                    self.lines.append(line)
                    if self.log_path:
                        log.write(line)
                        log.flush()
                    if "pdflash is up" in line:
                        up.set()
            ended.set()
            up.set()  # wakes the wait below; `ended` says it was not the line

        threading.Thread(target=pump, daemon=True).start()
        # The output ending is the stack failing, although its process may not be reaped yet.
        if not up.wait(self.timeout) or ended.is_set() or self.proc.poll() is not None:
            self.stop()
            see = f"; see {self.log_path}" if self.log_path else ""
            raise RuntimeError(f"pdflash up {shlex.join(self.args)} did not come up{see}:\n" + self.tail())
        self.startup_s = time.monotonic() - start
        print(f"up in {self.startup_s:.0f} s: {self.url}", flush=True)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only its children
            self.proc.wait()

    def tail(self, n: int = 60) -> str:
        return "".join(self.lines[-n:])

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
