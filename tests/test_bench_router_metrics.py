"""Router metrics across replicas: per-backend and fleet figures, including the weighted accept
length from summed histograms, attributed correctly while requests interleave (no services)."""
from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest

from common.engine.sampling import SamplingParams
from common.tools.bench import stats
from protos import pdflash_pb2 as pb
from router_svc.dispatch import Route
from router_svc.frontend import Generation
from router_svc.metrics import Metrics

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _backend(role: str, addr: str):
    return SimpleNamespace(role=role, addr=addr)


class FakeDispatcher:
    """Round robin over pairs, like Dispatcher.route."""

    def __init__(self, routes: list[Route]):
        self.routes, self.i = routes, 0

    def route(self, pin: object = None) -> Route:
        r = self.routes[self.i % len(self.routes)]
        self.i += 1
        return r


def _meta(d: dict) -> pb.MetaInfo:
    return pb.MetaInfo(prompt_tokens=d["prompt_tokens"], completion_tokens=d["completion_tokens"],
                       finish_reason="stop", spec_verify_ct=d.get("spec_verify_ct", 0),
                       spec_accept_histogram=d.get("spec_accept_histogram", []),
                       spec_accepted_drafts=d.get("spec_accepted_drafts", 0),
                       spec_proposed_drafts=d.get("spec_proposed_drafts", 0))


@pytest.fixture(scope="module")
def metas():
    with open(os.path.join(FIXTURES, "bench_responses.json")) as f:
        rec = json.load(f)
    return [r["meta_info"] for r in rec["gsm8k"] + rec["serving"]]


def test_per_backend_and_fleet_figures(metas):
    p0, d0, d1 = _backend("prefill", "p:1"), _backend("decode", "d:1"), _backend("decode", "d:2")
    dispatcher = FakeDispatcher([Route(d0, p0), Route(d1, p0)])
    metrics = Metrics()
    metrics.track_routes(dispatcher)

    async def serve(i: int, meta: dict | None) -> None:
        dispatcher.route()  # what Dispatcher.generate does first, in the task serving the request
        await asyncio.sleep(0.01 * (len(metas) - i))  # finish in the reverse order: tasks interleave
        if meta is None:
            metrics.request_done("generate", "timeout")
            return
        gen = Generation("generate", [1] * meta["prompt_tokens"], SamplingParams())
        gen.first_token_at = gen.start + 0.5
        gen.meta = _meta(meta)
        metrics.request_succeeded(gen)
        metrics.request_done("generate", "ok")

    async def main() -> None:
        await asyncio.gather(*(serve(i, m) for i, m in enumerate(metas + [None])))
        metrics.request_done("generate", "invalid_request_error")  # refused before any route

    asyncio.run(main())
    snap = metrics.snapshot()
    on = {key: served for key, served in snap["backends"].items()}
    # Requests alternate d:1, d:2 (index 8, the failed one, went to d:1); all went through p:1.
    served = {"d:1": metas[0::2], "d:2": metas[1::2]}
    for addr, mine in served.items():
        figures = on[("decode", addr)]
        assert figures["requests_ok"] == len(mine)
        assert figures["completion_tokens"] == sum(m["completion_tokens"] for m in mine)
        expected = stats.spec_summary(mine)
        assert figures["spec"]["verify_steps"] == expected["verify_steps"]
        assert figures["spec"]["histogram"] == expected["histogram"]
        assert figures["spec"]["accept_length_weighted"] == pytest.approx(expected["accept_length_weighted"])
    assert on[("decode", "d:1")]["requests_failed"] == 1 and on[("decode", "d:2")]["requests_failed"] == 0
    assert on[("prefill", "p:1")]["requests_ok"] == len(metas) and on[("prefill", "p:1")]["requests_failed"] == 1
    fleet, expected = snap["fleet"], stats.spec_summary(metas)
    assert (fleet["requests_ok"], fleet["requests_failed"]) == (len(metas), 2)
    assert fleet["spec"]["accept_length_weighted"] == pytest.approx(expected["accept_length_weighted"])
    assert fleet["spec"]["accept_length_interface"] == pytest.approx(expected["accept_length_interface_pooled"])
    assert fleet["spec"]["draft_acceptance_rate"] == pytest.approx(expected["draft_acceptance_rate"])
    assert fleet["ttft_mean_s"] == pytest.approx(0.5)

    text = metrics.render().decode()
    weighted = expected["accept_length_weighted"]
    assert f"pdflash_spec_accept_length_weighted {weighted}" in text
    assert 'pdflash_backend_requests_total{backend="d:1",role="decode",status="timeout"} 1.0' in text
    assert 'pdflash_backend_requests_total{backend="p:1",role="prefill",status="ok"} 8.0' in text
    d2 = stats.spec_summary(served["d:2"])
    assert (f'pdflash_backend_spec_verify_steps_total{{backend="d:2",role="decode"}} '
            f'{float(d2["verify_steps"])}') in text
    assert "pdflash_backend_spec_accept_length_weighted{" in text


def test_without_speculation_there_is_no_accept_length():
    metrics = Metrics()
    dispatcher = FakeDispatcher([Route(_backend("replica", "r:1"), None)])
    metrics.track_routes(dispatcher)

    def finish(gen: Generation) -> None:
        gen.meta = pb.MetaInfo(prompt_tokens=3, completion_tokens=4, finish_reason="length")
        metrics.request_succeeded(gen)
        metrics.request_done("generate", "ok")

    async def routed() -> None:
        dispatcher.route()
        finish(Generation("generate", [1, 2, 3], SamplingParams()))

    async def unrouted() -> None:  # e.g. a path that never reached the dispatcher
        finish(Generation("generate", [1, 2, 3], SamplingParams()))

    asyncio.run(routed())
    asyncio.run(unrouted())
    snap = metrics.snapshot()
    assert snap["fleet"]["spec"] is None and snap["fleet"]["requests_ok"] == 2
    assert list(snap["backends"]) == [("replica", "r:1")] and snap["backends"][("replica", "r:1")]["requests_ok"] == 1
    assert "pdflash_spec_accept_length_weighted NaN" in metrics.render().decode()
