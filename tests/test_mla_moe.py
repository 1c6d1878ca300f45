"""DeepSeek-V3 architecture (MLA + MoE) against transformers' DeepseekV3ForCausalLM.

Tiny random-weight checkpoints are written as Hugging Face folders (3 layers: one dense MLP, two
MoE; grouped routing; q-LoRA on and off; YaRN with both mscales in one), read back through
common.model.weights, and compared in fp32: prefill and decode logits, chunked against one-shot
prefill, batched extends of unequal lengths, and greedy generation through the Engine (whose
decode runs the static path: absorbed attention over the latent pages). Negative controls show
that a shifted latent page or a perturbed router bias would be caught.

Tensor parallelism (worker processes, gloo) splits the query heads, kv_b_proj, o_proj and every
expert's width, and keeps the latent projection whole: its logits and latent KV equal one
process's. The PD transfer plan, built from the runners' own buffer descriptions, moves whole
latent pages from exactly one P rank to each D rank, and D decodes on from them as one process
would."""
from __future__ import annotations

import ctypes
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from common.dflash.drafter import Drafter
from common.dflash.proposer import DFlashProposer
from common.engine.engine import Engine
from common.engine.meta import meta_info
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig
from common.kv.seq_cache import SeqCache
from common.kv.buffers import RoomBuffers
from common.model.attention import cache_slot
from common.model import moe as moe_module
from common.model.moe import MoE
from common.model.shapes import SHAPES, RandomWeights, fill_random_
from common.model.source import resolve_model
from common.parallel.driver import ParallelRunner
from common.runner.layout import ParallelConfigError, RankLayout, check_parallel
from common.runner.model_runner import ModelRunner
from common.runner.shard import shard_tensors
from common.tools.bench import stats
from common.tools.tiny_hf import DEEPSEEK_VARIANTS as VARIANTS, write_deepseek as write_checkpoint
from common.transfer.plan import TPRank, build_plan, source_ranks
from router_svc.model_info import read_model_info
from hf_oracle import checkpoint_fixture, hf_greedy, hf_logits, prefill_then_decode, tiny_runner
from test_parallel_runner import FP32_TOL, check_parallel_equals_single
from tiny_models import save_random_drafter

TOL = dict(rtol=1e-4, atol=1e-4)
PROMPTS = [list(range(3, 3 + 41)), [7, 9, 11, 200, 13, 5, 99, 42, 17], [5] * 3 + list(range(100, 160))]

checkpoint = checkpoint_fixture(VARIANTS, write_checkpoint)


def test_config_and_latent_kv_layout(checkpoint):
    name, hf, cfg, _, folder = checkpoint
    assert cfg.arch == "deepseek_v3" and cfg.mla.q_lora_rank == hf.config.q_lora_rank
    assert (cfg.moe.num_groups, cfg.moe.topk_groups) == (hf.config.n_group, hf.config.topk_group)
    assert cfg.mla.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    runner = tiny_runner(checkpoint)
    (buf,) = runner.describe_buffers()
    # One latent "head" of kv_lora_rank + rope dims per token and layer, one plane.
    assert (buf.kv_planes, buf.num_heads, buf.total_heads, buf.head_dim) == (1, 1, 1, 32 + 8)
    assert buf.token_bytes == 40 * 4
    assert cfg.kv_elems_per_token * 4 == buf.num_layers * buf.token_bytes
    assert runner.kv.shape == (3, 1, 65, 8, 1, 40)
    # What the router's /server_info reports (x dtype bytes), read from the folder's config alone.
    assert read_model_info(resolve_model(str(folder))).kv_values_per_token == 3 * 40


def test_prefill_and_decode_logits_match_transformers(checkpoint):
    _, hf, _, _, _ = checkpoint
    runner = tiny_runner(checkpoint)
    ids = PROMPTS[0] + [60, 61, 62, 63, 64, 65]
    ref = hf_logits(hf, ids)
    # The prompt through expanded attention, then absorbed attention one token at a time.
    torch.testing.assert_close(prefill_then_decode(runner, ids, len(PROMPTS[0])), ref, **TOL)


