"""`pdflash bench soak`: hold a running stack under load for `--duration` seconds, then check that
it gave everything back.

`--concurrency` clients each send one request after another until the time is up, each drawn at
random: a prompt of `--min-len` to `--max-len` random tokens (log-uniform, so short and long
prompts both come often), 1 to `--output-len` new tokens, streamed or not, greedy or sampled, and
a share (`--abort-share`) of clients that leave at a random moment before the answer is complete
(the connection is closed: the router aborts the room on both sides). Whether decoding speculates
is the stack's choice (`pdflash up --spec dflash`, per step by its policy), not the request's:
the summary records which kind of stack it was from the answers' meta_info.

At the end (after up to `--drain-timeout` s for the last aborts to settle) every backend's
pools, read through the router's `/server_info` (each service's Health), must be whole again: KV
pages, draft KV pages and state slots all free, nothing running. Reported: answers by outcome,
failures by cause (with an example message each), p50/p99 of end-to-end latency and of time to
first token, and the resident memory (RSS, with child processes) of every service at start and
end, found by the ports `/server_info` names (local stacks only), also without its shared memory
(`Resident`: a D's KV pools, resident once first written, counted by D and every P on its host). Writes summary.json and
summary.md to `--out`; exits 1 on any failure other than the deliberate aborts, or on a leak.

`--kill` adds one fault in the middle of the load (soak_fault.py): then failures of the requests
it affected are expected, and what is checked instead is that they failed within the transfer
deadline, that every other request succeeded, and that the router stopped routing to the
instance; its report says when it stopped and when it routed to it again.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aiohttp
import psutil

from common.tools.bench import report, soak_fault, stats
from common.tools.bench.client import Response, get_json, post_generate, random_ids

# (free, total) pairs of a Health reply as /server_info shows it; absent ones are pools the
# service does not have (no drafter, no KDA layers).
POOLS = (("freePages", "totalPages"), ("freeDraftPages", "totalDraftPages"),
         ("freeStateSlots", "totalStateSlots"))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the router")
    p.add_argument("--concurrency", type=int, default=64, help="clients, each with one request in flight")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load; requests in flight then finish")
    p.add_argument("--min-len", type=int, default=16, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, default=4096, help="longest prompt, tokens")
    p.add_argument("--output-len", type=int, default=64, help="most new tokens per request")
    p.add_argument("--abort-share", type=float, default=0.1, help="share of clients that leave mid-request")
    p.add_argument("--stream-share", type=float, default=0.5, help="share of streamed requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request before it counts as failed")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds after the last answer for every pool to be whole again")
    p.add_argument("--out", default=os.path.join("bench-out", "soak"), help="output folder")
    soak_fault.add_args(p)


def run(args: argparse.Namespace) -> int:
    if min(args.concurrency, args.min_len, args.output_len) < 1 or args.max_len < args.min_len or args.duration <= 0:
        raise ValueError("--concurrency, --min-len and --output-len must be at least 1, --max-len at least "
                         "--min-len, --duration positive")
    if not (0 <= args.abort_share <= 1 and 0 <= args.stream_share <= 1):
        raise ValueError("--abort-share and --stream-share must be between 0 and 1")
    summary = soak(args, soak_fault.Plan.from_args(args))
    md = markdown(summary)
    report.write_json(os.path.join(args.out, "summary.json"), summary)
    report.write_text(os.path.join(args.out, "summary.md"), md)
    print(md)
    print(f"saved {args.out}/: summary.json summary.md")
    return 0 if summary["passed"] else 1


@dataclass
class Outcome:
    body: dict[str, Any]
    response: Response
    prompt_len: int
    stream: bool
    leave_after: float | None  # seconds after which the client leaves; None: it stays
    left: bool = False  # it did leave before the answer was complete
    sent_s: float = 0.0  # seconds from the start of the load
    ended_s: float | None = None


def soak(args: argparse.Namespace, plan: soak_fault.Plan | None = None) -> dict[str, Any]:
    url = args.url.rstrip("/")
    info = get_json(url, "/server_info")
    listeners = soak_fault.listening_pids()
    start_rss = service_rss(url, info, listeners)
    if args.max_len >= info["max_context"]:
        raise ValueError(f"--max-len {args.max_len} leaves no room for output in the model's {info['max_context']}")
    fault = soak_fault.Fault(plan, url, info, listeners) if plan else None
    begun = time.monotonic()
    if fault:
        fault.start(begun)
    outcomes = asyncio.run(_load(url, args, info["vocab_size"], begun))
    took = time.monotonic() - begun
    timeline = fault.finish() if fault else None
    pools, drained_s = wait_pools_whole(url, args.drain_timeout)
    summary = summarise(args, outcomes, took, pools, drained_s, start_rss,
                        service_rss(url, info, soak_fault.listening_pids()))
    if plan and timeline:
        summary["fault"] = soak_fault.report(timeline, plan, outcomes, info["transfer_deadline"])
        # The failures the fault explains are expected; the fault's own checks stand in for them.
        summary["passed"] = summary["fault"]["passed"] and not summary["leaked_backends"]
    return summary


async def _load(url: str, args: argparse.Namespace, vocab_size: int, begun: float) -> list[Outcome]:
    endpoint = url + "/generate"
    stop_at = begun + args.duration
    outcomes: list[Outcome] = []

    async def client(rng: random.Random, session: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop_at:
            o = _draw(rng, args, vocab_size)
            outcomes.append(o)
            o.sent_s = time.monotonic() - begun
            sending = post_generate(session, endpoint, o.body, o.response)
            try:  # cancelling closes the connection: the client is gone
                await asyncio.wait_for(sending, o.leave_after)
            except asyncio.TimeoutError:
                o.left = True
            o.ended_s = time.monotonic() - begun

    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency), timeout=timeout) as s:
        await asyncio.gather(*(client(random.Random(args.seed * 1_000_003 + i), s) for i in range(args.concurrency)))
    return outcomes


def _draw(rng: random.Random, args: argparse.Namespace, vocab_size: int) -> Outcome:
    n = round(math.exp(rng.uniform(math.log(args.min_len), math.log(args.max_len))))
    stream = rng.random() < args.stream_share
    sampled = rng.random() < 0.5
    body = {"input_ids": random_ids(rng, n, vocab_size), "stream": stream,
            "sampling_params": {"max_new_tokens": rng.randint(1, args.output_len), "temperature": 0.8 if sampled else 0,
                                "seed": rng.randrange(2**31)} | ({"top_p": 0.95} if sampled else {})}
    # Leaving within a few seconds catches a room in every stage: queued, prefilling, moving
    # its KV, decoding.
    leave = rng.uniform(0.05, 5.0) if rng.random() < args.abort_share else None
    return Outcome(body, Response(0), n, stream, leave)


def wait_pools_whole(url: str, timeout: float) -> tuple[list[dict[str, Any]], float | None]:
    """Every backend's pools from /server_info, once all are whole (or as they are at the
    timeout); the seconds it took, None if they never were."""
    start = time.monotonic()
    while True:
        pools = backend_pools(get_json(url, "/server_info"))
        if all(p["whole"] for p in pools):
            return pools, time.monotonic() - start
        if time.monotonic() - start > timeout:
            return pools, None
        time.sleep(0.5)


def backend_pools(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Per backend: its role and address, the pages / slots still in use per pool, the requests
    still running, and whether all of it is back (an unreachable backend is not)."""
    out = []
    for b in info["backends"]:
        h = b.get("health")
        row: dict[str, Any] = {"role": b["role"], "addr": b["addr"], "error": b.get("error")}
        if h is None:
            out.append(row | {"whole": False})
            continue
        used = {total.removeprefix("total"): int(h[total]) - int(h.get(free, 0))
                for free, total in POOLS if int(h.get(total, 0))}
        running = int(h.get("running", 0))
        out.append(row | {"in_use": used, "running": running, "whole": running == 0 and not any(used.values())})
    return out


