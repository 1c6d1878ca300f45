"""Benchmark statistics on a fixed set of recorded responses (tests/fixtures/bench_responses.json,
from `pdflash up --mode pd --spec dflash`): percentiles, both accept lengths, the draft
acceptance rate, the histogram invariants, and the serving / gsm8k / ab summaries built on them."""
from __future__ import annotations

import argparse
import copy
import json
import os

import numpy as np
import pytest

from common.tools.bench import ab, gsm8k, serving, stats, warmup
from common.tools.bench import gsm8k_data as data
from common.tools.bench.client import Response

from bench_fields import assert_gsm8k_run, assert_serving_summary

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def recorded():
    with open(os.path.join(FIXTURES, "bench_responses.json")) as f:
        return json.load(f)


# ---- percentiles -----------------------------------------------------------------------------

@pytest.mark.parametrize("values", [[1.0], [1.0, 2.0, 3.0, 4.0], [5, 1, 4, 2, 3], list(np.linspace(0, 7, 41) ** 2)])
@pytest.mark.parametrize("pct", [0, 50, 95, 99, 100])
def test_percentile_matches_numpy(values, pct):
    assert stats.percentile(values, pct) == pytest.approx(float(np.percentile(values, pct)))


def test_describe():
    d = stats.describe([0.4, 0.1, 0.2, 0.3], scale=1000)
    assert d == pytest.approx({"n": 4, "mean": 250, "p50": 250, "p95": 385, "p99": 397, "min": 100, "max": 400})
    assert stats.describe([]) == {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None, "min": None, "max": None}


# ---- accept lengths and invariants -------------------------------------------------------------

def test_spec_summary_of_recorded_gsm8k(recorded):
    metas = [r["meta_info"] for r in recorded["gsm8k"]]
    s = stats.spec_summary(metas)
    # Three responses with verify steps (40, 25, 14), one that stopped at its first token.
    assert s["requests"] == 3 and s["requests_without_verify"] == 1
    assert (s["verify_steps"], s["accepted_drafts"], s["proposed_drafts"]) == (79, 61, 1185)
    assert s["block_size"] == 16
    assert s["histogram"] == [42, 24, 7, 3, 1, 2] + [0] * 10
    assert s["accept_length_weighted"] == pytest.approx(1 + 61 / 79)  # 1.772
    assert s["accept_length_interface"] == pytest.approx((64 / 40 + 40 / 25 + 39 / 14) / 3)  # 1.995
    assert s["accept_length_interface_pooled"] == pytest.approx((64 + 40 + 39) / 79)
    assert s["draft_acceptance_rate"] == pytest.approx(61 / 1185)  # without the bonus token
    assert s["invariants"] == {"checked": 3, "ok": 3, "violations": []}
    assert "hold for all 3 requests" in stats.invariants_line(s)
    # The interface value is biased up here: every request's first token came from prefill.
    assert s["accept_length_interface"] > s["accept_length_weighted"]


def test_spec_summary_of_recorded_serving(recorded):
    s = stats.spec_summary([r["meta_info"] for r in recorded["serving"]])
    assert (s["requests"], s["verify_steps"], s["accepted_drafts"], s["proposed_drafts"]) == (4, 55, 5, 825)
    assert s["accept_length_weighted"] == pytest.approx(1 + 5 / 55)
    assert s["accept_length_interface"] == pytest.approx((3 * 16 / 15 + 16 / 10) / 4)
    assert not s["invariants"]["violations"]


def test_no_spec_fields_means_no_spec_summary(recorded):
    plain = [{k: v for k, v in r["meta_info"].items() if not k.startswith("spec_")} for r in recorded["gsm8k"]]
    assert stats.spec_summary(plain) is None
    assert "not checked" in stats.invariants_line(None)


