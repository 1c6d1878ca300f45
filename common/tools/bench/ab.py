"""`pdflash bench ab`: the same benchmark against several stacks, one after another, compared.

    pdflash bench ab --stack "colocated=--mode colocated --replicas 2" --stack "pd=--mode pd" \\
        --stack "pd+dflash=--mode pd --spec dflash" serving --input-len 2048 --output-len 128

Each `--stack LABEL=ARGS` is started with `pdflash up ARGS` (on a free port unless ARGS has
--port), benchmarked, and stopped before the next starts; ARGS may instead be the URL of a
stack that is already running. `--interleave` starts every stack first and then alternates
rounds between them (serving: `--concurrency` requests; gsm8k: one concurrency level), so that
load from elsewhere on a shared machine hits every stack alike. The first stack is the baseline: the table gives every other
stack's relative change per metric and whether that is better or worse. Writes to `--out`:
one folder per stack (that benchmark's files and the stack's log), ab.json and ab.md.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
from typing import Any

from common.tools.bench import gsm8k, report, serving
from common.tools.bench.stack import UP_TIMEOUT_S, Stack

BENCHES = {"serving": serving, "gsm8k": gsm8k}

# (key path in the summary, label, which way is better)
SERVING_METRICS = [
    ("input_tok_s", "input tok/s", "higher"), ("output_tok_s", "output tok/s", "higher"),
    ("ttft_s.mean", "TTFT mean (s)", "lower"), ("ttft_s.p50", "TTFT p50 (s)", "lower"),
    ("ttft_s.p95", "TTFT p95 (s)", "lower"), ("ttft_s.p99", "TTFT p99 (s)", "lower"),
    ("tpot_ms.mean", "TPOT mean (ms)", "lower"), ("tpot_ms.p95", "TPOT p95 (ms)", "lower"),
    ("itl_ms.mean", "ITL mean (ms)", "lower"), ("itl_ms.p95", "ITL p95 (ms)", "lower"),
    ("e2e_s.mean", "E2E mean (s)", "lower"), ("e2e_s.p95", "E2E p95 (s)", "lower"),
    ("duration_s", "duration (s)", "lower"), ("failures", "failures", "lower"),
    ("spec.accept_length_weighted", "accept length (weighted)", "higher"),
    ("spec.accept_length_interface", "accept length (interface)", "higher"),
    ("spec.draft_acceptance_rate", "draft acceptance (no bonus)", "higher"),
]
GSM8K_METRICS = [
    ("correct", "correct", "higher"), ("output_tok_s", "output tok/s", "higher"), ("wall_s", "wall (s)", "lower"),
    ("latency_s.mean", "latency mean (s)", "lower"), ("hit_output_cap", "hit output cap", "lower"),
    ("failures", "failures", "lower"), ("accept_length_weighted", "accept length (weighted)", "higher"),
    ("accept_length_interface", "accept length (interface)", "higher"),
    ("draft_acceptance_rate", "draft acceptance (no bonus)", "higher"),
]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stack", action="append", required=True, metavar="LABEL=ARGS",
                   help="`pdflash up` arguments (or the URL of a running stack), labelled; give it twice or more; "
                        "the first is the baseline")
    p.add_argument("--startup-timeout", type=float, default=UP_TIMEOUT_S, help="seconds for each stack to come up")
    p.add_argument("--interleave", action="store_true",
                   help="run every stack at once and alternate rounds between them (fairer on a busy machine)")
    sub = p.add_subparsers(dest="ab_bench", required=True, metavar="{serving,gsm8k}",
                           help="the benchmark to run on every stack, with its own options (--url is ignored)")
    for name, mod in BENCHES.items():
        sp = sub.add_parser(name, help=f"pdflash bench {name} on every stack")
        mod.add_args(sp)
        sp.set_defaults(out=os.path.join("bench-out", "ab"))


def parse_stack(text: str) -> tuple[str, str]:
    label, sep, spec = text.partition("=")
    if not sep or not label.strip():
        raise ValueError(f"--stack {text!r}: expected LABEL=ARGS, e.g. \"pd=--mode pd\"")
    return label.strip(), spec.strip()


def run(args: argparse.Namespace) -> int:
    stacks = [parse_stack(s) for s in args.stack]
    if len(stacks) < 2:
        raise ValueError("give --stack at least twice: there is nothing to compare with one")
    if len({label for label, _ in stacks}) != len(stacks):
        raise ValueError("--stack labels must differ")
    mod = BENCHES[args.ab_bench]
    arms = [{"label": label, "stack": spec, "out": os.path.join(args.out, _slug(label)), "summary": None,
             "error": None} for label, spec in stacks]
    if args.interleave:
        run_interleaved(mod, arms, args)
    else:
        for arm in arms:
            with _failure_recorded(arm), _stack_of(arm, args) as url:
                arm["summary"] = mod.bench(url, args, arm["out"])
    table = compare(arms, args.ab_bench)
    result = {"bench": "ab", "of": args.ab_bench, "interleaved": args.interleave, "baseline": arms[0]["label"],
              "arms": arms, "table": table,
              "provenance": report.provenance(args)}
    text = markdown(result)
    report.write_json(os.path.join(args.out, "ab.json"), result)
    report.write_text(os.path.join(args.out, "ab.md"), text)
    print(text)
    print(f"saved {args.out}/ab.json, ab.md and one folder per stack")
    return 1 if any(a["error"] for a in arms) else 0


def run_interleaved(mod: Any, arms: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Every stack up (one after the other) and warmed, then round i of each in turn."""
    with contextlib.ExitStack() as up:
        runs = {}
        for i, arm in enumerate(arms):
            with _failure_recorded(arm):
                url = up.enter_context(_stack_of(arm, args))
                runs[i] = mod.Run(url, args, arm["out"], interleaved=True)
        for r in range(max((run.rounds for run in runs.values()), default=0)):
            for i, run in list(runs.items()):
                with _failure_recorded(arms[i]):
                    if r < run.rounds:
                        run.round(r)
                if arms[i]["error"]:
                    del runs[i]
        for i, run in runs.items():
            arms[i]["summary"], arms[i]["rounds"] = run.finish(), run.rounds


