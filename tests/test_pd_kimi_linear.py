"""Prefill -> decode hand-off of a Kimi-Linear model (KDA + NoPE MLA + MoE): the MLA layers'
latent pages and the KDA layers' recurrent states and convolution windows, planned by the
transfer plan over the runners' own buffer descriptions.

In one process (cheap): P's runner prefills a prompt in chunks, every entry of the plan is
copied byte for byte from P's tensors into D's, and D's decode logits equal the single-process
runner's, step for step, in fp32. Negative controls: a zeroed state, a state sent before the
last chunk, the hand-off token applied twice and P's head slice shifted by one head each make
that comparison fail.

Between parallel runners (real worker processes, the services' own bootstrap, plan_writes and
every rank's writes, by local copy into D's shared memory): P at TP 4 -> D at TP 1 and P at TP 1
-> D at TP 4 on a checkpoint of 4 KDA heads, and P at PP 3 (a stage boundary inside the KDA/MLA
mix) -> D at TP 1; P's and D's logits equal transformers'.

Through the PD stack (`pdflash up --mode pd`, real processes, gRPC, Mooncake), with and without
DFlash: one stack of P instances at TP 1 x PP 3, TP 2 x PP 2 and TP 4 and D instances at TP 1, 2
and 4 (each stage sends its layers' pages and states, each TP rank its KDA heads of every state,
whole latent pages from one P rank per D rank, the last stage the draft KV); the router's route
header sends requests to each of the 9 pairs in turn, alone and all at once; greedy tokens equal
the single-process engine's without speculation.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import dataclasses
import os
import shutil
from collections.abc import Callable

import pytest
import requests
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.buffers import RoomBuffers, SlotStateBuffer
from common.kv.seq_cache import SeqCache
from common.model.source import converted_folder
from common.parallel.cluster import Nodes
from common.parallel.driver import ParallelRunner
from common.runner.model_runner import ModelRunner
from common.service.transfer_ranks import TransferRanks, add_mooncake_args
from common.transfer.plan import TransferPlan, build_plan
from common.transfer.wire import ranks_from_bootstrap, ranks_to_protos, shared_from_bootstrap
from hf_oracle import checkpoint_fixture, hf_logits, prefill_then_decode, tiny_runner
from pd_stack import Stack, pair_prompt, serve_alone
from router_svc.dispatch import ROUTE_HEADER
from prefill_svc.kv_sender import plan_writes
from protos import pdflash_pb2 as pb
from test_kimi_linear import PROMPTS, TOL, VARIANTS, write_checkpoint
from tiny_models import save_random_drafter

checkpoint = checkpoint_fixture({"checkpoint_style": VARIANTS["checkpoint_style"]}, write_checkpoint)

CHUNK = 32  # P's prefill chunk: PROMPTS[0] (90 tokens) takes three
CONTINUATION = [60, 61, 62, 63]  # what D decodes after the prompt (teacher-forced, for logits)
PAGE, MAX_NEW = 8, 10


def copy(plan: TransferPlan) -> None:
    """Apply the plan in this process, as Mooncake would between two."""
    for e in plan.entries:
        ctypes.memmove(e.dst_addr, e.src_addr, e.length)


def buffers_of(runner: ModelRunner, seq: SeqCache, names: set[str] | None = None) -> RoomBuffers:
    buffers = [b for b in runner.describe_buffers() if names is None or b.name in names]
    return RoomBuffers(buffers, runner.room_indices(seq))


STATE = {"kda_state", "kda_conv"}


Move = Callable[[SeqCache, SeqCache], None]  # P's room into D's, every rank's share


def handoff_logits(p: ModelRunner, d: ModelRunner, tamper: str = "", move: Move | None = None) -> torch.Tensor:
    """D's logits at the last prompt token (P's) and at each CONTINUATION token after P
    prefilled PROMPTS[0] in chunks and `move` (by default the plan applied in this process,
    `tamper`ed) moved its KV and state into D."""
    prompt = PROMPTS[0]
    ps, ds = SeqCache(), SeqCache()
    p.reserve(ps, len(prompt))
    d.reserve(ds, len(prompt) + len(CONTINUATION))
    d.cache.recurrent[:, ds.state_slot] = 7.0  # leftovers of an earlier room: the transfer must replace them
    d.cache.conv[:, ds.state_slot] = 7.0
    try:
        for start in range(0, len(prompt), CHUNK):
            out = p.extend([ps], [prompt[start:start + CHUNK]])
            if tamper == "early" and start == 0:  # the state as it was after the first chunk only
                copy(build_plan("r", buffers_of(p, ps, STATE), buffers_of(d, ds, STATE), ps.length))
        if move is not None:
            move(ps, ds)
        else:
            names = {b.name for b in p.describe_buffers()} - (STATE if tamper == "early" else set())
            plan = build_plan("r", buffers_of(p, ps, names), buffers_of(d, ds, names), len(prompt))
            if tamper == "shifted":  # each state entry reads P's next head (one head's bytes on)
                head = {b.name: b.head_bytes for b in p.describe_buffers() if isinstance(b, SlotStateBuffer)}
                plan = TransferPlan(plan.room, [dataclasses.replace(e, src_addr=e.src_addr + head["kda_state"])
                                                if _in(p.cache.recurrent, e.src_addr) else e for e in plan.entries])
            copy(plan)
        ds.length = len(prompt)
        if tamper == "zeroed":
            d.cache.recurrent[:, ds.state_slot] = 0
        if tamper == "twice":  # D runs P's last prompt token again: the KV slot is rewritten alike, the state absorbs it twice
            ds.length -= 1
            d.extend([ds], [prompt[-1:]])
        logits = [out.logits]
        logits += [d.extend([ds], [[t]]).logits for t in CONTINUATION]
        return torch.cat(logits)
    finally:
        p.release(ps)
        d.release(ds)


def _in(t: torch.Tensor, addr: int) -> bool:
    return t.data_ptr() <= addr < t.data_ptr() + t.nbytes


def test_handoff_equals_one_process_and_controls_fail(checkpoint):
    p, d = tiny_runner(checkpoint, state_slots=4), tiny_runner(checkpoint, state_slots=4)
    ref = prefill_then_decode(tiny_runner(checkpoint), PROMPTS[0] + CONTINUATION, len(PROMPTS[0]))
    ref = ref[len(PROMPTS[0]) - 1:]
    for b in d.describe_buffers():  # the descriptions cover exactly the runner's tensors
        t = {"kv": d.kv, "kda_state": d.cache.recurrent, "kda_conv": d.cache.conv}[b.name]
        assert (b.base_addr, b.length) == (t.data_ptr(), t.nbytes), b.name
    torch.testing.assert_close(handoff_logits(p, d), ref, **TOL)
    for tamper in ("zeroed", "early", "twice", "shifted"):
        got = handoff_logits(p, d, tamper)
        torch.testing.assert_close(got[0], ref[0], **TOL)  # P's own prefill is untouched
        assert not torch.allclose(got[1:], ref[1:], **TOL), tamper
    torch.testing.assert_close(handoff_logits(p, d), ref, **TOL)  # and the runners are still fine


def ranks_of(runner: ModelRunner, cfg) -> TransferRanks:
    """The runner's transfer endpoints as its service starts them: a Mooncake engine per rank,
    local copies on."""
    parser = argparse.ArgumentParser()
    add_mooncake_args(parser)
    args = parser.parse_args([])
    args.nodes = Nodes()
    return TransferRanks.start(args, Engine(runner, cfg.eos_token_ids))


def service_move(p: TransferRanks, d: TransferRanks) -> Move:
    """A room's hand-off as the services make it: D's bootstrap names every D rank's buffers and
    the room's pages and slot, P plans each (P rank, D rank) pair (plan_writes) and every P
    rank writes its share, here by local copy into D's shared memory."""
    def move(ps: SeqCache, ds: SeqCache) -> None:
        boot = pb.BootstrapRequest(room="r", ranks=ranks_to_protos(d.endpoints, d.runner.room_indices(ds)))
        jobs = plan_writes("r", p.endpoints, p.tp, p.runner.room_indices(ps), ranks_from_bootstrap(boot), d.tp,
                           ps.length)
        assert p.write(jobs, shared_from_bootstrap(boot)).transport == "local"

    return move


