"""Requests to the router's SGLang-style `POST /generate`, `concurrency` in flight at a time,
with a progress bar (request counts, failures, running request and token rates).

Streaming responses are timed at the client, per SSE event: the router sends one event per
backend chunk, each carrying the cumulative output_ids, so an event that adds tokens marks their
arrival. A speculative step can bring several tokens in one event.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import requests
from tqdm import tqdm

REQUEST_TIMEOUT_S = 3600.0


@dataclass
class Response:
    index: int
    ok: bool = False
    error: str | None = None
    sent_at: float = 0.0  # seconds from the start of the run
    ttft: float | None = None  # seconds from sending to the first token (streaming only)
    e2e: float | None = None  # seconds from sending to the end of the response
    token_times: list[float] = field(default_factory=list)  # seconds from sending, per token-carrying event
    token_counts: list[int] = field(default_factory=list)  # tokens in each of those events
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] | None = None

    @property
    def output_tokens(self) -> int:
        return self.meta["completion_tokens"] if self.meta else len(self.output_ids)

    @property
    def prompt_tokens(self) -> int | None:
        return self.meta["prompt_tokens"] if self.meta else None

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1): the mean time per token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive token-carrying events."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def finish_reason(self) -> str | None:
        reason = (self.meta or {}).get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else reason


def get_json(url: str, path: str, timeout: float = 30) -> dict[str, Any]:
    """GET a router's JSON; an unreachable or wrong URL is a ValueError (bad input: one line)."""
    try:
        resp = requests.get(url.rstrip("/") + path, timeout=timeout)
        resp.raise_for_status()
        return resp.json()
    except (requests.RequestException, ValueError) as e:
        raise ValueError(f"cannot read {url.rstrip('/')}{path} (is a pdflash router there?): {e}") from None


def server_facts(info: dict[str, Any]) -> dict[str, Any]:
    """What a summary records about the stack, from its /server_info."""
    return {"policy": info.get("policy"), "model": info.get("model"),
            "backends": [{"role": b["role"], "addr": b["addr"]} for b in info.get("backends", [])]}


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n random token ids, away from both ends of the vocabulary (where special tokens live)."""
    lo = min(1000, vocab_size // 10)
    hi = max(int(vocab_size * 0.9), lo + 1)
    return [rng.randrange(lo, hi) for _ in range(n)]


def run_requests(url: str, bodies: list[dict[str, Any]], concurrency: int, desc: str,
                 timeout: float = REQUEST_TIMEOUT_S) -> tuple[list[Response], float]:
    """Send every body (streaming if body["stream"]); returns the responses in order and the wall
    time from the first send to the last response."""
    return asyncio.run(_run(url.rstrip("/") + "/generate", bodies, concurrency, desc, timeout))


async def _run(endpoint: str, bodies: list[dict[str, Any]], concurrency: int, desc: str,
               timeout: float) -> tuple[list[Response], float]:
    results = [Response(i) for i in range(len(bodies))]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    bar = tqdm(total=len(bodies), desc=desc, unit="req", dynamic_ncols=True, mininterval=0.5)
    done = {"ok": 0, "failed": 0, "tokens": 0}
    start = time.monotonic()

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            r = results[queue.get_nowait()]
            r.sent_at = time.monotonic() - start
            await post_generate(session, endpoint, bodies[r.index], r)
            done["ok" if r.ok else "failed"] += 1
            done["tokens"] += r.output_tokens if r.ok else 0
            elapsed = max(time.monotonic() - start, 1e-9)
            bar.set_postfix(ok=done["ok"], failed=done["failed"], req_s=f"{(done['ok'] + done['failed']) / elapsed:.2f}",
                            out_tok_s=f"{done['tokens'] / elapsed:.1f}", refresh=False)
            bar.update(1)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(bodies)))))
    bar.close()
    return results, time.monotonic() - start


async def post_generate(session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any], r: Response) -> None:
    """POST one body to `endpoint` (streamed if body["stream"]), recording the outcome on `r`."""
    t0 = time.monotonic()
    try:
        async with session.post(endpoint, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
                return
            final = await _read_stream(resp, r, t0) if body.get("stream") else await resp.json()
        r.e2e = time.monotonic() - t0
        if r.error is not None:  # an error event mid-stream, which says more than its absent final event
            return
        if final is None or not final.get("meta_info") or final["meta_info"].get("finish_reason") is None:
            r.error = "the response ended without a final event"
            return
        r.text, r.output_ids, r.meta = final["text"], final["output_ids"], final["meta_info"]
        r.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"


async def _read_stream(resp: aiohttp.ClientResponse, r: Response, t0: float) -> dict | None:
    """Read SSE events; records token arrivals on `r`; returns the last event (None on error)."""
    buf, seen, last = b"", 0, None
    async for data in resp.content.iter_any():  # not line iteration: events outgrow its 64 KiB limit
        buf += data
        *events, buf = buf.split(b"\n\n")
        for raw in events:
            if not raw.startswith(b"data:"):
                continue
            payload = raw[5:].strip()
            if payload == b"[DONE]":
                return last
            event = json.loads(payload)
            if "error" in event:
                r.error = f"error mid-stream: {event['error'].get('message')}"
                return None
            n = len(event.get("output_ids", ()))
            if n > seen:
                now = time.monotonic() - t0
                r.ttft = now if r.ttft is None else r.ttft
                r.token_times.append(now)
                r.token_counts.append(n - seen)
                seen = n
            last = event
    return last


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]
