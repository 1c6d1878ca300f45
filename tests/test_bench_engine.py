"""`pdflash bench engine` as a user runs it, scaled down to seconds on a CPU: the floor check on
random weights of a shape, and the comparison with transformers on random weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from common.model.shapes import SHAPES
from common.tools import cli
from common.tools.bench import engine as bench_engine

PDFLASH = os.path.join(os.path.dirname(sys.executable), "pdflash")
SMALL = ["--device", "cpu", "--batches", "1,3", "--new-tokens", "3", "--repeats", "1", "--warmup", "0",
         "--decode-prompt-tokens", "8"]


def test_floor_check_on_a_shape(tmp_path):
    out = tmp_path / "floor.json"
    r = subprocess.run([PDFLASH, "bench", "engine", "--shape", "tiny", *SMALL, "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["memory_bandwidth_gbs"] > 0 and "rows" not in result
    assert [(f["shape"], f["batch"], f["dtype"]) for f in result["floor"]] == [("tiny", 1, "bf16"), ("tiny", 3, "bf16")]
    for f in result["floor"]:
        assert f["floor_ms"] > 0 and f["step_ms"] >= f["floor_ms"] and f["x_floor"] == f["step_ms"] / f["floor_ms"]
        assert f["weight_bytes"] > 0 and f["cuda_graphs"] is False
    assert "| tiny | bf16 | 3 | 8 + 3 |" in r.stdout


def test_compare_on_random_weights(tmp_path, monkeypatch, capsys):
    """--random-weights needs no model file: ours and transformers get the same random weights
    (the embedded shape, shrunk here to the tiny one)."""
    monkeypatch.setitem(bench_engine.SHAPES, "embedded", SHAPES["tiny"])
    out = tmp_path / "engine.json"
    assert cli.main(["bench", "engine", "--random-weights", "--dtype", "fp32", "--prefill-tokens", "16",
                     *SMALL, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["weights"] == "random" and result["floor"] == []
    rows = result["rows"]
    assert [(r["metric"], r["batch"]) for r in rows] == [("prefill", 1), ("decode", 1), ("decode", 3)]
    assert all(r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in rows)
    assert rows[0]["ours_step_ms"] is None
    assert all(r["ours_step_ms"] > 0 and r["floor_ms"] > 0 for r in rows[1:])
    assert "no model file" in capsys.readouterr().out
