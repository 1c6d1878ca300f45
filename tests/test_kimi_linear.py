"""Kimi-Linear (KDA + NoPE MLA + MoE) against transformers' KimiLinearForCausalLM.

Tiny random-weight checkpoints are written by transformers as Hugging Face folders (5 layers:
KDA, KDA, MLA, KDA, MLA; layer 0 a dense MLP, the rest MoE; 2 KDA heads of width 16 or 32),
their config.json rewritten into each of the two styles the model's users meet: the model's
own repository's (`linear_attn_config` with 1-based layer lists) and transformers' (`layer_types`,
`linear_num_heads`, ...). Compared in fp32: prefill (chunked form, across chunk borders) and
decode (one-step form) logits, chunked against one-shot prefill, a batch of unequal lengths
against one request at a time, greedy generation through the Engine (static decode steps reading
each row's state slot), and the state slots' life: held across prefill chunks, back in the pool
after finish and abort, admission waiting when they run out. Negative controls show that a
zeroed state and the hand-off token applied twice would each be caught.
"""
from __future__ import annotations

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.seq_cache import SeqCache
from common.kv.state_pool import OutOfStateSlots, StatePool
from common.model.config import ModelConfig
from common.model.source import resolve_model
from common.parallel.driver import ParallelRunner
from common.runner.layout import ParallelConfigError, check_parallel
from common.tools.gpu.moe_graphs import step_logits
from common.tools.tiny_hf import KIMI_VARIANTS as VARIANTS, write_kimi_linear as write_checkpoint
from router_svc.model_info import read_model_info
from hf_oracle import checkpoint_fixture, hf_greedy, hf_logits, prefill_then_decode, tiny_runner

TOL = dict(rtol=1e-4, atol=1e-4)
PROMPTS = [list(range(3, 3 + 90)), [7, 9, 11, 200, 13, 5, 99, 42, 17], [5] * 3 + list(range(100, 140))]

checkpoint = checkpoint_fixture(VARIANTS, write_checkpoint)


def test_config_reads_both_styles(checkpoint):
    name, hf, cfg, _, folder = checkpoint
    assert hf.config.layer_types == ["linear_attention", "linear_attention", "full_attention",
                                     "linear_attention", "full_attention"]
    assert cfg.arch == "kimi_linear" and cfg.kda.layers == (0, 1, 3) and cfg.kv_layers == (2, 4)
    assert (cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_size) == (2, hf.config.linear_head_dim, 4)
    assert cfg.mla.rope is False and cfg.mla.q_lora_rank == hf.config.q_lora_rank
    assert cfg.moe.first_dense_layers == 1 and cfg.moe.routed_scaling_factor == hf.config.routed_scaling_factor
    assert cfg.moe.shared_intermediate_size == 32 * hf.config.n_shared_experts
    runner = tiny_runner(checkpoint)
    # Paged KV only for the two MLA layers; per request per KDA layer a [H, D, D] fp32 state
    # and 3 windows of W - 1 inputs.
    assert runner.kv.shape[0] == 2
    D = cfg.kda.head_dim
    assert cfg.state_bytes_per_request(4) == 3 * (4 * 2 * D * D + 4 * 3 * 2 * D * 3)
    assert cfg.kv_elems_per_token == 2 * (32 + 8)
    # What the router's /server_info reports beside the KV bytes per token.
    info = read_model_info(resolve_model(str(folder)))
    assert info.kv_values_per_token == cfg.kv_elems_per_token
    assert info.state_bytes_per_request == {"bfloat16": cfg.state_bytes_per_request(2),
                                            "float32": cfg.state_bytes_per_request(4)}


def test_prefill_and_decode_logits_match_transformers(checkpoint):
    """90 prompt tokens through the chunked form (a 64-token chunk and a partial one), then six
    tokens one at a time through the one-step form."""
    _, hf, _, _, _ = checkpoint
    runner = tiny_runner(checkpoint)
    ids = PROMPTS[0] + [60, 61, 62, 63, 64, 65]
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(prefill_then_decode(runner, ids, len(PROMPTS[0])), ref, **TOL)


def test_gpu_check_step_logits_match_transformers(checkpoint):
    """The logits the moe-graphs GPU check compares (a prefill, then static decode steps, each fed
    the token before, the request in its state slot) equal transformers'."""
    _, hf, _, _, _ = checkpoint
    prompt, tokens = PROMPTS[1], [60, 61, 62, 63]
    got = step_logits(tiny_runner(checkpoint), prompt, tokens)
    torch.testing.assert_close(got, hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1:], **TOL)


