"""`pdflash bench serving`: time to first token (and TPOT, E2E) of the pd stack against the
colocated one, for prompts of an exact length (random token ids through /generate input_ids).

Each mode's stack is started with `pdflash up` (one after the other, never both at once), warmed
up, then sent `--num` streaming requests, `--concurrency` at a time. TTFT is measured at the
client: from sending the request to the first SSE event that carries a token. `--url` benches a
stack that is already running instead (its mode is read from /server_info).

`--interleave` starts both stacks (one after the other), then alternates rounds of `--concurrency`
requests between them, so that other load on a shared machine hits both modes alike.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field

import requests

from common.bench.stack import Stack

UP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 1800


@dataclass
class Sample:
    ttft: float
    e2e: float
    output_tokens: int
    transfer_bytes: int = 0

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class ModeResult:
    mode: str
    url: str
    vocab_size: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self, input_len: int) -> dict:
        ttft = sorted(s.ttft for s in self.samples)
        tpot = [s.tpot for s in self.samples if s.tpot is not None]
        out_tokens = sum(s.output_tokens for s in self.samples)
        return {
            "mode": self.mode, "requests": len(self.samples),
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95),
            "ttft_min_s": ttft[0], "ttft_max_s": ttft[-1],
            "tpot_mean_ms": 1000 * statistics.fmean(tpot) if tpot else None,
            "e2e_mean_s": statistics.fmean(s.e2e for s in self.samples),
            "input_tok_per_s": input_len * len(self.samples) / self.wall_s,
            "output_tok_per_s": out_tokens / self.wall_s,
            "transfer_bytes_per_request": self.samples[0].transfer_bytes,
        }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=2048, help="prompt tokens (random ids, exact length)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (EOS ignored)")
    p.add_argument("--num", type=int, default=8, help="timed requests per mode")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per mode first")
    p.add_argument("--modes", default="pd,colocated", help="stacks to start, in this order")
    p.add_argument("--url", default=None, help="bench this running stack instead of starting any")
    p.add_argument("--interleave", action="store_true",
                   help="run both stacks at once and alternate rounds between them (fairer on a busy machine)")
    p.add_argument("--port", type=int, default=30100, help="router port of the stacks it starts")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--up-args", default="", help="more `pdflash up` flags, e.g. \"--dtype bf16\"")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out/serving.json")


def run(args: argparse.Namespace) -> int:
    if min(args.input_len, args.output_len, args.num, args.concurrency) < 1 or args.warmup < 0:
        raise ValueError("--input-len, --output-len, --num and --concurrency must be at least 1")
    rng = random.Random(args.seed)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("pd", "colocated"):
            raise ValueError(f"unknown mode {mode!r} (pd or colocated)")
    results: list[ModeResult] = []
    if args.url:
        results.append(bench(args.url.rstrip("/"), _mode_of(args.url), args, rng))
    elif args.interleave:
        with contextlib.ExitStack() as stacks:
            urls = [stacks.enter_context(_stack(m, args, args.port + 10 * i)).url for i, m in enumerate(modes)]
            results = bench_interleaved(urls, modes, args, rng)
    else:
        for mode in modes:
            with _stack(mode, args, args.port) as stack:
                results.append(bench(stack.url, mode, args, rng))
    report = {
        "config": {k: getattr(args, k) for k in ("input_len", "output_len", "num", "concurrency", "warmup",
                                                  "page_size", "up_args", "url", "interleave")},
        "results": [r.summary(args.input_len) for r in results],
        "samples": {r.mode: [asdict(s) for s in r.samples] for r in results},
    }
    by_mode = {r["mode"]: r for r in report["results"]}
    if "pd" in by_mode and "colocated" in by_mode:
        report["pd_over_colocated_ttft_mean"] = by_mode["pd"]["ttft_mean_s"] / by_mode["colocated"]["ttft_mean_s"]
        report["pd_over_colocated_ttft_p50"] = by_mode["pd"]["ttft_p50_s"] / by_mode["colocated"]["ttft_p50_s"]
    print_table(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"saved {args.out}")
    return 0


def bench(url: str, mode: str, args: argparse.Namespace, rng: random.Random) -> ModeResult:
    result = ModeResult(mode, url, vocab_size=_vocab_size(url))
    warm_up(result, args, rng)
    timed_round(result, [_prompt(rng, args.input_len, result.vocab_size) for _ in range(args.num)], args)
    return result


def bench_interleaved(urls: list[str], modes: list[str], args: argparse.Namespace, rng: random.Random
                      ) -> list[ModeResult]:
    results = [ModeResult(mode, url, vocab_size=_vocab_size(url)) for mode, url in zip(modes, urls)]
    for result in results:
        warm_up(result, args, rng)
    left = args.num
    while left > 0:
        n = min(args.concurrency, left)
        for result in results:
            timed_round(result, [_prompt(rng, args.input_len, result.vocab_size) for _ in range(n)], args)
        left -= n
    return results


def warm_up(result: ModeResult, args: argparse.Namespace, rng: random.Random) -> None:
    # One at a time: round robin sends consecutive requests to different replicas.
    for _ in range(args.warmup):
        one_request(result.url, _prompt(rng, args.input_len, result.vocab_size), args.output_len)


def timed_round(result: ModeResult, prompts: list[list[int]], args: argparse.Namespace) -> None:
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        result.samples += pool.map(lambda ids: one_request(result.url, ids, args.output_len), prompts)
    result.wall_s += time.monotonic() - start


def _prompt(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(100, vocab_size) for _ in range(n)]


def _vocab_size(url: str) -> int:
    return requests.get(url + "/server_info", timeout=30).json()["vocab_size"]


def one_request(url: str, input_ids: list[int], output_len: int) -> Sample:
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
    start = time.monotonic()
    ttft, last = None, None
    with requests.post(url + "/generate", json=body, stream=True, timeout=REQUEST_TIMEOUT_S) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}/generate answered {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}/generate failed mid-stream: {event['error']['message']}")
            if ttft is None and event["output_ids"]:
                ttft = time.monotonic() - start
            last = event
    e2e = time.monotonic() - start
    if last is None or ttft is None:
        raise RuntimeError(f"{url}/generate returned no tokens")
    return Sample(ttft, e2e, len(last["output_ids"]), last["meta_info"].get("transfer_bytes", 0))


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"\nserving: {cfg['input_len']} input / {cfg['output_len']} output tokens, {cfg['num']} requests, "
          f"concurrency {cfg['concurrency']}")
    print("| mode | TTFT mean | TTFT p50 | TTFT p95 | TPOT mean | E2E mean | in tok/s | out tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in report["results"]:
        tpot = f"{r['tpot_mean_ms']:.1f} ms" if r["tpot_mean_ms"] is not None else "-"
        print(f"| {r['mode']} | {r['ttft_mean_s']:.3f} s | {r['ttft_p50_s']:.3f} s | {r['ttft_p95_s']:.3f} s | {tpot} | "
              f"{r['e2e_mean_s']:.2f} s | {r['input_tok_per_s']:.0f} | {r['output_tok_per_s']:.2f} |")
    if "pd_over_colocated_ttft_mean" in report:
        print(f"pd / colocated TTFT: {report['pd_over_colocated_ttft_mean']:.3f}x (mean), "
              f"{report['pd_over_colocated_ttft_p50']:.3f}x (p50); target <= 1.2x")


def _stack(mode: str, args: argparse.Namespace, port: int) -> Stack:
    """`pdflash up --mode MODE` for the length of a `with` block."""
    return Stack(["--mode", mode, "--port", str(port), "--page-size", str(args.page_size), *shlex.split(args.up_args)],
                 timeout=UP_TIMEOUT_S)


def _mode_of(url: str) -> str:
    policy = requests.get(url.rstrip("/") + "/server_info", timeout=30).json()["policy"]
    return "pd" if policy == "pd" else "colocated"


def _pct(sorted_values: list[float], pct: float) -> float:
    i = min(len(sorted_values) - 1, max(0, round(pct / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]
