"""`pdflash bench gsm8k`: few-shot GSM8K through a running stack, at each concurrency in turn.

Non-streaming `POST /generate` (text prompts, greedy by default). Few-shot exemplars come from
the train split (`--shots-from train`); `--shots-from test` reproduces the users' old client,
which took the test file's first questions (those then overlap with the questions asked, and the
summary also counts correct answers without them). The answer is the number after '####',
else the last number of the output, compared numerically with the label. Every response's
accept histogram is checked against its counters (stats.check_invariants).

Writes to `--out`: gsm8k_c{C}.jsonl per concurrency (question, label, output, parsed answer,
correct, finish reason, raw meta_info), summary.json, summary.md, and accept_hist_c{C}.png when
the stack speculates.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Any

from common.tools.bench import gsm8k_data as data
from common.tools.bench import plot, report, rounds, stats, warmup
from common.tools.bench.client import REQUEST_TIMEOUT_S, Response, get_json, random_ids, run_requests, server_facts


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the router")
    p.add_argument("--num", type=int, default=64, help="questions (from --offset of the test split)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--shots", type=int, default=5, help="few-shot exemplars")
    p.add_argument("--shots-from", choices=["train", "test"], default="train",
                   help="train: the first --shots of --train; test: the first --shots of --dataset (the old "
                        "client's choice; overlapping questions are then also reported apart)")
    p.add_argument("--concurrency", default="1,8", help="comma-separated; each runs in turn")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dataset", default=data.DEFAULT_TEST, help="GSM8K test JSONL (question, answer)")
    p.add_argument("--train", default=data.DEFAULT_TRAIN, help="GSM8K train JSONL, for the exemplars")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one untimed request to every replica first")
    p.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT_S, help="seconds per request")
    p.add_argument("--out", default=os.path.join("bench-out", "gsm8k"), help="output folder")


def run(args: argparse.Namespace) -> int:
    try:
        summary = bench(args.url, args, args.out)
    except RuntimeError as e:  # the stack failed the warm-up
        print(f"pdflash bench gsm8k: error: {e}", file=sys.stderr)
        return 1
    print(markdown(summary))
    print(f"saved {args.out}/")
    bad = any(r["failures"] or r["invariants_ok"] is False for r in summary["runs"])
    return 1 if bad else 0


def concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError("--concurrency values must be at least 1")
    return values


def bench(url: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    return rounds.complete(Run(url, args, out))


class Run:
    """One stack's benchmark in rounds, one per concurrency level (so that `bench ab --interleave`
    can alternate levels between stacks); the stack is warmed at creation."""

    def __init__(self, url: str, args: argparse.Namespace, out: str, interleaved: bool = False):
        self.levels = concurrencies(args.concurrency)
        if min(args.num, args.max_new_tokens) < 1 or min(args.shots, args.offset) < 0:
            raise ValueError("--num and --max-new-tokens must be at least 1, --shots and --offset at least 0")
        self.url, self.args, self.out = url.rstrip("/"), args, out
        test = data.load(args.dataset)
        self.items = test[args.offset:args.offset + args.num]
        if not self.items:
            raise ValueError(f"no questions at --offset {args.offset} in {args.dataset}")
        shots = (test if args.shots_from == "test" else data.load(args.train))[:args.shots]
        if len(shots) < args.shots:
            raise ValueError(f"--shots {args.shots}: only {len(shots)} exemplars in "
                             f"{args.dataset if args.shots_from == 'test' else args.train}")
        shot_questions = {s.question for s in shots}
        self.overlap = [it.question in shot_questions for it in self.items]
        prompts = [data.few_shot_prompt(shots, it) for it in self.items]
        self.bodies = [{"text": p, "sampling_params": {"max_new_tokens": args.max_new_tokens,
                                                       "temperature": args.temperature, "stop": data.STOP}}
                       for p in prompts]
        info = get_json(self.url, "/server_info")
        warm = (warmup.warm_up(self.url, random_ids(random.Random(0), 256, info["vocab_size"]), 8)
                if args.warmup else None)
        self.summary = {"bench": "gsm8k", "server": server_facts(info), "warmup": warm,
                        "config": {k: getattr(args, k) for k in ("num", "offset", "shots", "shots_from",
                                                                  "concurrency", "max_new_tokens", "temperature",
                                                                  "dataset", "train")},
                        "overlap_questions": sum(self.overlap), "runs": [], "provenance": report.provenance(args)}
        self.first_outputs: list[str] | None = None

    @property
    def rounds(self) -> int:
        return len(self.levels)

    def round(self, i: int) -> None:
        c, out = self.levels[i], self.out
        results, wall = run_requests(self.url, self.bodies, c, f"gsm8k c={c}", self.args.timeout)
        rows = [record(it, r, ov) for it, r, ov in zip(self.items, results, self.overlap)]
        run_summary = summarize(c, rows, results, wall)
        if self.first_outputs is None:
            self.first_outputs = [r.text for r in results]
        run_summary["same_output_as_first_run"] = sum(r.ok and r.text == t for r, t in zip(results, self.first_outputs))
        self.summary["runs"].append(run_summary)
        report.write_jsonl(os.path.join(out, f"gsm8k_c{c}.jsonl"), rows)
        if run_summary["spec"]:
            plot.accept_histogram_png(os.path.join(out, f"accept_hist_c{c}.png"), run_summary["spec"]["histogram"],
                                      f"GSM8K accept histogram, concurrency {c}, "
                                      f"weighted accept length {run_summary['accept_length_weighted']:.2f}")
        print(stats.invariants_line(run_summary["spec"]), flush=True)

    def finish(self) -> dict[str, Any]:
        report.write_json(os.path.join(self.out, "summary.json"), self.summary)
        report.write_text(os.path.join(self.out, "summary.md"), markdown(self.summary))
        return self.summary


def record(item: data.Item, r: Response, overlap: bool) -> dict[str, Any]:
    value, how = data.parse_answer(r.text) if r.ok else (None, None)
    return {"index": r.index, "question": item.question, "label": item.label, "output": r.text,
            "parsed": value, "parsed_by": how, "correct": r.ok and data.is_correct(value, item.label),
            "few_shot_overlap": overlap, "finish_reason": r.finish_reason, "latency_s": r.e2e,
            "error": r.error, "meta_info": r.meta}


def summarize(concurrency: int, rows: list[dict[str, Any]], results: list[Response], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    spec = stats.spec_summary([r.meta for r in ok])
    out_tokens = sum(r.output_tokens for r in ok)
    clean = [row for row in rows if not row["few_shot_overlap"]]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "concurrency": concurrency,
        "requests_planned": len(rows), "requests_ok": len(ok), "failures": len(rows) - len(ok),
        "errors": [{"error": e, "count": n} for e, n in errors.items()],
        "correct": sum(row["correct"] for row in rows),
        "accuracy": sum(row["correct"] for row in rows) / len(rows),
        "requests_excluding_overlap": len(clean),
        "correct_excluding_overlap": sum(row["correct"] for row in clean),
        "hit_output_cap": sum(r.finish_reason == "length" for r in ok),
        "parsed_by": {how: sum(row["parsed_by"] == how for row in rows) for how in ("####", "last number", None)},
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "latency_s": stats.describe(r.e2e for r in ok),
        "accept_length_interface": spec["accept_length_interface"] if spec else None,
        "accept_length_weighted": spec["accept_length_weighted"] if spec else None,
        "draft_acceptance_rate": spec["draft_acceptance_rate"] if spec else None,
        "verify_steps": spec["verify_steps"] if spec else None,
        "accepted_drafts": spec["accepted_drafts"] if spec else None,
        "proposed_drafts": spec["proposed_drafts"] if spec else None,
        "invariants_ok": (not spec["invariants"]["violations"]) if spec else None,
        "spec": spec,
    }


TABLE = ["concurrency", "ok / planned", "correct", "correct excl. few-shot overlap", "hit output cap", "wall (s)",
         "output tokens", "output tok/s", "accept length (interface)", "accept length (weighted)",
         "draft acceptance (no bonus)", "verify steps", "accepted / proposed drafts"]


def markdown(s: dict[str, Any]) -> str:
    f = report.fmt
    rows = []
    for r in s["runs"]:
        rate = r["draft_acceptance_rate"]
        rows.append([f"C{r['concurrency']}", f"{r['requests_ok']} / {r['requests_planned']}",
                     f"{r['correct']} / {r['requests_planned']}",
                     f"{r['correct_excluding_overlap']} / {r['requests_excluding_overlap']}",
                     str(r["hit_output_cap"]), f(r["wall_s"]), str(r["output_tokens"]), f(r["output_tok_s"]),
                     f(r["accept_length_interface"]), f(r["accept_length_weighted"]),
                     f(100 * rate, 1, "%") if rate is not None else "-", f(r["verify_steps"]),
                     f"{f(r['accepted_drafts'])} / {f(r['proposed_drafts'])}"])
    c = s["config"]
    head = (f"## GSM8K: {len(s['runs']) and s['runs'][0]['requests_planned']} questions, {c['shots']}-shot from "
            f"{c['shots_from']} ({s['overlap_questions']} overlap the questions), T={c['temperature']}, "
            f"output cap {c['max_new_tokens']}, {s['server']['policy']} with {len(s['server']['backends'])} backends\n\n")
    # Transposed: one row per metric, one column per concurrency (the users' layout).
    cols = [[TABLE[i]] + [row[i] for row in rows] for i in range(1, len(TABLE))]
    text = head + report.md_table(["metric"] + [row[0] for row in rows], cols)
    for r in s["runs"]:
        text += f"\nC{r['concurrency']}: {stats.invariants_line(r['spec'])}"
        for err in r["errors"]:
            text += f"\nC{r['concurrency']}: failed x{err['count']}: {err['error']}"
    return text + "\n"