def test_dense_experts_match_transformers(checkpoint, monkeypatch):
    """The whole model with its experts on the dense path (where grouped_mm does not run: fp32
    on CUDA) still equals transformers in prefill and decode."""
    _, hf, _, _, _ = checkpoint
    monkeypatch.setattr(MoE, "grouped_ok", lambda self, device, dtype: False)
    ids = PROMPTS[1] + [60, 61, 62]
    torch.testing.assert_close(prefill_then_decode(tiny_runner(checkpoint), ids, len(PROMPTS[1])),
                               hf_logits(hf, ids), **TOL)


def test_chunked_and_batched_prefill_equal_one_shot(checkpoint):
    _, hf, _, _, _ = checkpoint
    runner = tiny_runner(checkpoint)
    refs = [hf_logits(hf, p) for p in PROMPTS]
    seq = SeqCache()
    runner.reserve(seq, len(PROMPTS[2]))
    chunks = [runner.extend([seq], [PROMPTS[2][i:i + 11]], all_logits=True).logits
              for i in range(0, len(PROMPTS[2]), 11)]
    torch.testing.assert_close(torch.cat(chunks), refs[2], **TOL)
    runner.release(seq)
    # Three requests of unequal lengths in one extend, each already holding a few tokens.
    seqs = [SeqCache() for _ in PROMPTS]
    for s, p in zip(seqs, PROMPTS):
        runner.reserve(s, len(p))
        runner.extend([s], [p[:4]])
    out = runner.extend(seqs, [p[4:] for p in PROMPTS], all_logits=True).logits
    torch.testing.assert_close(out, torch.cat([r[4:] for r in refs]), **TOL)
    for s in seqs:
        runner.release(s)


def test_greedy_engine_matches_transformers(checkpoint):
    _, hf, cfg, _, _ = checkpoint
    runner = tiny_runner(checkpoint)
    engine = Engine(runner, cfg.eos_token_ids, chunk_size=16)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    engine.run_all(reqs)
    for r in reqs:
        assert r.output_ids == hf_greedy(hf, r.prompt_ids, 12)
    assert runner.pool.num_free == runner.pool.num_pages