def service_rss(url: str, info: dict[str, Any], listeners: dict[int, int]) -> dict[str, Resident | None]:
    """addr -> resident bytes of the process listening there and its children (None when it is
    not on this host or not visible), the router's under its HTTP address."""
    router = urlparse(url)
    addrs = [f"{router.hostname}:{router.port}"] + [b["addr"] for b in info["backends"]]
    return {addr: _tree_rss(listeners.get(int(addr.rsplit(":", 1)[1]))) for addr in addrs}


@dataclass(frozen=True)
class Resident:
    rss: int
    # What the processes allocated themselves: RSS less the file-backed and shared memory pages.
    # A D's KV pools are shared memory (a P on its host copies into them), resident once first
    # written and counted in the RSS of D and of every P that has written into them: the RSS of
    # both grows until every page of those pools has been used once.
    private: int


def _tree_rss(pid: int | None) -> Resident | None:
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        mems = [p.memory_info() for p in [proc, *proc.children(recursive=True)]]
    except psutil.Error:
        return None
    return Resident(sum(m.rss for m in mems), sum(m.rss - m.shared for m in mems))


def failure_cause(r: Response) -> str:
    """What a failure is grouped under: the HTTP status, or the kind of client-side error."""
    error = r.error or "no answer"
    if error.startswith("HTTP "):
        return error.split(":", 1)[0]
    if error.startswith("error mid-stream"):
        return "error mid-stream"
    return error.split(":", 1)[0]