# 4 KDA heads (and 4 MLA heads): TP 4 splits every state one head per rank.
wide_checkpoint = checkpoint_fixture({"four_kda_heads": None},
                                     lambda name, folder: write_checkpoint("checkpoint_style", folder, kda_heads=4))


def test_tp4_handoffs_equal_transformers(wide_checkpoint):
    """P at TP 4 -> D at TP 1 (D's rank takes each head's state and windows from the P rank
    holding it, the latent pages from P's rank 0) and P at TP 1 -> D at TP 4 (each D rank its
    head from P's one rank, the latent pages whole): P's prefill and D's decode logits equal
    transformers'. One TP 4 runner and one single-rank runner serve both directions."""
    _, hf, cfg, tensors, _ = wide_checkpoint
    ref = hf_logits(hf, PROMPTS[0] + CONTINUATION)[len(PROMPTS[0]) - 1:]
    one = tiny_runner(wide_checkpoint, state_slots=4, shared_kv=True)
    tp4 = ParallelRunner(cfg, tensors, tp=4, num_pages=64, page_size=PAGE, state_slots=4, shared_kv=True)
    try:
        one_ranks, tp4_ranks = ranks_of(one, cfg), ranks_of(tp4, cfg)
        torch.testing.assert_close(handoff_logits(tp4, one, move=service_move(tp4_ranks, one_ranks)), ref, **TOL)
        torch.testing.assert_close(handoff_logits(one, tp4, move=service_move(one_ranks, tp4_ranks)), ref, **TOL)
    finally:
        tp4.close()