@contextlib.contextmanager
def _stack_of(arm: dict[str, Any], args: argparse.Namespace):
    """The arm's URL: the running stack it names, or one `pdflash up` started for the block."""
    if arm["stack"].startswith(("http://", "https://")):
        yield arm["stack"]
        return
    with Stack(arm["stack"], os.path.join(arm["out"], "stack.log"), args.startup_timeout) as stack:
        arm["startup_s"] = stack.startup_s
        yield stack.url


@contextlib.contextmanager
def _failure_recorded(arm: dict[str, Any]):
    """A stack that does not come up or breaks: record why and go on comparing the others."""
    try:
        yield
    except RuntimeError as e:
        arm["error"] = str(e)
        print(f"{arm['label']}: FAILED: {e}", flush=True)


def metrics_of(bench: str, summary: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    if bench == "serving":
        return SERVING_METRICS
    runs = summary["runs"] if summary else []
    return [(f"runs.{i}.{key}", f"C{r['concurrency']} {label}", better)
            for i, r in enumerate(runs) for key, label, better in GSM8K_METRICS]


def lookup(summary: dict[str, Any] | None, path: str) -> Any:
    node: Any = summary
    for part in path.split("."):
        if node is None:
            return None
        node = node[int(part)] if isinstance(node, list) else node.get(part)
    return node


def relative_change(value: float | None, base: float | None) -> float | None:
    if value is None or base is None:
        return None
    if value == base:
        return 0.0
    return (value - base) / abs(base) if base else None


def compare(arms: list[dict[str, Any]], bench: str) -> list[dict[str, Any]]:
    """One row per metric: each arm's value and its change relative to the first arm."""
    base = arms[0]["summary"]
    rows = []
    for key, label, better in metrics_of(bench, base or next((a["summary"] for a in arms if a["summary"]), None)):
        values = [lookup(a["summary"], key) for a in arms]
        if all(v is None for v in values):
            continue
        changes = [relative_change(v, values[0]) for v in values]
        verdicts = [None if c is None or abs(c) < 5e-4 else
                    ("better" if (c > 0) == (better == "higher") else "worse") for c in changes]
        rows.append({"metric": label, "key": key, "better": better, "values": values, "change": changes,
                     "verdict": verdicts})
    return rows


def markdown(result: dict[str, Any]) -> str:
    arms = result["arms"]
    headers = ["metric", arms[0]["label"]]
    for a in arms[1:]:
        headers += [a["label"], f"vs {arms[0]['label']}"]
    rows = []
    for row in result["table"]:
        cells = [row["metric"], report.fmt(row["values"][0], 3)]
        for v, c, verdict in list(zip(row["values"], row["change"], row["verdict"]))[1:]:
            cells += [report.fmt(v, 3), "-" if c is None else f"{100 * c:+.1f}%" + (f" ({verdict})" if verdict else "")]
        rows.append(cells)
    text = f"## A/B: pdflash bench {result['of']}, baseline {arms[0]['label']}\n\n"
    text += "".join(f"- **{a['label']}**: `{a['stack']}`" + (f" FAILED: {a['error'].splitlines()[0]}" if a["error"]
                                                             else "") + "\n" for a in arms)
    if result["of"] == "serving":
        text += "\n" + overview(arms)
    return text + "\n" + report.md_table(headers, rows)


def overview(arms: list[dict[str, Any]]) -> str:
    """One row per stack, the columns of the users' A/B report."""
    f = report.fmt
    rows = []
    for a in arms:
        s = a["summary"]
        if s is None:
            rows.append([a["label"]] + ["-"] * 7)
            continue
        t, p, spec = s["ttft_s"], s["tpot_ms"], s["spec"]
        rows.append([a["label"], f(s["input_tok_s"]), f(s["output_tok_s"]), f"{f(t['mean'])} s / {f(t['p95'])} s",
                     f"{f(p['mean'])} ms / {f(p['p95'])} ms", f"{f(s['e2e_s']['mean'])} s",
                     f(spec["accept_length_weighted"]) if spec else "-", str(s["failures"])])
    return report.md_table(["stack", "in tok/s", "out tok/s", "TTFT mean / p95", "TPOT mean / p95", "E2E mean",
                            "accept length (weighted)", "failures"], rows)


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", label).strip("_") or "stack"
