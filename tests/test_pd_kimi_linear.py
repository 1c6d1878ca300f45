"""Prefill -> decode hand-off of a Kimi-Linear model (KDA + NoPE MLA + MoE): the MLA layers'
latent pages and the KDA layers' recurrent states and convolution windows, planned by the
transfer plan over the runners' own buffer descriptions.

In one process (cheap): P's runner prefills a prompt in chunks, every entry of the plan is
copied byte for byte from P's tensors into D's, and D's decode logits equal the single-process
runner's, step for step, in fp32. Negative controls: a zeroed state, a state sent before the
last chunk, the hand-off token applied twice and P's head slice shifted by one head each make
that comparison fail.

Through the PD stack (`pdflash up --mode pd --spec dflash`, real processes, gRPC, Mooncake): P at
TP 2 x PP 2 (each stage sends its layers' pages and states, each TP rank its KDA head of every
state, whole latent pages from one P rank per D rank, the last stage the draft KV) into D at
TP 2, which speculates; greedy tokens equal the single-process engine's without speculation, for
one request alone and a batch of prompts prefilled in chunks.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import os
import shutil

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.buffers import RoomBuffers, SlotStateBuffer
from common.kv.seq_cache import SeqCache
from common.model.weights import converted_folder
from common.runner.model_runner import ModelRunner
from common.transfer.plan import TransferPlan, build_plan
from hf_oracle import checkpoint_fixture, prefill_then_decode, tiny_runner
from pd_stack import Stack
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


def handoff_logits(p: ModelRunner, d: ModelRunner, tamper: str = "") -> torch.Tensor:
    """D's logits at the last prompt token (P's) and at each CONTINUATION token after P
    prefilled PROMPTS[0] in chunks and the plan moved its KV and state into D."""
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


@pytest.fixture(scope="module")
def folder(checkpoint, embedded_source, embedded_tokenizer) -> str:
    """The checkpoint with a tokenizer beside it (the services load one; requests here are token
    ids below the checkpoint's vocabulary)."""
    path = str(checkpoint[4])
    tokenizer = os.path.join(converted_folder(embedded_source), "tokenizer")
    for f in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, f), path)
    return path


@pytest.mark.slow
def test_pd_stack_equals_one_process(checkpoint, folder, tmp_path) -> None:
    """One stack serves both layouts the brief names: P at TP 2 on each of 2 pipeline stages
    (stage 0: KDA, KDA, MLA; stage 1: KDA, MLA), D at TP 2, with DFlash (a random drafter; D
    verifies blocks of 4 over both ranks' KDA heads and commits what it accepts). One request
    alone, then all at once."""
    _, _, cfg, tensors, _ = checkpoint
    reqs = [Request(str(i), ids, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)) for i, ids in enumerate(PROMPTS)]
    Engine(ModelRunner(cfg, tensors, num_pages=64, page_size=PAGE), cfg.eos_token_ids).run_all(reqs)
    drafter = save_random_drafter(cfg, (0, 2), str(tmp_path / "drafter"))
    stack = Stack("--mode", "pd", "--model", folder, "--page-size", str(PAGE), "--kv-pages", "64",
                  "--state-slots", "8", "--chunk-size", "32", "--deadline", "240", "--request-timeout", "600",
                  "--prefill-tp", "2", "--prefill-pp", "2", "--decode-tp", "2",
                  "--spec", "dflash", "--draft-model", drafter, "--spec-block", "4")
    try:
        alone = stack.generate(PROMPTS[1], MAX_NEW, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched, chunked prefill
            results = list(pool.map(lambda ids: stack.generate(ids, MAX_NEW, ignore_eos=True), PROMPTS))
        assert alone["output_ids"] == reqs[1].output_ids
        assert [r["output_ids"] for r in results] == [r.output_ids for r in reqs]
        assert all(r["meta_info"]["spec_verify_ct"] > 0 for r in [alone] + results)  # D speculated
        stack.wait_all_pages_free()
    finally:
        stack.stop()
    stack.assert_clean_log()