@pytest.mark.parametrize("change, message", [
    (lambda m: m["spec_accept_histogram"].__setitem__(0, m["spec_accept_histogram"][0] + 1), "sum(histogram)"),
    (lambda m: m.update(spec_accepted_drafts=m["spec_accepted_drafts"] + 1), "sum(k * hist[k])"),
    (lambda m: m.update(spec_proposed_drafts=m["spec_proposed_drafts"] - 15), "(B - 1) * steps with block B"),
    (lambda m: m.update(completion_tokens=m["completion_tokens"] + 1), "completion_tokens"),
    (lambda m: m.update(spec_accept_length=m["spec_accept_length"] + 0.5), "spec_accept_length ="),
    (lambda m: m.update(spec_accept_length_weighted=2.0), "spec_accept_length_weighted"),
])
def test_each_invariant_is_checked(recorded, change, message):
    metas = copy.deepcopy([r["meta_info"] for r in recorded["gsm8k"]])
    assert stats.check_invariants(metas[0]) == []
    change(metas[0])
    problems = stats.check_invariants(metas[0])
    assert any(message in p for p in problems), problems
    s = stats.spec_summary(metas)
    assert s["invariants"]["ok"] == 2 and s["invariants"]["violations"][0]["index"] == 0
    assert "VIOLATED in 1 of 3" in stats.invariants_line(s)