def test_chunked_and_batched_prefill_equal_one_shot(checkpoint):
    _, hf, _, _, _ = checkpoint
    runner = tiny_runner(checkpoint)
    refs = [hf_logits(hf, p) for p in PROMPTS]
    seq = SeqCache()
    runner.reserve(seq, len(PROMPTS[0]))
    slot = seq.state_slot
    chunks = []
    for size in (11, 1, 40, 38):  # the state and windows carry over every border (one of 1 token)
        start = seq.length
        chunks.append(runner.extend([seq], [PROMPTS[0][start:start + size]], all_logits=True).logits)
        assert seq.state_slot == slot
    torch.testing.assert_close(torch.cat(chunks), refs[0], **TOL)
    runner.release(seq)
    # Three requests of unequal lengths in one extend, each already holding a few tokens, then
    # one decode step of all three together.
    seqs = [SeqCache() for _ in PROMPTS]
    for s, p in zip(seqs, PROMPTS):
        runner.reserve(s, len(p) + 1)
        runner.extend([s], [p[:4]])
    out = runner.extend(seqs, [p[4:] for p in PROMPTS], all_logits=True).logits
    torch.testing.assert_close(out, torch.cat([r[4:] for r in refs]), **TOL)
    step = runner.extend(seqs, [[70], [71], [72]]).logits
    ref_step = torch.stack([hf_logits(hf, p + [70 + i])[-1] for i, p in enumerate(PROMPTS)])
    torch.testing.assert_close(step, ref_step, **TOL)
    for s in seqs:
        runner.release(s)


def test_greedy_engine_matches_transformers(checkpoint):
    """Chunked prefill in the engine (chunks of 16), then static decode steps of the batch."""
    _, hf, cfg, _, _ = checkpoint
    runner = tiny_runner(checkpoint)
    engine = Engine(runner, cfg.eos_token_ids, chunk_size=16)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=10, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    engine.run_all(reqs)
    for r in reqs:
        assert r.output_ids == hf_greedy(hf, r.prompt_ids, 10)
    assert runner.pool.num_free == runner.pool.num_pages
    assert runner.state_pool.num_free == runner.state_pool.num_slots