def test_pipeline_3_equals_transformers(checkpoint):
    """PP 3 (KDA, KDA | MLA, KDA | MLA: both stage boundaries inside the mix): prefill and decode
    logits equal transformers', and so do D's after each stage sent its own layers' states and
    pages to D at TP 1."""
    _, hf, cfg, tensors, _ = checkpoint
    ids = PROMPTS[0] + CONTINUATION
    ref = hf_logits(hf, ids)
    d = tiny_runner(checkpoint, state_slots=4, shared_kv=True)
    pp3 = ParallelRunner(cfg, tensors, pp=3, num_pages=64, page_size=PAGE, state_slots=4)
    try:
        assert [len(pp3.layout.with_rank(r).layers(cfg)) for r in range(3)] == [2, 2, 1]
        torch.testing.assert_close(prefill_then_decode(pp3, ids, len(PROMPTS[0])), ref, **TOL)
        move = service_move(ranks_of(pp3, cfg), ranks_of(d, cfg))
        torch.testing.assert_close(handoff_logits(pp3, d, move=move), ref[len(PROMPTS[0]) - 1:], **TOL)
    finally:
        pp3.close()


@pytest.fixture(scope="module")
def folder(wide_checkpoint, embedded_source, embedded_tokenizer) -> str:
    """The 4-KDA-head checkpoint with a tokenizer beside it (the services load one; requests here
    are token ids below the checkpoint's vocabulary)."""
    path = str(wide_checkpoint[4])
    tokenizer = os.path.join(converted_folder(embedded_source), "tokenizer")
    for f in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, f), path)
    return path


