"""The summary fields issue 6 asks of each benchmark (shared by the unit and the stack tests)."""
from __future__ import annotations

PERCENTILE_KEYS = ("mean", "p50", "p95", "p99")
SERVING_DISTRIBUTIONS = ("ttft_s", "tpot_ms", "itl_ms", "e2e_s")
SERVING_FIELDS = ("requests_planned", "requests_ok", "failures", "errors", "duration_s", "total_input_tokens",
                  "total_output_tokens", "input_tok_s", "output_tok_s", "request_throughput", "spec", "config",
                  *SERVING_DISTRIBUTIONS)
GSM8K_RUN_FIELDS = ("concurrency", "requests_ok", "requests_planned", "correct", "correct_excluding_overlap",
                    "requests_excluding_overlap", "hit_output_cap", "wall_s", "output_tokens", "output_tok_s",
                    "accept_length_interface", "accept_length_weighted", "draft_acceptance_rate", "verify_steps",
                    "accepted_drafts", "proposed_drafts", "invariants_ok", "spec", "failures")
SPEC_FIELDS = ("requests", "verify_steps", "accepted_drafts", "proposed_drafts", "histogram", "block_size",
               "accept_length_interface", "accept_length_weighted", "draft_acceptance_rate", "invariants")


def assert_serving_summary(s: dict) -> None:
    missing = [k for k in SERVING_FIELDS if k not in s]
    assert not missing, f"serving summary lacks {missing}"
    for name in SERVING_DISTRIBUTIONS:
        for key in PERCENTILE_KEYS:
            assert s[name][key] is not None, f"{name}.{key} is None"
    if s["spec"] is not None:
        assert_spec(s["spec"])


def assert_gsm8k_run(r: dict, spec: bool) -> None:
    missing = [k for k in GSM8K_RUN_FIELDS if k not in r]
    assert not missing, f"gsm8k run lacks {missing}"
    if spec:
        assert_spec(r["spec"])
        for k in ("accept_length_interface", "accept_length_weighted", "draft_acceptance_rate", "verify_steps"):
            assert r[k] is not None, k
        assert r["invariants_ok"] is True, r["spec"]["invariants"]


def assert_spec(spec: dict) -> None:
    missing = [k for k in SPEC_FIELDS if k not in spec]
    assert not missing, f"spec summary lacks {missing}"
