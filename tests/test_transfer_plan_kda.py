"""The transfer plan for a Kimi-Linear room (MLA latent pages, KDA recurrent states and
convolution windows, the drafter's KV), without running a model.

Applied in memory (test_transfer_plan_parallel.transfer: every D rank must hold exactly its
heads' slices, each byte written once) for every P TP / D TP pair in {1, 2, 4} x {1, 2, 4} and
for pipeline stages; and built for the users' topology (P: TP4 / PP8 / EP4, D: TP32 / EP4 over
Kimi-Linear-48B's shapes) from the descriptions the runners publish (common.runner.describe),
which the deploy profile of that topology names.
"""
from __future__ import annotations

import pytest

from common.kv.buffers import PagedKVBuffer, RoomBuffers
from common.model.config import ModelConfig
from common.runner.describe import CacheAddrs, describe_rank
from common.runner.layout import RankLayout, check_parallel
from common.transfer.plan import TPRank, build_plan, source_ranks
from parallel_kv import KVSpec, Split, StateSpec, heads_of
from test_deploy import config as deploy_config, dry_run
from test_transfer_plan_parallel import transfer

# Latent KV of 2 MLA layers; 3 KDA layers of 4 heads: recurrent state (one part) and q, k, v
# convolution windows (three parts, each split by head); the drafter's KV on one rank.
KDA_SPECS = (KVSpec("kv", 2, 0, 16), StateSpec("kda_state", 3, 4, 64), StateSpec("kda_conv", 3, 4, 24, parts=3),
             KVSpec("draft_kv", 1, 4, 8, staged=False))


@pytest.mark.parametrize("tp_p,tp_d", [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)])
def test_every_tp_pair_moves_each_state_head_once(tp_p, tp_d):
    out = transfer(Split(tp_p, tp_d, KDA_SPECS, num_tokens=9))  # checks every D rank's bytes and write counts
    for d_rank in range(tp_d):
        state_from = source_ranks(d_rank, heads_of(KDA_SPECS[1], d_rank, tp_d), tp_p, 4)
        # The KDA heads come from every P rank holding one of them; the latent pages from one.
        assert state_from == [r for r in range(tp_p) if set(heads_of(KDA_SPECS[1], r, tp_p))
                              & set(heads_of(KDA_SPECS[1], d_rank, tp_d))]
        assert out.senders(d_rank) == sorted(set(state_from) | {d_rank % tp_p})


@pytest.mark.parametrize("pp,tp_p,tp_d", [(2, 2, 1), (3, 1, 4), (3, 4, 2)])
def test_pipeline_stages_send_their_layers_states(pp, tp_p, tp_d):
    """3 KDA layers over 2 or 3 stages, 2 MLA layers (a stage of PP 3 holds none of them)."""
    out = transfer(Split(tp_p, tp_d, KDA_SPECS, pp=pp, num_tokens=11))
    for d_rank in range(tp_d):
        assert {out.split.p_ranks()[p][0] for p in out.senders(d_rank)} == set(range(pp))


# Kimi-Linear-48B-A3B's config.json (the model's own style; vocabulary and context trimmed, which
# no buffer depends on).
KIMI_LINEAR_48B = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 9216, "rms_norm_eps": 1e-5,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "moe_intermediate_size": 1024, "first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "routed_scaling_factor": 2.446, "num_expert_group": 1, "topk_group": 1,
    "tie_word_embeddings": False, "model_max_length": 1048576,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
                           "short_conv_kernel_size": 4},
}
PROFILE = "pd-8node-kimi-linear"
PAGE, PAGES, SLOTS, TOKENS = 64, 300, 8, 16384 + 5  # a 16K prompt, its last page partly filled
DRAFT_HEADS, DRAFT_DIM = 32, 128  # a GQA drafter for an MLA target (DrafterConfig.for_target)


