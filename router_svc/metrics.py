"""Fleet metrics in the Prometheus text format, learnt from what passes through the router:
request outcomes, token counts and latencies, speculative-decoding counters from meta_info,
transfer failures from errors, and KV pages from each backend's Health reply.

The same figures per backend: `track_routes` learns which backends each request went to (its P
and D, or its replica), and every outcome is also counted on those. In pd mode a request counts
on its P and on its D, so per-backend rows do not add up to the fleet row. `snapshot()` gives
the fleet and per-backend figures as JSON (for /server_info), including the weighted accept
length from the summed histograms (docs/BENCHMARKS.md)."""
from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    disable_created_metrics,
    generate_latest,
)

from router_svc.generation import Generation

if TYPE_CHECKING:
    from router_svc.backend import BackendHealth
    from router_svc.dispatch import Dispatcher, Pin, Route

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1)

BackendKey = tuple[str, str]  # (role, gRPC address)

# The backends of the request being served by the current task: set when the dispatcher picks
# a route, read (and cleared) when the request's outcome is recorded; both happen in
# Frontend.run, in the one task that iterates the dispatcher's generator.
_route: contextvars.ContextVar[tuple[BackendKey, ...] | None] = contextvars.ContextVar("pdflash_route", default=None)


@dataclass
class Served:
    """What one backend (or the whole fleet) served, from the requests that passed the router."""

    ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    tpot_sum: float = 0.0
    tpot_count: int = 0
    e2e_sum: float = 0.0
    spec_requests: int = 0
    spec_completion_tokens: int = 0  # completion tokens of the requests with verify steps
    verify_steps: int = 0
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    histogram: list[int] = field(default_factory=list)

    def add(self, gen: Generation, ttft: float | None, tpot: float | None, e2e: float) -> None:
        self.ok += 1
        self.prompt_tokens += gen.prompt_tokens
        self.completion_tokens += gen.completion_tokens
        self.e2e_sum += e2e
        if ttft is not None:
            self.ttft_sum += ttft
            self.ttft_count += 1
        if tpot is not None:
            self.tpot_sum += tpot
            self.tpot_count += 1
        meta = gen.meta
        if meta is not None and meta.spec_verify_ct:
            self.spec_requests += 1
            self.spec_completion_tokens += meta.completion_tokens
            self.verify_steps += meta.spec_verify_ct
            self.accepted_drafts += meta.spec_accepted_drafts
            self.proposed_drafts += meta.spec_proposed_drafts
            hist = list(meta.spec_accept_histogram)
            self.histogram += [0] * (len(hist) - len(self.histogram))
            for k, n in enumerate(hist):
                self.histogram[k] += n

    @property
    def accept_length_weighted(self) -> float | None:
        return 1 + self.accepted_drafts / self.verify_steps if self.verify_steps else None

    @property
    def accept_length_interface(self) -> float | None:
        """Pooled completion_tokens / verify_steps over the speculative requests."""
        return self.spec_completion_tokens / self.verify_steps if self.verify_steps else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests_ok": self.ok, "requests_failed": self.failed,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "ttft_mean_s": self.ttft_sum / self.ttft_count if self.ttft_count else None,
            "tpot_mean_s": self.tpot_sum / self.tpot_count if self.tpot_count else None,
            "e2e_mean_s": self.e2e_sum / self.ok if self.ok else None,
            "spec": None if not self.verify_steps else {
                "requests": self.spec_requests, "verify_steps": self.verify_steps,
                "accepted_drafts": self.accepted_drafts, "proposed_drafts": self.proposed_drafts,
                "histogram": list(self.histogram),
                "accept_length_weighted": self.accept_length_weighted,
                "accept_length_interface": self.accept_length_interface,
                "draft_acceptance_rate": self.draft_acceptance_rate,
            },
        }


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # drop the *_created samples: noise for every series we export
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdflash_requests", "Generation requests by endpoint and outcome "
                                "(ok, an error type, or cancelled = the client left)",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pdflash_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("pdflash_completion_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.cached_tokens = Counter("pdflash_cached_tokens", "Prompt tokens served from a prefix cache",
                                     registry=r)
        self.ttft = Histogram("pdflash_time_to_first_token_seconds", "Arrival at the router to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdflash_time_per_output_token_seconds",
                              "(e2e - ttft) / (completion_tokens - 1) per request", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pdflash_e2e_latency_seconds", "Arrival at the router to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.transfer_bytes = Counter("pdflash_transfer_bytes", "KV bytes moved P -> D", registry=r)
        self.transfer_failures = Counter("pdflash_transfer_failures", "pd requests that failed before their "
                                         "first token (bootstrap, transfer, P or D down), by error type",
                                         ["reason"], registry=r)
        # Weighted accept length, fleet-wide: 1 + accepted_drafts / verify_steps.
        self.spec_verify = Counter("pdflash_spec_verify_steps", "Speculative verify steps", registry=r)
        self.spec_accepted = Counter("pdflash_spec_accepted_drafts", "Accepted draft tokens (no bonus)", registry=r)
        self.spec_proposed = Counter("pdflash_spec_proposed_drafts", "Proposed draft tokens", registry=r)
        self.spec_accept_steps = Counter("pdflash_spec_accept_steps", "Verify steps that accepted k drafts "
                                         "(the summed per-request accept histogram)", ["accepted"], registry=r)
        self.backend_up = Gauge("pdflash_backend_up", "1 if the backend's Health answered ok",
                                ["role", "backend"], registry=r)
        self.free_pages = Gauge("pdflash_backend_free_kv_pages", "Free KV pages (from Health)",
                                ["role", "backend"], registry=r)
        self.total_pages = Gauge("pdflash_backend_total_kv_pages", "All KV pages (from Health)",
                                 ["role", "backend"], registry=r)
        self.running = Gauge("pdflash_backend_running_requests", "Running requests (from Health)",
                             ["role", "backend"], registry=r)
        # A handoff stuck on its D shows here before its deadline fails it.
        self.awaiting_bootstrap = Gauge("pdflash_backend_rooms_awaiting_bootstrap", "Rooms on a prefill backend "
                                        "whose decode instance has not bootstrapped yet (from Health)",
                                        ["role", "backend"], registry=r)
        self.writing = Gauge("pdflash_backend_rooms_writing", "Rooms on a prefill backend writing their KV into "
                             "decode (from Health)", ["role", "backend"], registry=r)
        # Derived, set at render time from the counters above (fleet) and below (per backend).
        self.accept_weighted = Gauge("pdflash_spec_accept_length_weighted", "1 + accepted drafts / verify steps, "
                                     "from the summed accept histograms (fleet)", registry=r)
        self.accept_interface = Gauge("pdflash_spec_accept_length", "Completion tokens / verify steps of the "
                                      "speculative requests (fleet; biased, see docs/BENCHMARKS.md)", registry=r)
        self.draft_acceptance = Gauge("pdflash_spec_draft_acceptance_rate", "Accepted / proposed drafts, without "
                                      "the bonus token (fleet)", registry=r)
        # Per backend: a pd request counts on its P and on its D.
        per = ["role", "backend"]
        self.b_requests = Counter("pdflash_backend_requests", "Generation requests a backend served, by outcome",
                                  per + ["status"], registry=r)
        self.b_prompt_tokens = Counter("pdflash_backend_prompt_tokens", "Prompt tokens of finished requests",
                                       per, registry=r)
        self.b_completion_tokens = Counter("pdflash_backend_completion_tokens", "Generated tokens of finished "
                                           "requests", per, registry=r)
        self.b_ttft = Summary("pdflash_backend_time_to_first_token_seconds", "Arrival at the router to the "
                              "first token", per, registry=r)
        self.b_e2e = Summary("pdflash_backend_e2e_latency_seconds", "Arrival at the router to the last token",
                             per, registry=r)
        self.b_spec_verify = Counter("pdflash_backend_spec_verify_steps", "Speculative verify steps", per, registry=r)
        self.b_spec_accepted = Counter("pdflash_backend_spec_accepted_drafts", "Accepted draft tokens (no bonus)",
                                       per, registry=r)
        self.b_spec_proposed = Counter("pdflash_backend_spec_proposed_drafts", "Proposed draft tokens", per,
                                       registry=r)
        self.b_accept_weighted = Gauge("pdflash_backend_spec_accept_length_weighted", "1 + accepted drafts / "
                                       "verify steps of the requests a backend served", per, registry=r)
        self.fleet = Served()
        self.by_backend: dict[BackendKey, Served] = {}

    def track_routes(self, dispatcher: Dispatcher) -> None:
        """Learn which backends serve each request: wraps `dispatcher.route` (on this instance)
        so that the route it picks is remembered for the task serving the request."""
        pick = dispatcher.route

        def route(pin: Pin | None = None) -> Route:
            r = pick(pin)
            _route.set(tuple((b.role, b.addr) for b in (r.prefill, r.decode) if b is not None))
            return r

        dispatcher.route = route

    def _backends(self) -> list[tuple[BackendKey, Served]]:
        return [(key, self.by_backend.setdefault(key, Served())) for key in _route.get() or ()]

    def request_done(self, endpoint: str, status: str) -> None:
        self.requests.labels(endpoint, status).inc()
        for key, served in self._backends():
            self.b_requests.labels(*key, status).inc()
            if status != "ok":
                served.failed += 1
        if status != "ok":
            self.fleet.failed += 1
        _route.set(None)  # this request is done; the task may serve another

    def transfer_failed(self, reason: str) -> None:
        self.transfer_failures.labels(reason).inc()

    def request_succeeded(self, gen: Generation) -> None:
        meta = gen.meta
        self.prompt_tokens.inc(gen.prompt_tokens)
        self.completion_tokens.inc(gen.completion_tokens)
        self.cached_tokens.inc(gen.cached_tokens)
        e2e = gen.elapsed
        self.e2e.observe(e2e)
        ttft = tpot = None
        if gen.first_token_at is not None:
            ttft = gen.first_token_at - gen.start
            self.ttft.observe(ttft)
            if gen.completion_tokens > 1:
                tpot = (e2e - ttft) / (gen.completion_tokens - 1)
                self.tpot.observe(tpot)
        self.fleet.add(gen, ttft, tpot, e2e)
        for key, served in self._backends():
            served.add(gen, ttft, tpot, e2e)
            self.b_prompt_tokens.labels(*key).inc(gen.prompt_tokens)
            self.b_completion_tokens.labels(*key).inc(gen.completion_tokens)
            self.b_e2e.labels(*key).observe(e2e)
            if ttft is not None:
                self.b_ttft.labels(*key).observe(ttft)
            if meta is not None and meta.spec_verify_ct:
                self.b_spec_verify.labels(*key).inc(meta.spec_verify_ct)
                self.b_spec_accepted.labels(*key).inc(meta.spec_accepted_drafts)
                self.b_spec_proposed.labels(*key).inc(meta.spec_proposed_drafts)
        if meta is None:
            return
        self.transfer_bytes.inc(meta.transfer_bytes)
        if meta.spec_verify_ct:
            self.spec_verify.inc(meta.spec_verify_ct)
            self.spec_accepted.inc(meta.spec_accepted_drafts)
            self.spec_proposed.inc(meta.spec_proposed_drafts)
            for k, steps in enumerate(meta.spec_accept_histogram):
                if steps:
                    self.spec_accept_steps.labels(str(k)).inc(steps)

    def update_backends(self, health: list[BackendHealth]) -> None:
        for h in health:
            labels = (h.role, h.addr)
            self.backend_up.labels(*labels).set(1 if h.ok else 0)
            if h.reply is not None:
                self.free_pages.labels(*labels).set(h.reply.free_pages)
                self.total_pages.labels(*labels).set(h.reply.total_pages)
                self.running.labels(*labels).set(h.reply.running)
                if h.role == "prefill":
                    self.awaiting_bootstrap.labels(*labels).set(h.reply.awaiting_bootstrap)
                    self.writing.labels(*labels).set(h.reply.writing)

    def snapshot(self) -> dict[str, Any]:
        """{"fleet": figures, "backends": {(role, addr): figures}} (Served.as_dict)."""
        return {"fleet": self.fleet.as_dict(),
                "backends": {key: served.as_dict() for key, served in self.by_backend.items()}}

    def render(self) -> bytes:
        for gauge, value in ((self.accept_weighted, self.fleet.accept_length_weighted),
                             (self.accept_interface, self.fleet.accept_length_interface),
                             (self.draft_acceptance, self.fleet.draft_acceptance_rate)):
            gauge.set(value if value is not None else float("nan"))
        for key, served in self.by_backend.items():
            if served.accept_length_weighted is not None:
                self.b_accept_weighted.labels(*key).set(served.accept_length_weighted)
        return generate_latest(self.registry)
