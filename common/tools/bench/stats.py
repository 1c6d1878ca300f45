"""Numbers from recorded responses: latency percentiles, and the speculative-decoding figures
(both accept lengths, draft acceptance rate) with their invariants checked per request.

Everything here is a pure function of plain lists and meta_info dicts, so a fixed set of
recorded responses tests it (tests/test_bench_stats.py). Definitions: docs/BENCHMARKS.md.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

PERCENTILES = (50, 95, 99)
SPEC_FIELDS = ("spec_verify_ct", "spec_accept_histogram", "spec_accepted_drafts", "spec_proposed_drafts")


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, as SGLang's bench uses)."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * pct / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def describe(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """{"n", "mean", "p50", "p95", "p99", "min", "max"} of values * scale (None when empty)."""
    xs = [v * scale for v in values]
    out: dict[str, float | int | None] = {"n": len(xs), "mean": sum(xs) / len(xs) if xs else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(xs, p)
    out["min"], out["max"] = (min(xs), max(xs)) if xs else (None, None)
    return out


def has_spec(meta: dict[str, Any] | None) -> bool:
    return bool(meta) and bool(meta.get("spec_verify_ct"))


def check_invariants(meta: dict[str, Any]) -> list[str]:
    """What is wrong with one response's speculative counters ([] = all hold).

    hist[k] counts verify steps that accepted k drafts. Blocks: `spec_block_histogram[b]` counts
    verify steps with a block of b (engines that choose the block per step); without it every
    step used B = len(histogram).
    """
    verify = meta["spec_verify_ct"]
    hist = list(meta["spec_accept_histogram"])
    accepted, proposed = meta["spec_accepted_drafts"], meta["spec_proposed_drafts"]
    completion = meta["completion_tokens"]
    blocks = meta.get("spec_block_histogram")
    if not blocks:
        blocks = [0] * len(hist) + [verify]  # every step used B = len(hist)
    plain = meta.get("spec_plain_steps", 0)
    problems = []
    if sum(hist) != verify:
        problems.append(f"sum(histogram) = {sum(hist)} != verify_ct = {verify}")
    weighted_sum = sum(k * n for k, n in enumerate(hist))
    if weighted_sum != accepted:
        problems.append(f"sum(k * hist[k]) = {weighted_sum} != accepted_drafts = {accepted}")
    if sum(blocks) != verify:
        problems.append(f"sum(block histogram) = {sum(blocks)} != verify_ct = {verify}")
    want = sum((b - 1) * n for b, n in enumerate(blocks) if n)
    if proposed != want:
        problems.append(f"proposed_drafts = {proposed} != sum((B - 1) * steps with block B) = {want}")
    # Each verify step emits its accepted drafts plus one bonus token, a plain step one token;
    # the first token comes from prefill. More tokens means something decoded outside the steps.
    if completion > 1 + verify + accepted + plain:
        problems.append(f"completion_tokens = {completion} > 1 + verify_ct + accepted_drafts + plain_steps = "
                        f"{1 + verify + accepted + plain}")
    # The router's own accept lengths must agree with its counters (0 when nothing was verified).
    if not verify:
        return problems
    if "spec_accept_length" in meta and not math.isclose(meta["spec_accept_length"], completion / verify,
                                                         rel_tol=1e-9):
        problems.append(f"spec_accept_length = {meta['spec_accept_length']} != completion / verify_ct "
                        f"= {completion / verify}")
    if "spec_accept_length_weighted" in meta and not math.isclose(meta["spec_accept_length_weighted"],
                                                                  1 + accepted / verify, rel_tol=1e-9):
        problems.append(f"spec_accept_length_weighted = {meta['spec_accept_length_weighted']} != "
                        f"1 + accepted / verify_ct = {1 + accepted / verify}")
    return problems


def spec_summary(metas: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Speculative figures over the responses that carry them; None if none does (no --spec).

    accept_length_interface: mean over requests of completion_tokens / verify_ct (what SGLang
    reports; biased up by the prefill token and down by a truncated last step).
    accept_length_weighted: 1 + sum(accepted) / sum(verify) from the summed histograms (the truth).
    draft_acceptance_rate: sum(accepted) / sum(proposed), i.e. without the bonus token.
    """
    spec = [(i, m) for i, m in enumerate(metas) if has_spec(m)]
    if not spec:
        return None
    block = max(len(m["spec_accept_histogram"]) for _, m in spec)
    hist = [0] * block
    for _, m in spec:
        for k, n in enumerate(m["spec_accept_histogram"]):
            hist[k] += n
    verify = sum(m["spec_verify_ct"] for _, m in spec)
    accepted = sum(m["spec_accepted_drafts"] for _, m in spec)
    proposed = sum(m["spec_proposed_drafts"] for _, m in spec)
    completion = sum(m["completion_tokens"] for _, m in spec)
    violations = []
    for i, m in spec:
        problems = check_invariants(m)
        if problems:
            violations.append({"index": i, "id": m.get("id"), "problems": problems})
    return {
        "requests": len(spec),
        "requests_without_verify": sum(1 for m in metas if m is not None and not has_spec(m)),
        "block_size": block,
        "verify_steps": verify,
        "accepted_drafts": accepted,
        "proposed_drafts": proposed,
        "completion_tokens": completion,
        "histogram": hist,
        "accept_length_interface": sum(m["completion_tokens"] / m["spec_verify_ct"] for _, m in spec) / len(spec),
        "accept_length_interface_pooled": completion / verify,
        "accept_length_weighted": 1 + accepted / verify,
        "draft_acceptance_rate": accepted / proposed if proposed else None,
        "invariants": {"checked": len(spec), "ok": len(spec) - len(violations), "violations": violations},
    }


def invariants_line(spec: dict[str, Any] | None) -> str:
    """One line saying whether the histogram invariants held for every request."""
    if spec is None:
        return "no speculative counters in the responses (stack without --spec): invariants not checked"
    inv = spec["invariants"]
    if not inv["violations"]:
        return (f"histogram invariants hold for all {inv['checked']} requests: sum(hist) = verify_ct, "
                "sum(k*hist[k]) = accepted, proposed = sum((B-1) * steps of block B), "
                "tokens <= 1 + verify + accepted + plain steps")
    first = inv["violations"][0]
    return (f"INVARIANTS VIOLATED in {len(inv['violations'])} of {inv['checked']} requests; first: request "
            f"{first['index']}: {'; '.join(first['problems'])}")