def test_state_slots_are_admitted_held_and_returned(checkpoint):
    """Two slots for three requests: the third waits for one (pages are plentiful), outputs
    equal an engine with room for all; an aborted request's slot returns too."""
    _, _, cfg, _, _ = checkpoint
    ample = tiny_runner(checkpoint)
    ref = [Request(str(i), p, SamplingParams(max_new_tokens=5, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    Engine(ample, cfg.eos_token_ids, chunk_size=32).run_all(ref)

    runner = tiny_runner(checkpoint, state_slots=2)
    engine = Engine(runner, cfg.eos_token_ids, chunk_size=32)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=5, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add(r)
    engine.step()
    assert {r.cache.state_slot for r in reqs[:2]} == {1, 2} and reqs[2].cache.state_slot == 0
    assert list(engine.waiting) == [reqs[2]] and runner.pool.num_free == runner.pool.num_pages - sum(
        len(r.cache.pages) for r in reqs[:2])  # a request without a slot holds no pages either
    engine.run_all()
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert runner.state_pool.num_free == 2 and runner.pool.num_free == runner.pool.num_pages

    keep = Request("keep", PROMPTS[1], SamplingParams(max_new_tokens=5, ignore_eos=True))
    gone = Request("gone", PROMPTS[2], SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine.add(keep)
    engine.add(gone)
    engine.step()
    assert gone.cache.state_slot
    assert engine.abort("gone") is gone and gone.cache.state_slot == 0
    assert runner.state_pool.num_free == 1
    engine.run_all()
    assert keep.output_ids == ref[1].output_ids
    assert runner.state_pool.num_free == 2 and runner.pool.num_free == runner.pool.num_pages
    runner.state_pool.check_integrity()


def test_state_slots_option_reaches_the_services():
    import argparse

    from common.service.loader import ModelOptions, add_model_args
    from common.tools import up

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert ModelOptions.from_args(p.parse_args(["--state-slots", "3"])).state_slots == 3
    p = argparse.ArgumentParser()
    up.add_args(p)
    flags = up.model_flags(p.parse_args(["--state-slots", "5"]))
    assert flags[flags.index("--state-slots") + 1] == "5"


def test_state_pool_never_hands_out_slot_0():
    pool = StatePool(3)
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [1, 2, 3]
    with pytest.raises(OutOfStateSlots):
        pool.alloc()
    pool.free(2)
    assert pool.alloc() == 2
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(0)
    pool.check_integrity()


def test_negative_controls_are_caught(checkpoint):
    """The comparisons above would notice decode starting from a zeroed state (the prompt's
    state lost, as a transfer that never arrived leaves it), and the hand-off token applied
    twice (harmless to a KV cache, which overwrites the same slot; a recurrent state absorbs it
    again). Both runs reach the same positions as the reference."""
    _, hf, _, _, _ = checkpoint
    ids = PROMPTS[0] + [60, 61]
    ref = hf_logits(hf, ids)[-1]
    runner = tiny_runner(checkpoint)

    def decode_after(tamper) -> torch.Tensor:
        seq = SeqCache()
        runner.reserve(seq, len(ids) + 1)
        runner.extend([seq], [PROMPTS[0]])
        runner.extend([seq], [[60]])
        tamper(seq)
        logits = runner.extend([seq], [[61]]).logits[0]
        runner.release(seq)
        return logits

    torch.testing.assert_close(decode_after(lambda seq: None), ref, **TOL)  # untampered: equal

    def zero_state(seq: SeqCache) -> None:
        runner.cache.recurrent[:, seq.state_slot].zero_()

    def hand_off_twice(seq: SeqCache) -> None:
        seq.length -= 1  # position of token 60 again (truncate refuses this for a recurrent state)
        runner.extend([seq], [[60]])

    for tamper in (zero_state, hand_off_twice):
        assert not torch.allclose(decode_after(tamper), ref, **TOL), tamper.__name__


def test_recurrent_state_cannot_be_cut_back(checkpoint):
    runner = tiny_runner(checkpoint)
    seq = SeqCache()
    runner.reserve(seq, 8)
    runner.extend([seq], [[5, 6, 7]])
    with pytest.raises(ValueError, match="cut back"):
        runner.truncate(seq, 2)
    runner.release(seq)


def test_unsupported_config_is_refused(checkpoint):
    _, _, cfg, _, _ = checkpoint
    raw = {"model_type": "kimi_linear", "num_hidden_layers": 2, "mla_use_nope": False,
           "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "gate_lower_bound": -5.0},
           "layer_types": ["full_attention", "linear_attention"]}
    with pytest.raises(ValueError, match="mla_use_nope.*gate_lower_bound.*disagree"):
        ModelConfig.from_hf(raw, "x")
    with pytest.raises(ParallelConfigError, match="2 KDA heads do not split over TP 4"):
        check_parallel(cfg, tp=4, pp=2)


def test_tensor_parallel_equals_transformers(checkpoint):
    """TP 2: each rank one KDA head (its slice of every state and window), half the MLA query
    heads, half of each expert's width. Prefill and decode logits equal transformers', greedy
    output through the Engine (static decode steps, state slots in the batch) equals one
    process's."""
    _, hf, cfg, tensors, _ = checkpoint
    ids = PROMPTS[0] + [60, 61, 62]
    ref = hf_logits(hf, ids)
    single = [Request(str(i), p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    Engine(tiny_runner(checkpoint), cfg.eos_token_ids, chunk_size=32).run_all(single)
    runner = ParallelRunner(cfg, tensors, tp=2, num_pages=64, page_size=8, state_slots=4)
    try:
        torch.testing.assert_close(prefill_then_decode(runner, ids, len(PROMPTS[0])), ref, **TOL)
        reqs = [Request(str(i), p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
        Engine(runner, cfg.eos_token_ids, chunk_size=32).run_all(reqs)
        assert [r.output_ids for r in reqs] == [r.output_ids for r in single]
        assert runner.state_pool.num_free == 4
    finally:
        runner.close()



def test_kda_decode_step_reads_nothing_on_the_host():
    """A decode step's KDA layer (one token per row, state slots by device index) runs on the meta
    device, where any op reading a value on the host would fail: a CUDA graph can capture it."""
    from common.model.attention import AttnMeta
    from common.model.kda import KimiDeltaAttention
    from common.model.shapes import SHAPES

    cfg = SHAPES["kimi-linear-small"]
    k = cfg.kda
    with torch.device("meta"):
        kda = KimiDeltaAttention(cfg).to(torch.bfloat16)
        x = torch.randn(3, cfg.hidden_size, dtype=torch.bfloat16)
        recurrent = torch.zeros(5, k.num_heads, k.head_dim, k.head_dim)
        conv = torch.zeros(5, 3 * k.proj_size, k.conv_size - 1, dtype=torch.bfloat16)
        rows = torch.arange(3)
        meta = AttnMeta(positions=rows, write_slots=rows, logit_rows=None, state_slots=rows + 1)
    assert kda(x, recurrent, conv, meta).shape == x.shape
