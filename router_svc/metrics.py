"""Fleet metrics in the Prometheus text format, learnt from what passes through the router:
request outcomes, token counts and latencies, speculative-decoding counters from meta_info,
transfer failures from errors, and KV pages from each backend's Health reply."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

if TYPE_CHECKING:
    from router_svc.dispatch import BackendHealth
    from router_svc.frontend import Generation

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1)


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

    def request_done(self, endpoint: str, status: str) -> None:
        self.requests.labels(endpoint, status).inc()

    def transfer_failed(self, reason: str) -> None:
        self.transfer_failures.labels(reason).inc()

    def request_succeeded(self, gen: Generation) -> None:
        meta = gen.meta
        self.prompt_tokens.inc(gen.prompt_tokens)
        self.completion_tokens.inc(gen.completion_tokens)
        self.cached_tokens.inc(gen.cached_tokens)
        e2e = gen.elapsed
        self.e2e.observe(e2e)
        if gen.first_token_at is not None:
            ttft = gen.first_token_at - gen.start
            self.ttft.observe(ttft)
            if gen.completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (gen.completion_tokens - 1))
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
