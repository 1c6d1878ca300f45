"""`pdflash bench engine` as a user runs it, scaled down to seconds on a CPU: the floor check on
random weights of a shape, and the comparison with transformers on random weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.model.shapes import SHAPES, first_layers
from common.tools.bench.memory import request_memory
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


def test_memory_only_numbers_of_kimi_linear_48b(tmp_path, capsys):
    """--memory-only times nothing: Kimi-Linear-48B's KV per token (7 MLA layers of a 512 + 64
    latent) and state per request (20 KDA layers of a 32 x 128 x 128 fp32 state and the q, k, v
    convolution windows), in bf16, by hand against the command."""
    out = tmp_path / "memory.json"
    assert cli.main(["bench", "engine", "--shape", "kimi-linear-48b", "--memory-only", "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["kv_bytes_per_token"] == 7 * 576 * 2
    assert m["state_bytes_per_request"] == 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2)
    assert m["prompt_bytes"] == 16384 * 7 * 576 * 2 + m["state_bytes_per_request"]
    assert 48e9 < m["params"] < 50e9 and 2.9e9 < m["active_params"] < 3.2e9  # the model card's 48B / 3B
    assert "state per request: 43417600 bytes" in capsys.readouterr().out


def test_first_layers_keep_the_kda_mla_pattern():
    cut = first_layers(SHAPES["kimi-linear-48b"], 14)
    assert cut.num_layers == 14 and cut.kv_layers == (3, 7, 11) and cut.moe == SHAPES["kimi-linear-48b"].moe


def test_moe_floor_counts_the_chosen_experts_and_the_state(tmp_path):
    """A MoE and KDA shape's floor: the routed experts read per step are those the tokens chose
    (at least k and at most min(batch x k, experts) per MoE layer), fewer bytes than every
    weight; the KDA states are read and written once per request and step."""
    out = tmp_path / "floor.json"
    assert cli.main(["bench", "engine", "--shape", "kimi-linear-small", *SMALL, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    cfg = SHAPES["kimi-linear-small"]
    moe_layers, k, n = cfg.num_layers - cfg.moe.first_dense_layers, cfg.moe.experts_per_token, cfg.moe.num_experts
    every_weight = 2 * (request_memory(cfg, 2, 1).params - cfg.vocab_size * cfg.hidden_size)  # less the input embedding
    expert = 2 * 3 * cfg.moe.intermediate_size * cfg.hidden_size
    for f in result["floor"]:
        b = f["batch"]
        assert moe_layers * k <= f["experts_read"] <= moe_layers * min(b * k, n)
        assert f["weight_bytes"] == pytest.approx(every_weight - (moe_layers * n - f["experts_read"]) * expert, abs=expert)
        assert f["state_bytes"] == 2 * b * cfg.state_bytes_per_request(2)
        bandwidth = result["memory_bandwidth_gbs"] * 1e9
        assert f["floor_ms"] == pytest.approx(1e3 * (f["weight_bytes"] + f["state_bytes"]) / bandwidth)
        assert (f["layers"], f["model_layers"]) == (5, 5)
    assert result["floor"][0]["weight_bytes"] < result["floor"][1]["weight_bytes"]  # batch 3 reads more experts