def test_invariants_of_a_response_with_several_blocks_and_plain_steps():
    """An engine that chooses the block per step: proposed drafts follow the block histogram,
    and plain steps may add one token each."""
    meta = {"spec_verify_ct": 3, "spec_accept_histogram": [1, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
            "spec_accepted_drafts": 10, "spec_proposed_drafts": 3 + 7 + 15,
            "spec_block_histogram": [0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1], "spec_plain_steps": 4,
            "completion_tokens": 1 + 3 + 10 + 4}
    assert stats.check_invariants(meta) == []
    for change, message in [({"spec_proposed_drafts": 45}, "(B - 1) * steps with block B"),
                            ({"spec_block_histogram": [0] * 16 + [2]}, "sum(block histogram)"),
                            ({"completion_tokens": 19}, "plain_steps")]:
        assert any(message in p for p in stats.check_invariants(meta | change)), change


# ---- serving summary ----------------------------------------------------------------------------

def _responses(rows: list[dict]) -> list[Response]:
    out = []
    for i, row in enumerate(rows):
        times = [row["ttft_s"]]
        for gap in row["itl_ms"]:
            times.append(times[-1] + gap / 1000)
        out.append(Response(i, ok=True, ttft=row["ttft_s"], e2e=row["e2e_s"], token_times=times,
                            token_counts=row["tokens_per_event"], output_ids=[0] * 16, meta=row["meta_info"]))
    return out


def test_serving_summary_of_recorded_streams(recorded):
    rows = recorded["serving"]
    results = _responses(rows) + [Response(len(rows), error="HTTP 503: no free KV pages")]
    args = argparse.Namespace(input_len=128, output_len=16, concurrency=2, num=5, dataset="random", temperature=0.0,
                              seed=0, warmup=True)
    bodies = [{"input_ids": [7] * 128, "sampling_params": {"max_new_tokens": 16}}] * 5
    s = serving.summarize(results, 10.0, bodies, args)
    assert_serving_summary(s)
    assert (s["requests_planned"], s["requests_ok"], s["failures"]) == (5, 4, 1)
    assert s["errors"] == [{"error": "HTTP 503: no free KV pages", "count": 1}]
    assert s["length_mismatches"] == []
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (512, 64)
    assert s["input_tok_s"] == pytest.approx(51.2) and s["output_tok_s"] == pytest.approx(6.4)
    ttft = [r["ttft_s"] for r in rows]
    assert s["ttft_s"]["mean"] == pytest.approx(np.mean(ttft))
    assert s["ttft_s"]["p95"] == pytest.approx(np.percentile(ttft, 95))
    tpot = [(r["e2e_s"] - r["ttft_s"]) / 15 * 1000 for r in rows]
    assert s["tpot_ms"]["mean"] == pytest.approx(np.mean(tpot))
    itl = [g for r in rows for g in r["itl_ms"]]  # per event: an accepted draft shares its event
    assert s["itl_ms"]["n"] == len(itl) < 4 * 15 and s["itl_ms"]["p99"] == pytest.approx(np.percentile(itl, 99))
    assert s["e2e_s"]["p50"] == pytest.approx(np.median([r["e2e_s"] for r in rows]))
    assert s["spec"]["accept_length_weighted"] == pytest.approx(1 + 5 / 55)
    s["server"] = {"policy": "pd", "backends": [{}, {}]}
    text = serving.markdown(s)
    assert "| TTFT (s) |" in text and "failed x1: HTTP 503" in text and "weighted 1.09" in text


def test_serving_flags_wrong_lengths(recorded):
    results = _responses(recorded["serving"][:1])
    args = argparse.Namespace(input_len=128, output_len=32, concurrency=1, num=1, dataset="random", temperature=0.0,
                              seed=0, warmup=False)
    s = serving.summarize(results, 1.0, [{"input_ids": [7] * 128, "sampling_params": {"max_new_tokens": 32}}], args)
    assert s["length_mismatches"] == [0]  # 16 tokens came back, 32 were asked


# ---- gsm8k summary ------------------------------------------------------------------------------

def test_gsm8k_summary_of_recorded_answers(recorded):
    rec = recorded["gsm8k"]
    items = [data.Item(f"q{i}", f"worked answer\n#### {r['label']:g}") for i, r in enumerate(rec)]
    results = [Response(i, ok=True, e2e=1.0 + i, text=r["output"], meta=r["meta_info"]) for i, r in enumerate(rec)]
    results[1].text += " so the answer is wrong"  # the #### answer still wins over the last number
    overlap = [True, False, False, False]
    rows = [gsm8k.record(it, r, ov) for it, r, ov in zip(items, results, overlap)]
    assert [row["parsed_by"] for row in rows] == ["last number", "####", None, "####"]
    assert [row["parsed"] for row in rows] == [1.0, 4.0, None, 210.0]
    assert [row["finish_reason"] for row in rows] == ["length", "stop", "stop", "stop"]
    rows[3]["correct"] = True  # pretend one is right, to check the counting
    s = gsm8k.summarize(8, rows, results, wall=4.0)
    assert_gsm8k_run(s, spec=True)
    assert (s["requests_ok"], s["requests_planned"], s["correct"], s["hit_output_cap"]) == (4, 4, 1, 1)
    assert (s["correct_excluding_overlap"], s["requests_excluding_overlap"]) == (1, 3)
    assert s["output_tokens"] == 64 + 40 + 1 + 39 and s["output_tok_s"] == pytest.approx(144 / 4)
    assert s["accept_length_weighted"] == pytest.approx(1 + 61 / 79)
    assert (s["verify_steps"], s["accepted_drafts"], s["proposed_drafts"]) == (79, 61, 1185)
    text = gsm8k.markdown({"runs": [s], "config": {"shots": 5, "shots_from": "test", "temperature": 0.0,
                                                   "max_new_tokens": 64}, "overlap_questions": 1,
                           "server": {"policy": "pd", "backends": [{}, {}]}})
    assert "| correct excl. few-shot overlap | 1 / 3 |" in text
    assert "| accept length (weighted) | 1.77 |" in text and "| draft acceptance (no bonus) | 5.1% |" in text


# ---- ab comparison --------------------------------------------------------------------------------

def test_ab_relative_change_and_verdict():
    common = {"input_tok_s": 1000.0, "tpot_ms": {"mean": 50.0, "p95": 60.0}, "e2e_s": {"mean": 9.0}, "failures": 0}
    base = common | {"output_tok_s": 100.0, "ttft_s": {"mean": 2.0, "p95": None}, "spec": None}
    other = common | {"output_tok_s": 125.0, "ttft_s": {"mean": 2.5, "p95": None},
                      "spec": {"accept_length_weighted": 3.0}}
    arms = [{"label": "colocated", "stack": "--mode colocated", "summary": base, "error": None},
            {"label": "pd", "stack": "--mode pd", "summary": other, "error": None}]
    rows = {r["key"]: r for r in ab.compare(arms, "serving")}
    assert rows["output_tok_s"]["change"] == [0.0, pytest.approx(0.25)]
    assert rows["output_tok_s"]["verdict"] == [None, "better"]
    assert rows["ttft_s.mean"]["change"][1] == pytest.approx(0.25) and rows["ttft_s.mean"]["verdict"][1] == "worse"
    assert rows["failures"]["change"] == [0.0, 0.0] and rows["failures"]["verdict"] == [None, None]
    assert rows["spec.accept_length_weighted"]["values"] == [None, 3.0]
    assert "ttft_s.p95" not in rows  # nobody has it: no row
    text = ab.markdown({"of": "serving", "arms": arms, "table": list(rows.values())})
    assert "| output tok/s | 100.000 | 125.000 | +25.0% (better) |" in text
    assert "| pd | 1000.00 | 125.00 | 2.50 s / - s | 50.00 ms / 60.00 ms | 9.00 s | 3.00 | 0 |" in text


def test_ab_compares_gsm8k_per_concurrency():
    def summary(correct: int, tok_s: float) -> dict:
        run = {"correct": correct, "output_tok_s": tok_s, "accept_length_weighted": None}
        return {"runs": [dict(run, concurrency=1), dict(run, concurrency=8, output_tok_s=4 * tok_s)]}

    arms = [{"label": "a", "stack": "x", "summary": summary(10, 20.0), "error": None},
            {"label": "b", "stack": "y", "summary": summary(12, 10.0), "error": None}]
    rows = {r["metric"]: r for r in ab.compare(arms, "gsm8k")}
    assert rows["C1 correct"]["change"][1] == pytest.approx(0.2) and rows["C1 correct"]["verdict"][1] == "better"
    assert rows["C8 output tok/s"]["values"] == [80.0, 40.0] and rows["C8 output tok/s"]["verdict"][1] == "worse"
    assert "C1 accept length (weighted)" not in rows  # no speculation on either: no row


def test_ab_stack_argument():
    assert ab.parse_stack("pd + dflash = --mode pd --spec dflash") == ("pd + dflash", "--mode pd --spec dflash")
    with pytest.raises(ValueError, match="LABEL=ARGS"):
        ab.parse_stack("--mode pd")


# ---- warm-up coverage ------------------------------------------------------------------------------

@pytest.mark.parametrize("prefills, decodes", [([], ["r1"]), ([], ["r1", "r2", "r3"]), (["p1"], ["d1"]),
                                               (["p1"], ["d1", "d2", "d3"]), (["p1", "p2", "p3"], ["d1", "d2"])])
def test_warmup_plan_covers_every_backend(prefills, decodes):
    pairs = warmup.plan(prefills, decodes)
    assert len(pairs) == max(len(prefills), len(decodes))  # no more requests than needed
    assert {p for p, _ in pairs} == (set(prefills) or {None}) and {d for _, d in pairs} == set(decodes)


def test_warmup_reads_backends_from_server_info():
    info = {"backends": [{"role": "prefill", "addr": "a:1"}, {"role": "decode", "addr": "b:1"},
                         {"role": "prefill", "addr": "a:2"}]}
    assert warmup.backends(info) == (["a:1", "a:2"], ["b:1"])
    assert warmup.backends({"backends": [{"role": "replica", "addr": "r:1"}]}) == ([], ["r:1"])


def test_provenance_names_repository_files_relative_to_it():
    """A saved result names files of the repository (the default dataset) as paths from its root,
    not where this checkout happens to be; other values pass unchanged."""
    from common.tools.bench import report

    args = argparse.Namespace(dataset=data.DEFAULT_TEST, out="/elsewhere/out", num=32)
    options = report.provenance(args)["options"]
    assert options == {"dataset": os.path.join("common", "tools", "bench", "data", "gsm8k", "test.jsonl"),
                       "out": "/elsewhere/out", "num": 32}