@pytest.fixture(scope="module")
def one_process(wide_checkpoint) -> list[list[int]]:
    """Greedy output of each of PROMPTS from the single-process engine, without speculation."""
    _, _, cfg, tensors, _ = wide_checkpoint
    reqs = [Request(str(i), ids, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)) for i, ids in enumerate(PROMPTS)]
    Engine(ModelRunner(cfg, tensors, num_pages=64, page_size=PAGE), cfg.eos_token_ids).run_all(reqs)
    return [r.output_ids for r in reqs]


# (TP, PP) of each P instance and TP of each D instance: every P TP x D TP pair in {1, 2, 4}, and P
# at PP 3 (stages KDA, KDA | MLA, KDA | MLA) and PP 2 (KDA, KDA, MLA | KDA, MLA), 18 ranks in all.
P_SHAPES = ((1, 3), (2, 2), (4, 1))
D_TPS = (1, 2, 4)
PAIRS = [(p, d) for p in range(len(P_SHAPES)) for d in range(len(D_TPS))]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["dflash", "none"])
def test_pd_every_pair_equals_one_process(spec, wide_checkpoint, folder, one_process, tmp_path) -> None:
    """One stack of P instances at TP 1 x PP 3, TP 2 x PP 2 and TP 4 and D instances at TP 1, 2
    and 4 (with DFlash: a random drafter, D verifies blocks of 4 over its ranks' KDA heads and
    commits what it accepts). Each of the 9 (P, D) pairs, chosen by the route header, serves one
    request alone, then all pairs serve all prompts at once (each D batching rooms of three
    differently split P instances, prefilled in chunks); greedy tokens equal the single-process
    engine's without speculation."""
    _, _, cfg, _, _ = wide_checkpoint
    spec_args = ["--spec", "none"]
    if spec == "dflash":
        drafter = save_random_drafter(cfg, (0, 2), str(tmp_path / "drafter"))
        spec_args = ["--spec", "dflash", "--draft-model", drafter, "--spec-block", "4"]
    sizes = lambda xs: ",".join(map(str, xs))  # noqa: E731
    stack = Stack("--mode", "pd", "--model", folder, "--page-size", str(PAGE), "--kv-pages", "160",
                  "--state-slots", "12", "--chunk-size", "32", "--deadline", "240", "--request-timeout", "600",
                  "--prefill", str(len(P_SHAPES)), "--prefill-tp", sizes(tp for tp, _ in P_SHAPES),
                  "--prefill-pp", sizes(pp for _, pp in P_SHAPES), "--decode", str(len(D_TPS)),
                  "--decode-tp", sizes(D_TPS), "--allow-route-header", *spec_args)
    try:
        alone = serve_alone(len(P_SHAPES), lambda pair: stack.generate_on(
            pair, PROMPTS[pair_prompt(pair)], MAX_NEW, ignore_eos=True))  # in PAIRS' order
        assert set(stack.served().values()) == {len(D_TPS)}  # the header put one request on each pair
        bad = requests.post(stack.url + "/generate", headers={ROUTE_HEADER: f"p={len(P_SHAPES)},d=0"},
                            json={"input_ids": PROMPTS[1]}, timeout=30)
        assert bad.status_code == 400 and ROUTE_HEADER in bad.json()["error"]["message"], bad.text
        jobs = [(pair, i) for pair in PAIRS for i in range(len(PROMPTS))]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            mixed = list(pool.map(lambda job: stack.generate_on(job[0], PROMPTS[job[1]], MAX_NEW, ignore_eos=True), jobs))
        assert [r["output_ids"] for r in alone] == [one_process[pair_prompt(pair)] for pair in PAIRS]
        assert [r["output_ids"] for r in mixed] == [one_process[i] for _, i in jobs]
        assert all((r["meta_info"].get("spec_verify_ct", 0) > 0) == (spec == "dflash") for r in alone + mixed)
        stack.wait_all_pages_free()
    finally:
        stack.stop()
    stack.assert_clean_log()
