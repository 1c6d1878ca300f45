"""deploy/pd.sh for real with the cpu-local profile (plain processes on this machine), one stack
load for the whole life cycle:

1. start: P -> D -> router, results/<RUN_ID>/ with commands, logs, metadata
2. a second run is refused while this one is up; bench on the running stack: reused (no second
   start), summary written
3. bench with another stack setting: refused (exit 3), the stack untouched
4. all on the same run with a smoke answer that cannot match: start reuses the stack, smoke fails
   (exit 1, recorded), logs are collected and the stack stopped; nothing is left listening
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from common.parallel.ports import free_ports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent




def test_cpu_local_life_cycle(tmp_path):
    router, prefill, decode = free_ports(3)
    results = tmp_path / "results"
    sets = [f"RESULTS_DIR={results}", f"ROUTER_PORT={router}", f"PREFILL_PORT={prefill}", f"DECODE_PORT={decode}"]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "RUN_ID": "life"}

    def pd(command: str, *more: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(REPO / "deploy" / "pd.sh"), command, "cpu-local", *sets, *more], env=env,
                              capture_output=True, text=True, timeout=600)

    run = results / "life"
    try:
        r = pd("start")
        assert r.returncode == 0, r.stdout + r.stderr
        assert (results / "ACTIVE").read_text().startswith("RUN_ID=life\n")
        assert (run / "metadata" / "stack.env").is_file() and (run / "commands" / "01-start.sh").is_file()
        assert "ready on 127.0.0.1:%d" % prefill in (run / "logs" / "prefill0.log").read_text()

        other = subprocess.run([str(REPO / "deploy" / "pd.sh"), "start", "cpu-local", *sets],
                               env={**env, "RUN_ID": "other"}, capture_output=True, text=True, timeout=120)
        assert other.returncode == 3 and "run life is (partly) up" in other.stdout, other.stdout + other.stderr

        r = pd("bench", "BENCH_TOOL=builtin", "BENCH_NUM=4")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "already up with these settings" in r.stdout and "-m prefill_svc" not in r.stdout
        summary = json.loads((run / "bench" / "summary.json").read_text())
        assert summary["succeeded"] == 4 and summary["failed"] == 0 and summary["output_tok_s"] > 0

        r = pd("bench", "CHUNK_SIZE=256")
        assert r.returncode == 3 and "CHUNK_SIZE: '512' -> '256'" in r.stdout, r.stdout + r.stderr
        assert pd("status").returncode == 0

        r = pd("all", "SMOKE_EXPECT=Lyon")
        assert r.returncode == 1, r.stdout + r.stderr
        assert "already up with these settings" in r.stdout and "step smoke FAILED (exit 1)" in r.stdout
        assert "resume with: RUN_ID=life deploy/pd.sh bench" in r.stdout
    finally:
        stopped = pd("stop")  # whatever happened above: no process outlives the test
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    steps = [json.loads(line) for line in (run / "metadata" / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"]) for s in steps] == [
        ("start", 0), ("start", 0), ("bench", 0), ("start", 3), ("start", 0), ("smoke", 1), ("logs", 0), ("stop", 0),
        ("stop", 0)]
    assert json.loads((run / "bench" / "smoke.json").read_text())["text"].strip().startswith("Paris")
    assert (run / "metadata" / "after-stop-local.txt").read_text() == ""
    assert not (results / "ACTIVE").exists() and not list((run / "pids").glob("*.pid"))
    assert pd("status").returncode != 0  # nothing up any more
