"""Runs (or, with DRY_RUN, only prints) commands, and keeps the record of a run:
results/<RUN_ID>/commands/<NN>-<step>.sh (every command as run) and metadata/steps.jsonl (each
step's exit code and duration)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from pdeploy.commands import Cmd
from pdeploy.config import REPO_ROOT


class StepFailed(Exception):
    def __init__(self, message: str, rc: int = 1):
        super().__init__(message)
        self.rc = rc


class Runner:
    def __init__(self, dry: bool, run_dir: Path | None, out: TextIO | None = None):
        self.dry = dry
        self.run_dir = run_dir  # None: nothing is recorded (dry runs, status)
        self.out = out or sys.stdout
        self.step = "preflight"
        self._step_no = 0

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def note(self, text: str) -> None:
        self.say(f"# {text}")

    def begin(self, step: str) -> None:
        self.step = step
        self._step_no += 1
        self.say(f"\n# ==== {step} ====")

    def record(self, text: str) -> None:
        if self.run_dir is not None and not self.dry:
            path = self.run_dir / "commands" / f"{self._step_no:02d}-{self.step}.sh"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(text + "\n")

    def run(self, cmd: Cmd, timeout: float | None = None, quiet: bool = False) -> int:
        """Print, record and (unless dry) run `cmd`; raises StepFailed on a non-zero exit when
        cmd.check. `quiet`: do not print (polls), output discarded."""
        if not quiet:
            self.say(cmd.text)
        if self.dry:
            return 0
        if not quiet:
            self.record(cmd.text)
        try:
            kw = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL} if quiet else {"stdout": self.out}
            rc = subprocess.run(["bash", "-c", cmd.text], cwd=REPO_ROOT, timeout=timeout, **kw).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        if rc and cmd.check:
            raise StepFailed(f"command failed (exit {rc}): {cmd.text.splitlines()[0]}", rc)
        return rc

    def poll(self, probe: Cmd, alive: Cmd | None, what: str, interval: float, timeout: float) -> None:
        """Run `probe` until it succeeds; fail at `timeout` or as soon as `alive` fails."""
        self.note(f"wait until {what} (every {interval:g} s, at most {timeout:g} s):")
        self.say(probe.text)
        if alive is not None:
            self.note("  and fail at once when this fails:")
            self.say(alive.text)
        if self.dry:
            return
        self.record(probe.text)
        deadline = time.monotonic() + timeout
        while True:
            if self.run(Cmd(probe.text, check=False), timeout=max(interval * 4, 10), quiet=True) == 0:
                return
            if alive is not None and self.run(Cmd(alive.text, check=False), timeout=30, quiet=True) != 0:
                raise StepFailed(f"{what}: the service exited during start-up (see its log)", 1)
            if time.monotonic() > deadline:
                raise StepFailed(f"{what}: not healthy after {timeout:g} s", 124)
            time.sleep(interval)

    def check_once(self, probe: Cmd) -> bool:
        """A read-only probe (status, reuse checks); runs in dry runs too, never recorded."""
        r = subprocess.run(["bash", "-c", probe.text], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)
        return r.returncode == 0

    def log_step(self, step: str, rc: int, seconds: float, error: str = "") -> None:
        if self.run_dir is None or self.dry:
            return
        entry = {"step": step, "rc": rc, "seconds": round(seconds, 3), "ended": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if error:
            entry["error"] = error
        path = self.run_dir / "metadata" / "steps.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
