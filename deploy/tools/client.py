"""A small HTTP client for deploy/pd.sh, standard library only: smoke request, warm-up, and a
serving benchmark (used when `pdflash bench serving` is not available).

    client.py smoke --url URL [--prompt P] [--max-new-tokens N] [--expect SUBSTRING]
    client.py warm  --url URL --num N
    client.py bench --url URL --input-len L --output-len O --concurrency C --num N [--seed S]

Each prints one JSON object on stdout and exits 0 on success, 1 on a failed request, 2 on bad
arguments. The benchmark streams `POST /generate` with random token ids of the exact input
length and `ignore_eos`, so every request decodes exactly --output-len tokens.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


class RequestFailed(Exception):
    pass


def post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise RequestFailed(f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RequestFailed(f"{type(e).__name__}: {e}") from None


def generate(url: str, prompt, max_new_tokens: int, timeout: float, ignore_eos: bool = False) -> dict:
    """Non-streaming /generate; returns the response JSON plus the client-side latency."""
    key = "text" if isinstance(prompt, str) else "input_ids"
    body = {key: prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                             "ignore_eos": ignore_eos}}
    start = time.perf_counter()
    with post(f"{url}/generate", body, timeout) as r:
        out = json.loads(r.read())
    out["client_latency_s"] = time.perf_counter() - start
    return out


def stream(url: str, input_ids: list[int], output_len: int, timeout: float) -> dict:
    """One streamed request: TTFT, per-token gaps, E2E. Events carry cumulative output_ids."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}
    start = time.perf_counter()
    first, last, tokens, meta = None, start, 0, {}
    with post(f"{url}/generate", body, timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RequestFailed(f"stream error: {event['error'].get('message')}")
            n = len(event.get("output_ids", []))
            if n > tokens:
                now = time.perf_counter()
                first = first or now
                last, tokens = now, n
            meta = event.get("meta_info", meta)
    if not tokens:
        raise RequestFailed("the stream ended without a token")
    e2e = last - start
    return {"ttft_s": first - start, "e2e_s": e2e, "output_tokens": tokens,
            "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else 0.0,
            "prompt_tokens": meta.get("prompt_tokens", len(input_ids))}


def summarize(values: list[float]) -> dict:
    if not values:
        return {}
    xs = sorted(values)

    def pct(p: float) -> float:
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    return {"mean": statistics.fmean(xs), "p50": pct(50), "p95": pct(95), "p99": pct(99), "max": xs[-1]}


def cmd_smoke(a: argparse.Namespace) -> int:
    try:
        out = generate(a.url, a.prompt, a.max_new_tokens, a.timeout)
    except RequestFailed as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        return 1
    ok = bool(out.get("output_ids")) and (a.expect or "") in out.get("text", "")
    print(json.dumps({"ok": ok, "prompt": a.prompt, "text": out.get("text"), "output_ids": out.get("output_ids"),
                      "expect": a.expect, "meta_info": out.get("meta_info"), "client_latency_s": out["client_latency_s"]}))
    return 0 if ok else 1


def cmd_warm(a: argparse.Namespace) -> int:
    # Sequential requests: a round-robin router hands each replica at least one.
    done, errors = 0, []
    for _ in range(a.num):
        try:
            generate(a.url, "Hello", 4, a.timeout)
            done += 1
        except RequestFailed as e:
            errors.append(str(e))
    print(json.dumps({"ok": not errors, "requests": a.num, "succeeded": done, "errors": errors}))
    return 0 if not errors else 1


def cmd_bench(a: argparse.Namespace) -> int:
    lo, hi = (int(x) for x in a.token_range.split(","))
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(lo, hi) for _ in range(a.input_len)] for _ in range(a.num)]

    def one(ids):
        try:
            return stream(a.url, ids, a.output_len, a.timeout)
        except (RequestFailed, ValueError) as e:
            return {"error": str(e)}

    start = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        results = list(pool.map(one, prompts))
    duration = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    summary = {
        "tool": "deploy/tools/client.py bench", "url": a.url, "input_len": a.input_len, "output_len": a.output_len,
        "concurrency": a.concurrency, "num": a.num, "seed": a.seed, "succeeded": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r["error"] for r in results if "error" in r})[:10],
        "duration_s": duration,
        "input_tok_s": sum(r["prompt_tokens"] for r in ok) / duration,
        "output_tok_s": sum(r["output_tokens"] for r in ok) / duration,
        "ttft_s": summarize([r["ttft_s"] for r in ok]), "tpot_s": summarize([r["tpot_s"] for r in ok]),
        "e2e_s": summarize([r["e2e_s"] for r in ok]), "requests": results,
    }
    print(json.dumps(summary))
    return 0 if len(ok) == len(results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="client.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("smoke", "warm", "bench"):
        s = sub.add_parser(name)
        s.add_argument("--url", required=True, help="router base URL, e.g. http://10.0.0.1:30000")
        s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    smoke = sub.choices["smoke"]
    smoke.add_argument("--prompt", default="The capital of France is")
    smoke.add_argument("--max-new-tokens", type=int, default=16)
    smoke.add_argument("--expect", default="", help="substring the answer must contain")
    sub.choices["warm"].add_argument("--num", type=int, default=1)
    bench = sub.choices["bench"]
    bench.add_argument("--input-len", type=int, required=True)
    bench.add_argument("--output-len", type=int, required=True)
    bench.add_argument("--concurrency", type=int, default=8)
    bench.add_argument("--num", type=int, default=40)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--token-range", default="1000,30000", help="random prompt token ids from [lo, hi)")
    a = p.parse_args(argv)
    return {"smoke": cmd_smoke, "warm": cmd_warm, "bench": cmd_bench}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
