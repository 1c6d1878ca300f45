"""`pdflash bench gsm8k | serving | ab` as a user runs them, against a real `pdflash up` on this
CPU, scaled down (128 -> 16 tokens, concurrency 2-3, a handful of requests). One pd stack with
DFlash is shared by the module; `bench ab` compares it with a colocated stack it starts itself."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import requests

from common.tools.bench import serving

from bench_fields import assert_gsm8k_run, assert_serving_summary
from pd_stack import ROOT, Stack

pytestmark = pytest.mark.slow

PDFLASH = os.path.join(os.path.dirname(sys.executable), "pdflash")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def stack(pd_stack):
    """The session's pd stack with --spec dflash (conftest.py)."""
    return pd_stack


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run([PDFLASH, "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _load(path: str):
    with open(path) as f:
        return json.load(f) if path.endswith(".json") else [json.loads(line) for line in f]


def _assert_png(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000, path


def _assert_warmed_every_backend(warmup: dict, stack: Stack) -> None:
    assert warmup["method"] == "grpc-direct"
    served = {r["prefill"] for r in warmup["requests"]} | {r["decode"] for r in warmup["requests"]}
    assert served >= {w.addr for w in stack.workers}, (warmup, stack.workers)


def test_gsm8k(stack, tmp_path):
    out = tmp_path / "gsm8k"
    r = _bench("gsm8k", "--url", stack.url, "--num", "4", "--shots", "1", "--shots-from", "test",
               "--max-new-tokens", "16", "--concurrency", "1,2", "--dataset", os.path.join(FIXTURES, "gsm8k_test.jsonl"),
               "--out", str(out))
    s = _load(str(out / "summary.json"))
    assert [run["concurrency"] for run in s["runs"]] == [1, 2]
    assert s["overlap_questions"] == 1  # the first question is also the exemplar
    _assert_warmed_every_backend(s["warmup"], stack)
    for run in s["runs"]:
        assert_gsm8k_run(run, spec=True)
        assert (run["requests_ok"], run["requests_planned"], run["requests_excluding_overlap"]) == (4, 4, 3)
        rows = _load(str(out / f"gsm8k_c{run['concurrency']}.jsonl"))
        assert len(rows) == 4 and rows[0]["few_shot_overlap"] and not any(r["few_shot_overlap"] for r in rows[1:])
        for row in rows:
            assert {"question", "label", "output", "parsed", "correct", "finish_reason", "meta_info"} <= set(row)
        assert run["correct"] == sum(row["correct"] for row in rows)
        assert run["output_tokens"] == sum(row["meta_info"]["completion_tokens"] for row in rows)
        assert run["hit_output_cap"] == sum(row["finish_reason"] == "length" for row in rows)
        _assert_png(str(out / f"accept_hist_c{run['concurrency']}.png"))
    assert "histogram invariants hold for all" in r.stdout
    assert "| accept length (weighted) |" in r.stdout and (out / "summary.md").exists()


def test_serving(stack, tmp_path):
    out = tmp_path / "serving"
    r = _bench("serving", "--url", stack.url, "--input-len", "128", "--output-len", "16", "--concurrency", "2",
               "--num", "4", "--warmup", "--out", str(out))
    s = _load(str(out / "summary.json"))
    assert_serving_summary(s)
    assert (s["requests_ok"], s["failures"], s["length_mismatches"]) == (4, 0, [])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (4 * 128, 4 * 16)
    assert s["spec"]["invariants"]["violations"] == []
    _assert_warmed_every_backend(s["warmup"], stack)
    rows = _load(str(out / "requests.jsonl"))
    assert len(rows) == 4 and all(row["ok"] and row["output_tokens"] == 16 for row in rows)
    assert all(row["ttft_s"] < row["e2e_s"] for row in rows)
    _assert_png(str(out / "latency.png"))
    assert "| TTFT (s) |" in r.stdout and "TPOT" in (out / "summary.md").read_text()


def test_router_figures_match_the_client(stack, tmp_path):
    """The router's fleet and per-backend counters grow by exactly what a bench measured."""
    before = requests.get(stack.url + "/server_info", timeout=30).json()
    args = argparse.Namespace(input_len=64, output_len=12, concurrency=2, num=2, dataset="random", warmup=False,
                              temperature=0.0, seed=3, timeout=300)
    s = serving.bench(stack.url, args, str(tmp_path))
    after = requests.get(stack.url + "/server_info", timeout=30).json()

    def delta(a: dict | None, b: dict | None, key: str):
        x, y = (a or {}).get("spec") or {}, (b or {}).get("spec") or {}
        if key == "histogram":
            hx = x.get("histogram", [])
            return [n - (hx[k] if k < len(hx) else 0) for k, n in enumerate(y["histogram"])]
        return y[key] - x.get(key, 0)

    spec = s["spec"]
    views = [(before["fleet"], after["fleet"])] + [(b0["served"], b1["served"])
                                                   for b0, b1 in zip(before["backends"], after["backends"])]
    for old, new in views:  # one P and one D: each saw every request
        assert new["requests_ok"] - (old or {}).get("requests_ok", 0) == 2
        for key in ("verify_steps", "accepted_drafts", "proposed_drafts", "histogram"):
            assert delta(old, new, key) == spec[key], key
    fleet = after["fleet"]["spec"]
    assert fleet["accept_length_weighted"] == pytest.approx(1 + fleet["accepted_drafts"] / fleet["verify_steps"])
    metrics = requests.get(stack.url + "/metrics", timeout=30).text
    assert "pdflash_spec_accept_length_weighted " in metrics
    for w in stack.workers:
        assert f'pdflash_backend_requests_total{{backend="{w.addr}",role="{w.role}",status="ok"}}' in metrics


def test_ab(stack, tmp_path):
    """pd + DFlash (the running stack, by URL) against a colocated stack that ab starts, on a
    JSONL prompt file, rounds alternating between them (--interleave)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ("The capital of France is", "List three colours:", "Count from one to five:")))
    out = tmp_path / "ab"
    r = _bench("ab", "--interleave", "--stack", f"pd+dflash={stack.url}", "--stack", "colocated=--mode colocated",
               "serving", "--dataset", str(prompts), "--output-len", "8", "--num", "3", "--concurrency", "2",
               "--out", str(out))
    result = _load(str(out / "ab.json"))
    assert [a["label"] for a in result["arms"]] == ["pd+dflash", "colocated"]
    for arm in result["arms"]:
        assert arm["error"] is None
        assert_serving_summary(arm["summary"])
        assert arm["summary"]["requests_ok"] == 3 and arm["summary"]["total_output_tokens"] == 24
        assert os.path.exists(os.path.join(arm["out"], "summary.json"))
    colocated = result["arms"][1]["summary"]
    assert colocated["server"]["policy"] == "round_robin" and colocated["spec"] is None
    assert colocated["warmup"]["method"] == "grpc-direct" and len(colocated["warmup"]["requests"]) == 1
    assert os.path.exists(os.path.join(result["arms"][1]["out"], "stack.log"))
    rows = {row["key"]: row for row in result["table"]}
    ttft = rows["ttft_s.mean"]
    assert ttft["change"][1] == pytest.approx((ttft["values"][1] - ttft["values"][0]) / ttft["values"][0])
    assert "| TTFT mean (s) |" in r.stdout and "vs pd+dflash" in r.stdout
    assert (out / "ab.md").read_text().startswith("## A/B: pdflash bench serving")
    # Interleaved: each arm's 3 requests went out in rounds of --concurrency 2, arms alternating.
    assert result["interleaved"] and [a["rounds"] for a in result["arms"]] == [2, 2]


def test_transfer_bench_exits_zero(tmp_path):
    """A successful `pdflash bench transfer` (real Mooncake, two processes) exits 0 and saves its JSON."""
    out = tmp_path / "transfer.json"
    r = _bench("transfer", "--tokens", "256", "--repeats", "2", "--warmup", "1", "--out", str(out))
    result = _load(str(out))
    assert result["verified"] == {"mooncake_tcp": True, "plain_tcp": True}, r.stdout
    assert "mooncake / plain" in r.stdout


def test_dflash_bench_small_grid(tmp_path):
    """`pdflash bench dflash` in-process on the embedded model: chat questions and a 300-token
    context, two at a time, two rounds of each arm, the block pinned (no cost measurement),
    outputs identical to plain decoding (fp32), the JSON, the table and the PNG."""
    out = tmp_path / "dflash"
    r = _bench("dflash", "--device", "cpu", "--concurrency", "2", "--lengths", "gsm8k,300", "--num", "2",
               "--max-new-tokens", "6", "--spec-block", "4", "--rounds", "2", "--out", str(out))
    result = _load(str(out / "dflash.json"))
    assert [(run["prompt"], run["concurrency"]) for run in result["runs"]] == [("gsm8k", 2), ("300", 2)]
    for run in result["runs"]:
        assert run["identical_outputs"] == run["requests"] == 4 and run["invariant_violations"] == []
        assert len(run["round_speedups"]) == 2 and run["round_speculated_shares"] == [1.0, 1.0]
        assert all(len(ms) == 2 and min(ms) > 0 for ms in run["round_prefill_ms"].values())
        assert run["blocks"] == {"4": run["verify_steps"]} and run["speculated_share"] == 1.0
        assert run["plain_tok_s"] > 0 and run["dflash_tok_s"] > 0
        assert run["plain_prefill_ms"] > 0 and run["dflash_prefill_ms"] > 0
        assert run["step_ms"] is None  # device times: CUDA only
    assert 250 < result["runs"][1]["prompt_tokens_mean"] <= 300
    _assert_png(str(out / "speedup.png"))
    assert "| speedup |" in r.stdout


def test_dflash_step_costs_from_rounds():
    """The device times of an arm's rounds add up per block; a block's cost is counted in plain
    steps of the plain arm; wall time per step is decode time over every step run."""
    from common.engine.step_clock import BlockTime
    from common.tools.bench.dflash import merged, step_costs

    run = lambda device, decode: {"reqs": [], "seconds": 1.0, "decode_seconds": decode, "prefill_seconds": 0.1,
                                  "graphs_captured": 0, "device": device}
    base = merged([run({0: BlockTime(100, 0.10)}, 0.12), run({0: BlockTime(100, 0.10)}, 0.12)])
    fast = merged([run({4: BlockTime(40, 0.06), 0: BlockTime(10, 0.01)}, 0.08),
                   run({4: BlockTime(60, 0.09)}, 0.12)])
    assert fast["device"][4].steps == 100 and fast["device"][4].seconds == pytest.approx(0.15)
    c = step_costs(base, fast)
    assert c["plain_device_ms"] == pytest.approx(1.0) and c["plain_wall_ms"] == pytest.approx(1.2)
    assert c["dflash_steps"] == {0: 10, 4: 100} and c["dflash_wall_ms"] == pytest.approx(1e3 * 0.2 / 110)
    assert c["dflash_device_ms"] == pytest.approx({0: 1.0, 4: 1.5})
    assert c["in_plain_steps"] == pytest.approx({0: 1.0, 4: 1.5})
    assert step_costs(merged([run({}, 0.1)]), fast) is None  # no device times (the CPU)
