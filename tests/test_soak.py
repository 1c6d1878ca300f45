"""`pdflash bench soak` for 15 s against the session's shared pd stack (DFlash, every KV page
checksummed on arrival): 8 clients, prompts of 16 to 1K tokens, short outputs, streamed and not,
greedy and sampled, a fifth of the clients leaving mid-request. No failure but the deliberate
departures, every pool (KV pages, draft KV pages) whole at the end, each service's RSS read.
Meanwhile, on the same stack, DFlash stays lossless: the soak's rooms in the batch change no
token of the greedy prompts of tests/test_dflash_lossless.py (the soak's fixed time absorbs that
check's)."""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_dflash_lossless import MAX_NEW, RUNNER, PlainOutputs, check_invariants, lossless_prompts

from common.tools.bench import soak, soak_fault
from common.tools.bench.client import Response

pytestmark = pytest.mark.slow


def soak_args(url: str, out: str, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    soak.add_args(p)
    return argparse.Namespace(**vars(p.parse_args(["--url", url, "--out", out])) | over)


def test_soak_leaves_every_pool_whole(pd_stack, embedded_tokenizer, make_embedded_runner, tmp_path_factory,
                                      tmp_path) -> None:
    prompts = lossless_prompts(embedded_tokenizer)
    args = soak_args(pd_stack.url, str(tmp_path), concurrency=8, duration=15.0, max_len=1024, output_len=16,
                     abort_share=0.2, drain_timeout=60.0)
    # All at once: the load, the stack's answers and the plain engine's (in this process), so
    # that the soak's fixed 15 s take in the others' time.
    with ThreadPoolExecutor(1) as background, ThreadPoolExecutor(8) as pool:
        soaking = background.submit(soak.run, args)
        answers = [pool.submit(pd_stack.generate, ids, max_new_tokens=MAX_NEW) for ids in prompts]
        plain = PlainOutputs(make_embedded_runner(**RUNNER), embedded_tokenizer, prompts, tmp_path_factory)["greedy"]
        lossless = [a.result() for a in answers]
        assert soaking.result() == 0, (tmp_path / "summary.md").read_text()
    for res, want in zip(lossless, plain):
        assert res["output_ids"] == want
        meta = res["meta_info"]
        check_invariants(meta)
        if meta.get("spec_verify_ct"):
            assert meta["spec_accept_length_weighted"] == pytest.approx(
                1 + meta["spec_accepted_drafts"] / meta["spec_verify_ct"])
        assert meta["verified_pages"] > 0  # target KV and draft KV pages checked after transfer
    summary = json.loads((tmp_path / "summary.json").read_text())
    r = summary["requests"]
    assert r["failed"] == 0 and summary["failures_by_cause"] == {}
    assert r["ok"] >= 8 and r["left_deliberately"] >= 1 and r["streamed"] >= 1
    assert r["speculative"] == r["ok"], "the stack speculates at every step: every answer says so"
    assert summary["leaked_backends"] == 0 and summary["pools_whole_after_s"] is not None
    for p in summary["pools"]:  # target and draft KV pages, on P and on D
        assert set(p["in_use"]) == {"Pages", "DraftPages"} and p["running"] == 0, p
    for addr, rss in summary["rss_bytes"].items():
        assert 0 < rss["private_start"] <= rss["start"] and 0 < rss["private_end"] <= rss["end"], (addr, rss)
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


def test_a_frozen_instance_is_taken_out_and_back_and_nothing_else_fails(pd_stack, tmp_path) -> None:
    """`--kill decode:0 --freeze --restart-after 8`: a short load with D frozen for 8 s of it. The
    router must stop routing to it and take it back; the rooms it held wait and then finish (the
    stack's deadline is long), and every pool is whole at the end."""
    # 8 s frozen: a read of /server_info waits up to 5 s for the frozen D's Health before it says so.
    args = soak_args(pd_stack.url, str(tmp_path), concurrency=2, duration=14.0, max_len=64, output_len=4,
                     abort_share=0.0, kill="decode:0", kill_at=2.0, freeze=True, restart_after=8.0)
    assert soak.run(args) == 0, (tmp_path / "summary.md").read_text()
    fault = json.loads((tmp_path / "summary.json").read_text())["fault"]
    assert fault["made"] and fault["how"] == "SIGSTOP" and fault["addr"] == pd_stack.worker("decode").addr
    assert fault["restart_s"] == pytest.approx(fault["fault_s"] + 8.0, abs=1.5)
    assert fault["out_of_service_after_s"] is not None and fault["back_in_service_after_s"] is not None
    assert fault["out_of_service_after_s"] < fault["back_in_service_after_s"]
    assert fault["unaffected"]["failed"] == 0 and fault["affected"]["requests"] >= 1
    pd_stack.wait_all_pages_free()


def _outcome(sent: float, ended: float, error: str | None = None, left: bool = False) -> soak.Outcome:
    return soak.Outcome({}, Response(0, ok=error is None, error=error), 16, False, None, left=left, sent_s=sent,
                        ended_s=ended)


def test_the_fault_report_sorts_requests_and_judges_them() -> None:
    """Affected: in flight at the fault, or failed naming the instance; they may fail, within the
    deadline; anything else that fails fails the run, and so does an instance never taken out."""
    plan = soak_fault.Plan(soak_fault.Target("prefill", 1), at_s=10.0, freeze=False, restart_after_s=None)
    t = soak_fault.Timeline(addr="h:2", pid=7, fault_s=10.0, out_s=12.0, back_s=40.0)
    named = "HTTP 504: decode h:3: KV transfer from prefill h:2 did not finish within the deadline"
    outcomes = [_outcome(1, 9), _outcome(9, 11, "HTTP 502: prefill h:2: prefill failed"),  # before; in flight
                _outcome(9, 12), _outcome(11, 30, named), _outcome(20, 25),  # in flight ok; named; after
                _outcome(5, 20, "anything", left=True)]  # left on purpose: counts nowhere
    r = soak_fault.report(t, plan, outcomes, deadline_s=60.0)
    assert r["affected"] == {"requests": 3, "ok": 1, "failed": 2, "longest_wait_s": 19.0, "past_deadline": 0,
                             "not_naming_a_backend": 0, "example": "HTTP 502: prefill h:2: prefill failed"}
    assert r["unaffected"]["requests"] == 2 and r["unaffected"]["failed"] == 0
    assert (r["out_of_service_after_s"], r["back_in_service_after_s"], r["passed"]) == (2.0, 30.0, True)
    # The negative controls: a failure elsewhere, one past the deadline, an affected one naming no
    # backend, an instance never taken out.
    other = "HTTP 504: decode h:3: KV transfer from prefill h:1 did not finish within the deadline"
    assert not soak_fault.report(t, plan, outcomes + [_outcome(20, 21, other)], 60.0)["passed"]
    assert not soak_fault.report(t, plan, outcomes + [_outcome(12, 80, named)], 60.0)["passed"]
    assert not soak_fault.report(t, plan, outcomes + [_outcome(9, 13, "the response ended without a final event")],
                                 60.0)["passed"]
    never_out = soak_fault.Timeline(addr="h:2", pid=7, fault_s=10.0)
    assert not soak_fault.report(never_out, plan, outcomes, 60.0)["passed"]
    assert "NOT made" in soak_fault.markdown(soak_fault.report(soak_fault.Timeline(addr="h:2"), plan, [], 60.0))
    assert "stopped routing to it after 2.0 s, routed to it again after 30.0 s" in soak_fault.markdown(r)


@pytest.mark.parametrize("argv, says", [
    (["--kill", "router:0"], "is not ROLE:INDEX"), (["--kill", "decode:0:1"], "is not ROLE:INDEX"),
    (["--freeze"], "need --kill"), (["--kill", "prefill:0", "--restart-after", "5"], "needs --freeze"),
    (["--kill", "prefill:0", "--kill-at", "600"], "not within the load")])
def test_fault_options_are_checked(argv: list[str], says: str, capsys) -> None:
    p = argparse.ArgumentParser()
    soak.add_args(p)
    with pytest.raises((SystemExit, ValueError)) as e:
        soak_fault.Plan.from_args(p.parse_args(argv))
    assert says in (str(e.value) if e.type is ValueError else capsys.readouterr().err)
    assert soak_fault.Target.parse("decode:1:rank3") == soak_fault.Target("decode", 1, 3)


def test_a_worker_rank_is_found_as_a_parallel_instance_starts_it() -> None:
    """Ranks 1 and 2 as common.parallel.local_ranks starts them: in order, from a forkserver."""
    ctx = multiprocessing.get_context("forkserver")
    ranks = [ctx.Process(target=time.sleep, args=(60,), daemon=True) for _ in range(2)]
    for r in ranks:
        r.start()
    try:
        assert [soak_fault.process_of(os.getpid(), i).pid for i in (0, 1, 2)] == [os.getpid()] + [r.pid for r in ranks]
        with pytest.raises(LookupError, match="has 2 worker ranks, no rank 3"):
            soak_fault.process_of(os.getpid(), 3)
    finally:
        for r in ranks:
            r.kill()
            r.join()