def summarise(args: argparse.Namespace, outcomes: list[Outcome], took: float, pools: list[dict[str, Any]],
              drained_s: float | None, start_rss: dict[str, Resident | None], end_rss: dict[str, Resident | None]
              ) -> dict[str, Any]:
    ok = [o for o in outcomes if not o.left and o.response.ok]
    failed = [o for o in outcomes if not o.left and not o.response.ok]
    causes = Counter(failure_cause(o.response) for o in failed)
    examples = {}
    for o in failed:
        examples.setdefault(failure_cause(o.response), o.response.error)
    e2e = [o.response.e2e for o in ok if o.response.e2e is not None]
    ttft = [o.response.ttft for o in ok if o.response.ttft is not None]
    leaked = [p for p in pools if not p["whole"]]
    return {
        "provenance": report.provenance(args),
        "seconds": took,
        "requests": {"sent": len(outcomes), "ok": len(ok), "failed": len(failed),
                     "left_deliberately": sum(o.left for o in outcomes),
                     "streamed": sum(o.stream for o in outcomes),
                     "speculative": sum(stats.has_spec(o.response.meta) for o in ok),
                     "output_tokens": sum(o.response.output_tokens for o in ok),
                     "prompt_tokens": stats.describe(o.prompt_len for o in outcomes)},
        "failures_by_cause": dict(causes), "failure_examples": examples,
        "e2e_s": stats.describe(e2e), "ttft_s": stats.describe(ttft),
        "pools": pools, "pools_whole_after_s": drained_s, "leaked_backends": len(leaked),
        "rss_bytes": {addr: _rss_row(start_rss.get(addr), rss) for addr, rss in end_rss.items()},
        "passed": not failed and not leaked,
    }


def markdown(s: dict[str, Any]) -> str:
    r = s["requests"]
    lines = [f"# soak: {s['seconds']:.0f} s, {s['provenance']['options']['concurrency']} clients\n",
             f"{r['sent']} requests: {r['ok']} ok, {r['failed']} failed, {r['left_deliberately']} left on purpose; "
             f"{r['streamed']} streamed, {r['speculative']} of the ok ones decoded speculatively, "
             f"{r['output_tokens']} tokens out, prompts {r['prompt_tokens']['min']:.0f}-{r['prompt_tokens']['max']:.0f} "
             "tokens\n"]
    lines.append(report.md_table(["latency (s)", "p50", "p99", "max"], [
        [name, report.fmt(d["p50"]), report.fmt(d["p99"]), report.fmt(d["max"])]
        for name, d in (("end to end", s["e2e_s"]), ("first token (streamed)", s["ttft_s"]))]))
    if s["failures_by_cause"]:
        lines.append(report.md_table(["failure cause", "count", "example"], [
            [cause, str(n), s["failure_examples"][cause][:200]] for cause, n in s["failures_by_cause"].items()]))
    whole = s["pools_whole_after_s"]
    lines.append("pools: " + (f"all whole {whole:.1f} s after the last answer\n" if whole is not None else
                              f"{s['leaked_backends']} backends NOT whole\n"))
    lines.append(report.md_table(
        ["service", "in use at the end", "RSS start (MiB)", "RSS end (MiB)", "private start -> end (MiB)"],
        [[addr, _in_use(s["pools"], addr), _mib(rss["start"]), _mib(rss["end"]),
          f"{_mib(rss['private_start'])} -> {_mib(rss['private_end'])}"] for addr, rss in s["rss_bytes"].items()]))
    if "fault" in s:
        lines.append(soak_fault.markdown(s["fault"]))
    lines.append("PASSED\n" if s["passed"] else "FAILED\n")
    return "\n".join(lines)


def _in_use(pools: list[dict[str, Any]], addr: str) -> str:
    p = next((p for p in pools if p["addr"] == addr), None)
    if p is None:
        return "(router)"
    if "in_use" not in p:
        return f"unreachable: {p['error']}"
    return ", ".join(f"{k} {v}" for k, v in p["in_use"].items()) + f", running {p['running']}"


def _rss_row(start: Resident | None, end: Resident | None) -> dict[str, int | None]:
    return {"start": start and start.rss, "end": end and end.rss,
            "private_start": start and start.private, "private_end": end and end.private}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"
