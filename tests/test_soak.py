"""`pdflash bench soak` for 30 s against the session's shared pd stack (DFlash, every KV page
checksummed on arrival): 8 clients, prompts of 16 to 1K tokens, short outputs, streamed and not,
greedy and sampled, a fifth of the clients leaving mid-request. No failure but the deliberate
departures, every pool (KV pages, draft KV pages) whole at the end, each service's RSS read."""
from __future__ import annotations

import argparse
import json

import pytest

from common.tools.bench import soak

pytestmark = pytest.mark.slow


def soak_args(url: str, out: str, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    soak.add_args(p)
    return argparse.Namespace(**vars(p.parse_args(["--url", url, "--out", out])) | over)


def test_soak_leaves_every_pool_whole(pd_stack, tmp_path) -> None:
    args = soak_args(pd_stack.url, str(tmp_path), concurrency=8, duration=30.0, max_len=1024, output_len=16,
                     abort_share=0.2, drain_timeout=60.0)
    assert soak.run(args) == 0, (tmp_path / "summary.md").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    r = summary["requests"]
    assert r["failed"] == 0 and summary["failures_by_cause"] == {}
    assert r["ok"] >= 8 and r["left_deliberately"] >= 1 and r["streamed"] >= 1
    assert r["speculative"] == r["ok"], "the stack speculates at every step: every answer says so"
    assert summary["leaked_backends"] == 0 and summary["pools_whole_after_s"] is not None
    for p in summary["pools"]:  # target and draft KV pages, on P and on D
        assert set(p["in_use"]) == {"Pages", "DraftPages"} and p["running"] == 0, p
    assert all(rss["start"] and rss["end"] for rss in summary["rss_bytes"].values()), summary["rss_bytes"]
    pd_stack.wait_all_pages_free()


def test_a_page_in_use_is_a_leak() -> None:
    """Negative control for the end check: one draft page or one state slot still out is a leak,
    and so is a backend the router cannot reach."""
    health = {"freePages": 10, "totalPages": 10, "freeDraftPages": 9, "totalDraftPages": 10, "running": 0}
    info = {"backends": [{"role": "decode", "addr": "d:1", "health": health},
                         {"role": "prefill", "addr": "p:1", "health": health | {"freeDraftPages": 10}},
                         {"role": "prefill", "addr": "p:2", "health": health | {"freeDraftPages": 10,
                                                                                "freeStateSlots": 3,
                                                                                "totalStateSlots": 4}},
                         {"role": "prefill", "addr": "p:3", "health": None, "error": "unreachable"}]}
    assert [p["whole"] for p in soak.backend_pools(info)] == [False, True, False, False]
