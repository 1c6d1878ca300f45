"""`pdflash bench serving`: streaming latency and throughput of a running stack.

`--num` requests, `--concurrency` in flight at a time, through the router's `POST /generate`
with `stream: true` and `ignore_eos`, so each decodes exactly `--output-len` tokens. Inputs are
random token ids of exactly `--input-len` tokens, or the prompts of a JSONL file (`--dataset`).
Every replica is warmed first (`--warmup`, on by default; see warmup.py). Writes to `--out`:
requests.jsonl (one line per request), summary.json, summary.md and latency.png (TTFT and TPOT
distributions). Metric definitions: docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from typing import Any

from common.tools.bench import plot, report, rounds, stats, warmup
from common.tools.bench.client import REQUEST_TIMEOUT_S, Response, get_json, random_ids, run_requests, server_facts

WARMUP_OUTPUT_LEN = 8


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the router")
    p.add_argument("--input-len", type=int, default=16384, help="prompt tokens (random dataset: exact)")
    p.add_argument("--output-len", type=int, default=512, help="tokens generated per request (EOS ignored)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--num", type=int, default=40, help="timed requests")
    p.add_argument("--dataset", default="random",
                   help="'random' (token ids of exactly --input-len) or a JSONL file with one prompt per line: "
                        "{\"prompt\": str} or {\"input_ids\": [int]}, optionally \"output_len\"; cycled to --num")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one untimed request to every replica (prefill and decode instance) first")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="random prompts")
    p.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT_S, help="seconds per request")
    p.add_argument("--out", default=os.path.join("bench-out", "serving"), help="output folder")


def run(args: argparse.Namespace) -> int:
    try:
        summary = bench(args.url, args, args.out)
    except RuntimeError as e:  # the stack failed the warm-up or the prompt measurement
        print(f"pdflash bench serving: error: {e}", file=sys.stderr)
        return 1
    print(markdown(summary))
    print(f"saved {args.out}/: requests.jsonl summary.json summary.md latency.png")
    violated = summary["spec"] and summary["spec"]["invariants"]["violations"]
    return 1 if summary["failures"] or violated else 0


def bench(url: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    """Run the benchmark against `url`, write the files to `out`, return the summary."""
    return rounds.complete(Run(url, args, out))


class Run:
    """One stack's benchmark in rounds: the stack is warmed at creation; round(i) sends the i-th
    share of the requests; finish() summarises and writes the files. With `interleaved`, a round
    is `--concurrency` requests, so `bench ab --interleave` can alternate rounds between stacks;
    otherwise one round sends them all."""

    def __init__(self, url: str, args: argparse.Namespace, out: str, interleaved: bool = False):
        if min(args.input_len, args.output_len, args.concurrency, args.num) < 1:
            raise ValueError("--input-len, --output-len, --concurrency and --num must be at least 1")
        self.url, self.args, self.out = url.rstrip("/"), args, out
        self.info = get_json(self.url, "/server_info")
        self.bodies = make_bodies(args, self.info["vocab_size"])
        self.warm = None
        if args.warmup:
            self.warm = warmup.warm_up(self.url, random_ids(random.Random(args.seed + 1),
                                                            _warmup_len(args, self.bodies, self.url),
                                                            self.info["vocab_size"]), WARMUP_OUTPUT_LEN)
        size = args.concurrency if interleaved else len(self.bodies)
        self.chunks = [range(i, min(i + size, len(self.bodies))) for i in range(0, len(self.bodies), size)]
        self.results: list[Response] = []
        self.duration = 0.0

    @property
    def rounds(self) -> int:
        return len(self.chunks)

    def round(self, i: int) -> None:
        chunk = self.chunks[i]
        results, duration = run_requests(self.url, [self.bodies[j] for j in chunk], self.args.concurrency,
                                         f"serving c={self.args.concurrency}", self.args.timeout)
        for r in results:
            r.index += chunk.start
        self.results += results
        self.duration += duration

    def finish(self) -> dict[str, Any]:
        results, out = self.results, self.out
        summary = summarize(results, self.duration, self.bodies, self.args)
        summary.update(server=server_facts(self.info), warmup=self.warm, provenance=report.provenance(self.args))
        os.makedirs(out, exist_ok=True)
        report.write_jsonl(os.path.join(out, "requests.jsonl"), [request_row(r) for r in results])
        report.write_json(os.path.join(out, "summary.json"), summary)
        report.write_text(os.path.join(out, "summary.md"), markdown(summary))
        plot.latency_png(os.path.join(out, "latency.png"), [r.ttft for r in results if r.ok and r.ttft is not None],
                         [1000 * r.tpot for r in results if r.ok and r.tpot is not None], title(summary))
        return summary


def make_bodies(args: argparse.Namespace, vocab_size: int) -> list[dict[str, Any]]:
    def body(prompt: dict[str, Any], output_len: int) -> dict[str, Any]:
        return prompt | {"stream": True, "sampling_params": {
            "max_new_tokens": output_len, "temperature": args.temperature, "ignore_eos": True}}

    if args.dataset == "random":
        rng = random.Random(args.seed)
        return [body({"input_ids": random_ids(rng, args.input_len, vocab_size)}, args.output_len)
                for _ in range(args.num)]
    rows = load_prompts(args.dataset)
    return [body(*_prompt_of(rows[i % len(rows)], args.output_len)) for i in range(args.num)]


def load_prompts(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset {path!r} not found (pass 'random' or a JSONL file)")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"dataset {path!r} has no prompts")
    return rows


def _prompt_of(row: dict[str, Any], default_output_len: int) -> tuple[dict[str, Any], int]:
    output_len = int(row.get("output_len", default_output_len))
    if "input_ids" in row:
        return {"input_ids": list(row["input_ids"])}, output_len
    text = row.get("prompt", row.get("text"))
    if not isinstance(text, str):
        raise ValueError(f"a dataset line has neither 'prompt' (a string) nor 'input_ids': {str(row)[:200]}")
    return {"text": text}, output_len


def _warmup_len(args: argparse.Namespace, bodies: list[dict[str, Any]], url: str) -> int:
    """The warm-up prompt length: the timed prompts' (random: exact; file: the first one's)."""
    if "input_ids" in bodies[0]:
        return len(bodies[0]["input_ids"])
    first = dict(bodies[0], stream=False)
    first["sampling_params"] = dict(first["sampling_params"], max_new_tokens=1)
    [r], _ = run_requests(url, [first], 1, "measure prompt", args.timeout)
    if not r.ok:
        raise RuntimeError(f"the first dataset prompt failed: {r.error}")
    return r.prompt_tokens


def summarize(results: list[Response], duration: float, bodies: list[dict[str, Any]],
              args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    in_tokens = sum(r.prompt_tokens for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    wanted = [b["sampling_params"]["max_new_tokens"] for b in bodies]
    mismatched = [r.index for r in ok if r.output_tokens != wanted[r.index]
                  or ("input_ids" in bodies[r.index] and r.prompt_tokens != len(bodies[r.index]["input_ids"]))]
    return {
        "bench": "serving",
        "config": {k: getattr(args, k) for k in ("input_len", "output_len", "concurrency", "num", "dataset",
                                                  "temperature", "seed", "warmup")},
        "requests_planned": len(results), "requests_ok": len(ok), "failures": len(results) - len(ok),
        "errors": [{"error": e, "count": n} for e, n in errors.items()],
        "length_mismatches": mismatched,  # requests whose prompt or output length was not the one asked
        "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "input_tok_s": in_tokens / duration, "output_tok_s": out_tokens / duration,
        "total_tok_s": (in_tokens + out_tokens) / duration,
        "request_throughput": len(ok) / duration,
        "concurrency_achieved": sum(r.e2e for r in ok) / duration,
        "transfer_bytes_per_request": sum(r.meta.get("transfer_bytes", 0) for r in ok) / len(ok) if ok else None,
        # pd: how many rooms' KV came by each transport ("local" on one host, "mooncake")
        "transfer_transports": dict(Counter(r.meta["transfer_transport"] for r in ok if r.meta.get("transfer_transport"))),
        "ttft_s": stats.describe(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": stats.describe((r.tpot for r in ok if r.tpot is not None), 1000),
        "itl_ms": stats.describe((gap for r in ok for gap in r.itl), 1000),
        "e2e_s": stats.describe(r.e2e for r in ok),
        "spec": stats.spec_summary([r.meta for r in ok]),
    }


def request_row(r: Response) -> dict[str, Any]:
    return {"index": r.index, "ok": r.ok, "error": r.error, "sent_at_s": r.sent_at,
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens if r.ok else None,
            "ttft_s": r.ttft, "tpot_ms": 1000 * r.tpot if r.tpot is not None else None, "e2e_s": r.e2e,
            "itl_ms": [1000 * g for g in r.itl], "tokens_per_event": r.token_counts,
            "finish_reason": r.finish_reason, "meta_info": r.meta}


def title(s: dict[str, Any]) -> str:
    c = s["config"]
    return (f"{s['server']['policy']} ({len(s['server']['backends'])} backends): {c['dataset']} "
            f"{c['input_len']} -> {c['output_len']}, concurrency {c['concurrency']}, {s['requests_ok']}/"
            f"{s['requests_planned']} ok")


def markdown(s: dict[str, Any]) -> str:
    f = report.fmt
    t, p, e = s["ttft_s"], s["tpot_ms"], s["e2e_s"]
    text = f"## serving: {title(s)}\n\n" + report.md_table(
        ["in tok/s", "out tok/s", "TTFT mean / p95", "TPOT mean / p95", "E2E mean", "duration", "failures"],
        [[f(s["input_tok_s"]), f(s["output_tok_s"]), f"{f(t['mean'], 3)} s / {f(t['p95'], 3)} s",
          f"{f(p['mean'])} ms / {f(p['p95'])} ms", f"{f(e['mean'])} s", f"{f(s['duration_s'])} s",
          str(s["failures"])]], align=["r"] * 7)
    rows = [[name, *(f(d[k], 3) for k in ("mean", "p50", "p95", "p99", "min", "max"))]
            for name, d in (("TTFT (s)", t), ("TPOT (ms)", p), ("ITL (ms)", s["itl_ms"]), ("E2E (s)", e))]
    text += "\n" + report.md_table(["metric", "mean", "p50", "p95", "p99", "min", "max"], rows)
    spec = s["spec"]
    if spec:
        text += (f"\naccept length: weighted {f(spec['accept_length_weighted'])}, interface "
                 f"{f(spec['accept_length_interface'])}; draft acceptance "
                 f"{f(100 * spec['draft_acceptance_rate'], 1) if spec['draft_acceptance_rate'] is not None else '-'}% "
                 f"(without the bonus token)\n{stats.invariants_line(spec)}\n")
    for err in s["errors"]:
        text += f"\nfailed x{err['count']}: {err['error']}"
    if s["length_mismatches"]:
        text += f"\nWARNING: {len(s['length_mismatches'])} requests had another prompt or output length than asked"
    return text + "\n"