def _rank_buffers(cfg: ModelConfig, layout: RankLayout, draft: bool) -> RoomBuffers:
    """What rank `layout.rank` publishes, at made-up addresses far apart."""
    base = (layout.rank + 1) << 44
    buffers = describe_rank(cfg, layout, CacheAddrs(base, base + (1 << 40), base + (2 << 40)), num_pages=PAGES + 1,
                            page_size=PAGE, state_slots=SLOTS, dtype="bfloat16")
    if draft:
        buffers.append(PagedKVBuffer("draft_kv", base + (3 << 40), 1, PAGES + 1, PAGE, DRAFT_HEADS, 0, DRAFT_HEADS,
                                     DRAFT_DIM, "bfloat16"))
    pages = list(range(PAGES - 1, PAGES - 1 - -(-TOKENS // PAGE), -1))  # not simply 0..n-1
    return RoomBuffers(buffers, {"kv": pages, "draft_kv": pages, "kda_state": [3], "kda_conv": [3]})


def test_users_topology_tp4_pp8_to_tp32():
    """The profile's split passes the dry run and fits the model; then every (P rank, D rank)
    plan: each D rank gets the latent pages of every MLA layer once, whole pages, from TP rank
    d % 4 of each stage holding MLA layers; its one KDA head of every KDA layer's state and of
    each of the q, k and v windows from the one P rank per stage holding that head; D rank 0
    the drafter's KV from the last stage. Bytes per D rank are what the shapes say."""
    assert dry_run("all", PROFILE)[0] == 0
    deploy, _ = deploy_config(PROFILE)
    p_tp, p_pp, p_ep = (int(deploy[f"PREFILL_{k}"]) for k in ("TP", "PP", "EP"))
    d_tp, d_ep = int(deploy["DECODE_TP"]), int(deploy["DECODE_EP"])
    assert (p_tp, p_pp, p_ep, d_tp, d_ep) == (4, 8, 4, 32, 4)
    cfg = ModelConfig.from_hf(KIMI_LINEAR_48B, deploy["MODEL_NAME"])
    check_parallel(cfg, p_tp, p_pp, p_ep)
    check_parallel(cfg, d_tp, 1, d_ep)

    p_layouts = [RankLayout(p_tp, p_pp, r, p_ep) for r in range(p_tp * p_pp)]
    src = [_rank_buffers(cfg, lay, draft=lay.is_last_stage and lay.tp_rank == 0) for lay in p_layouts]
    dst = [_rank_buffers(cfg, RankLayout(d_tp, 1, r, d_ep), draft=r == 0) for r in range(d_tp)]
    latent_page = PAGE * (512 + 64) * 2
    d, kda_layers, mla_layers = 128, 20, 7
    n_pages = -(-TOKENS // PAGE)
    for d_rank, d_room in enumerate(dst):
        got: dict[str, int] = {}
        senders: dict[str, set[int]] = {}
        for p_rank, (lay, p_room) in enumerate(zip(p_layouts, src)):
            names = {b.name for b in p_room.buffers} & {b.name for b in d_room.buffers}
            for name in names:
                plan = build_plan("users", RoomBuffers([b for b in p_room.buffers if b.name == name], p_room.indices),
                                  RoomBuffers([b for b in d_room.buffers if b.name == name], d_room.indices), TOKENS,
                                  src_tp=TPRank(lay.tp_rank, p_tp), dst_tp=TPRank(d_rank, d_tp))
                if plan.entries:
                    got[name] = got.get(name, 0) + plan.total_bytes
                    senders.setdefault(name, set()).add(p_rank)
                if name == "kv":
                    assert all(e.length % latent_page == 0 for e in plan.entries)
        holder = d_rank // 8  # P's TP rank holding KDA head d_rank (8 heads per P rank)
        kda_stages = {lay.stage for lay in p_layouts if lay.kda_layers(cfg)}
        mla_stages = {lay.stage for lay in p_layouts if lay.kv_layers(cfg)}
        assert kda_stages == set(range(8)) and mla_stages == {0, 1, 2, 4, 5, 6, 7}  # stage 3: layers 12-14, all KDA
        assert senders["kda_state"] == senders["kda_conv"] == {s * p_tp + holder for s in kda_stages}
        assert senders["kv"] == {s * p_tp + d_rank % p_tp for s in mla_stages}
        assert got["kv"] == mla_layers * n_pages * latent_page
        assert got["kda_state"] == kda_layers * d * d * 4
        assert got["kda_conv"] == kda_layers * 3 * d * 3 * 2
        if d_rank == 0:
            assert senders["draft_kv"] == {7 * p_tp} and got["draft_kv"] == 2 * n_pages * PAGE * DRAFT_HEADS * DRAFT_DIM * 2
        else:
            assert "draft_kv" not in got