def test_dflash_greedy_equals_plain(checkpoint, tmp_path):
    """--spec dflash with this target (a GQA drafter reading the MLA/MoE target's hidden states
    at layers 0 and 2) gives the plain greedy output: verify runs blocks through the absorbed
    latent attention and rolls rejected tokens back. Random drafters rarely guess right, so
    seeds are tried until one has drafts accepted (the accept path: kept draft tokens, their
    latent KV and draft KV), each of them lossless."""
    _, _, cfg, _, _ = checkpoint
    runner = tiny_runner(checkpoint)

    def run(**spec) -> list[Request]:
        reqs = [Request(str(i), p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
        Engine(runner, cfg.eos_token_ids, chunk_size=16, **spec).run_all(reqs)
        return reqs

    plain = [r.output_ids for r in run()]
    for seed in range(40):
        drafter = Drafter.load(save_random_drafter(cfg, (0, 2), str(tmp_path / str(seed)), seed=seed))
        reqs = run(proposer=DFlashProposer(drafter, runner, runner.pool.num_pages), spec=SpecConfig(block=4))
        assert [r.output_ids for r in reqs] == plain, f"drafter seed {seed}"
        assert all(stats.check_invariants(meta_info(r)) == [] for r in reqs)
        if sum(r.spec.accepted_drafts for r in reqs):
            break
    else:
        pytest.fail("no random drafter had a draft accepted: the accept path went untested")
    assert runner.pool.num_free == runner.pool.num_pages


def test_negative_controls_are_caught(checkpoint):
    """The comparisons above would notice a latent cache shifted by one token, and a router that
    chooses differently (a perturbed correction bias)."""
    _, hf, cfg, tensors, _ = checkpoint
    ids = PROMPTS[0] + [60]
    ref = hf_logits(hf, ids)[-1]
    runner = tiny_runner(checkpoint)
    seq = SeqCache()
    runner.reserve(seq, len(ids))
    runner.extend([seq], [PROMPTS[0]])
    # Every layer's cached prompt one token late (as a transfer off by one token would leave it):
    # the first token twice, the last one lost. (Reordering keys alone would not show: their
    # positions are already rotated into them.)
    slots = torch.tensor([cache_slot(seq.pages, p, runner.page_size) for p in range(seq.length)])
    flat = runner.kv.flatten(2, 3)
    flat[:, :, slots[1:]] = flat[:, :, slots[:-1]].clone()
    shifted = runner.extend([seq], [[60]]).logits[0]
    runner.release(seq)
    assert not torch.allclose(shifted, ref, **TOL)

    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    perturbed = dict(tensors, **{bias: tensors[bias] + torch.linspace(-1, 1, cfg.moe.num_experts)})
    runner = ModelRunner(cfg, perturbed, num_pages=64, page_size=8)
    seq = SeqCache()
    runner.reserve(seq, len(ids))
    got = runner.extend([seq], [ids], all_logits=True).logits
    assert not torch.allclose(got, hf_logits(hf, ids), **TOL)


def experts_one_by_one(moe: MoE, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum as the definition says it, token by token and choice by choice
    in fp32 (the reference: it reads the routing on the host, so no CUDA graph could capture it)."""
    held = moe.moe.held_experts
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t, (chosen, w) in enumerate(zip(experts.tolist(), weights.tolist())):
        for e, we in zip(chosen, w):
            if e in held:
                gate, up = (moe.gate_up[e - held.start].float() @ x[t].float()).chunk(2)
                out[t] += we * (moe.down[e - held.start].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)


@pytest.mark.parametrize("path", ["grouped", "dense"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, dict(rtol=1e-5, atol=5e-5)),
                                       (torch.bfloat16, dict(rtol=2e-2, atol=0.25))])
def test_expert_paths_equal_the_definition(path, dtype, tol):
    """Both expert paths (grouped matmuls over pairs sorted on the device; every expert over
    every token, weighted: what CUDA graphs capture where grouped_mm does not run) equal the
    experts applied one by one, with every expert held and on each EP rank's half, where pairs
    routed to the other half must add nothing; the halves sum to the whole. In fp32 the two
    paths agree to rounding (~1e-6 of values up to ~40)."""
    cfg = SHAPES["deepseek-small"]
    n = cfg.moe.num_experts // 2
    moe = fill_random_(MoE(cfg), RandomWeights(seed=1, std=0.2)).to(dtype)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    experts, weights = moe.route(x)
    assert moe.grouped_ok(x.device, dtype) and experts.unique().numel() > n  # both halves are used
    run = {"grouped": MoE.run_grouped, "dense": MoE.run_dense}[path]
    whole = run(moe, x, experts, weights)
    torch.testing.assert_close(whole, experts_one_by_one(moe, x, experts, weights), **tol)
    if dtype == torch.float32:
        torch.testing.assert_close(MoE.run_dense(moe, x, experts, weights), MoE.run_grouped(moe, x, experts, weights),
                                   rtol=1e-5, atol=5e-5)
    halves = []
    for first in (0, n):
        half = MoE(replace(cfg, moe=replace(cfg.moe, first_expert=first, local_experts=n))).to(dtype)
        half.load_state_dict(moe.state_dict() | {"gate_up": moe.gate_up[first:first + n],
                                                 "down": moe.down[first:first + n]})
        halves.append(run(half, x, experts, weights))
        torch.testing.assert_close(halves[-1], experts_one_by_one(half, x, experts, weights), **tol)
    assert not torch.allclose(halves[0].float(), whole.float(), **tol)
    torch.testing.assert_close(halves[0] + halves[1], whole, **tol)


def test_dense_experts_slice_long_inputs(monkeypatch):
    """A prompt longer than one slice of the dense path gives what one slice gives."""
    cfg = SHAPES["deepseek-small"]
    moe = fill_random_(MoE(cfg), RandomWeights(seed=1, std=0.2))
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    experts, weights = moe.route(x)
    whole = moe.run_dense(x, experts, weights)
    monkeypatch.setattr(moe_module, "DENSE_SLICE_BYTES", 1)  # one token a slice
    torch.testing.assert_close(moe.run_dense(x, experts, weights), whole, rtol=1e-5, atol=5e-5)


def test_expert_paths_read_nothing_on_the_host():
    """On the meta device no value exists, so an op that would read one on the host (and break a
    CUDA graph's capture) fails: both expert paths run there, the reference does not."""
    cfg = SHAPES["deepseek-small"]
    with torch.device("meta"):
        moe = MoE(cfg).to(torch.bfloat16)
        x = torch.randn(5, cfg.hidden_size, dtype=torch.bfloat16)
    experts, weights = moe.route(x)
    assert moe.run_grouped(x, experts, weights).shape == x.shape
    assert moe.run_dense(x, experts, weights).shape == x.shape
    with pytest.raises(NotImplementedError):
        experts_one_by_one(moe, x, experts, weights)


def test_unsupported_config_is_refused():
    from common.model.config import ModelConfig

    raw = {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}, "moe_layer_freq": 2}
    with pytest.raises(ValueError, match="quantization_config.*moe_layer_freq 2"):
        ModelConfig.from_hf(raw, "x")


def _prefill(runner: ModelRunner, chunks: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of every token of the chunks prefilled in turn, and the KV pages they fill as
    each rank holds them (rank order; one process: one)."""
    seq = SeqCache()
    runner.reserve(seq, sum(map(len, chunks)))
    logits = torch.cat([runner.extend([seq], [c], all_logits=True).logits for c in chunks])
    pages = list(seq.pages)
    # ParallelRunner.read_pages() overlays the ranks' parts, so the replicated latent of only
    # one rank would show: read every rank's own.
    kv = [ModelRunner.read_pages(runner, pages)]
    if isinstance(runner, ParallelRunner):
        kv += runner._read_all("kv", pages)
    runner.release(seq)
    return logits, kv


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (4, 1, 2), (2, 2, 2)])
def test_tensor_parallel_equals_one_process(checkpoint, tp, pp, ep):
    """TP (and with EP the routed experts sharded over the TP ranks: EP 2 of TP 4 also splits
    each expert's width over 2 ranks; with PP 2 each stage's TP group shards its own layers'
    experts) gives one process's logits and latent KV."""
    _, _, cfg, tensors, _ = checkpoint
    chunks = [PROMPTS[2][:20], PROMPTS[2][20:31]]
    want_logits, want_kv = _prefill(tiny_runner(checkpoint), chunks)
    runner = ParallelRunner(cfg, tensors, tp=tp, pp=pp, ep=ep, num_pages=16, page_size=8)
    try:
        logits, kv = _prefill(runner, chunks)
        torch.testing.assert_close(logits, want_logits, **TOL)
        for rank, part in enumerate(kv):  # every rank holds its stage's layers of the whole latent cache
            layers = RankLayout(tp, pp, rank).layers(cfg)
            torch.testing.assert_close(part, want_kv[0][layers.start:layers.stop], **TOL)
        if (tp, pp, ep) == (2, 1, 2):  # decode (the static path) through the engine, greedy
            reqs = [Request(str(i), p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
            Engine(runner, cfg.eos_token_ids, chunk_size=16).run_all(reqs)
            ref = [Request(str(i), p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
            Engine(tiny_runner(checkpoint), cfg.eos_token_ids, chunk_size=16).run_all(ref)
            assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    finally:
        runner.close()


def test_pipeline_parallel_equals_one_process(checkpoint, tmp_path):
    """PP 2 (layers [0, 1] | [2]) and PP 3 (a layer per stage): each stage holds its layers'
    latent cache and MLA/MoE weights; logits, latent KV and the DFlash draft KV built from the
    hidden states captured on every stage (their fc partial sums travel down the pipeline)
    equal one process's."""
    _, _, cfg, tensors, _ = checkpoint
    drafter = save_random_drafter(cfg, (0, 1, 2), str(tmp_path / "drafter"))
    check_parallel_equals_single(cfg, tensors, drafter, [(1, 2), (1, 3)], "fp32", FP32_TOL)


def test_expert_parallel_shards_and_is_not_vacuous(checkpoint):
    """The EP ranks hold disjoint halves of the experts (and only those weights), and the prompt
    the EP test prefills routes tokens to both halves in every MoE layer, so that a rank whose
    experts were lost or counted twice would change the logits."""
    _, _, cfg, tensors, _ = checkpoint
    held = [RankLayout(2, 1, r, ep=2).local_config(cfg).moe.held_experts for r in range(2)]
    assert held == [range(0, 4), range(4, 8)]
    keys = shard_tensors(tensors, cfg, RankLayout(2, 1, 1, ep=2))
    assert {int(k.split(".")[5]) for k in keys if ".mlp.experts." in k} == {4, 5, 6, 7}
    runner = tiny_runner(checkpoint)
    chosen = []
    for layer in runner.model.layers[cfg.moe.first_dense_layers:]:
        layer.mlp.register_forward_hook(lambda mod, args, out: chosen.append(mod.route(args[0])[0]))
    _prefill(runner, [PROMPTS[2][:31]])
    assert len(chosen) == cfg.num_layers - cfg.moe.first_dense_layers
    for experts in chosen:
        assert (experts < 4).any() and (experts >= 4).any()


def test_expert_parallel_refused_where_it_does_not_fit(checkpoint):
    from dataclasses import replace

    _, _, cfg, _, _ = checkpoint
    with pytest.raises(ParallelConfigError, match="EP 3 does not divide TP 2"):
        check_parallel(cfg, tp=2, ep=3)
    with pytest.raises(ParallelConfigError, match="EP 2 does not divide TP 1"):
        check_parallel(cfg, tp=1, ep=2)
    with pytest.raises(ParallelConfigError, match="6 routed experts do not split over EP 4"):
        check_parallel(replace(cfg, moe=replace(cfg.moe, num_experts=6)), tp=4, ep=4)
    with pytest.raises(ParallelConfigError, match="EP 2 needs a model with routed experts"):
        check_parallel(replace(cfg, moe=None), tp=2, ep=2)


@pytest.mark.parametrize("flags,message", [
    (["--decode-ep", "2"], "--decode-ep 2 must divide --decode-tp 1"),
    (["--prefill-tp", "4", "--prefill-ep", "3"], "--prefill-ep 3 must divide --prefill-tp 4"),
    (["--mode", "colocated", "--prefill-ep", "2"], "apply to --mode pd"),
    (["--decode", "2", "--decode-tp", "2,4", "--decode-ep", "4"], "--decode-ep 4 must divide --decode-tp 2"),
    (["--prefill", "2", "--prefill-tp", "1,2,4"], "--prefill-tp gives 3 sizes for 2 prefill instances"),
])
def test_up_refuses_ep_that_does_not_divide_tp(flags, message):
    """Before it starts anything (whether EP divides the model's experts each instance checks
    when it loads the model, with check_parallel above); per-instance sizes (N,M,...) likewise,
    and their count must be the instances'."""
    import argparse

    from common.tools import up

    p = argparse.ArgumentParser()
    up.add_args(p)
    with pytest.raises(ValueError, match=re.escape(message)):
        up.run(p.parse_args(flags))


def _copy(entries) -> None:
    for e in entries:
        ctypes.memmove(e.dst_addr, e.src_addr, e.length)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)])
def test_pd_plan_sends_whole_latent_pages_from_one_p_rank(checkpoint, tp_p, tp_d):
    """Each rank's runner (its layout's share of the weights, its own latent cache) describes
    its buffers; P ranks hold the prompt's latent pages (the same on every rank, as the TP test
    shows), at other page numbers than D's. The plans are applied as memory copies at the
    addresses they name. Then every D rank holds one process's latent KV, and a D of TP 1
    decodes on exactly as one process does; D pages given in a shifted order are caught."""
    _, _, cfg, tensors, _ = checkpoint
    prompt, more = PROMPTS[2], [60, 61, 62]
    single = tiny_runner(checkpoint)
    seq = SeqCache()
    single.reserve(seq, len(prompt) + len(more))
    single.extend([seq], [prompt])
    want_kv = single.read_pages(list(seq.pages))

    def rank_runners(tp: int, skip: int) -> list[tuple[ModelRunner, SeqCache]]:
        out = []
        for r in range(tp):
            runner = ModelRunner(cfg, tensors, num_pages=64, page_size=8, layout=RankLayout(tp, 1, r))
            runner.reserve(SeqCache(), skip)  # pages numbered unlike the single process's
            s = SeqCache()
            runner.reserve(s, len(prompt) + len(more))
            out.append((runner, s))
        return out

    p_side, d_side = rank_runners(tp_p, 3 * 8), rank_runners(tp_d, 5 * 8)
    for runner, s in p_side:
        runner.kv[:, :, s.pages] = single.kv[:, :, seq.pages]

    def plans(d_pages: list[int] | None = None):
        for d_rank, (d_runner, d_seq) in enumerate(d_side):
            dst = RoomBuffers(d_runner.describe_buffers(), {"kv": d_pages or list(d_seq.pages)})
            senders = []
            for p_rank, (p_runner, p_seq) in enumerate(p_side):
                src = RoomBuffers(p_runner.describe_buffers(), {"kv": list(p_seq.pages)})
                plan = build_plan("room", src, dst, len(prompt), src_tp=TPRank(p_rank, tp_p), dst_tp=TPRank(d_rank, tp_d))
                if plan.entries:
                    senders.append(p_rank)
                    page_bytes = d_runner.describe_buffers()[0].bytes_per_page
                    assert all(e.length % page_bytes == 0 for e in plan.entries)  # whole pages, no head slicing
                    yield plan
            assert senders == [d_rank % tp_p] == source_ranks(d_rank, range(1), tp_p, 1)

    for plan in plans():
        _copy(plan.entries)
    for d_runner, d_seq in d_side:
        assert torch.equal(d_runner.read_pages(list(d_seq.pages)), want_kv)
    if tp_d > 1:
        return
    d_runner, d_seq = d_side[0]
    d_seq.length = len(prompt)
    seq_want = torch.cat([single.extend([seq], [[t]]).logits for t in more])
    torch.testing.assert_close(torch.cat([d_runner.extend([d_seq], [[t]]).logits for t in more]), seq_want, **TOL)
    # Negative control: the same transfer into D's pages listed in a rotated order.
    d_runner.kv.zero_()
    pages = list(d_seq.pages)
    for plan in plans(pages[1:] + pages[:1]):
        _copy(plan.entries)
    d_seq.length = len(prompt)
    got = torch.cat([d_runner.extend([d_seq], [[t]]).logits for t in more])
    assert not torch.allclose(got, seq_want, **TOL)


def test_gguf_model_info_kv_values_match_its_config(embedded_source, embedded_weights):
    """The router reads GGUF headers on its own: it must agree with the config the runner uses."""
    assert read_model_info(embedded_source).kv_values_per_token == embedded_weights[0].kv_elems_per_token == 30 * 2 * 3 * 64
