"""Cut a model's Hugging Face-named weights down to what one rank holds (common.runner.layout).

Layers outside the rank's pipeline stage are dropped and the rest renumbered from 0, so the
result loads into a Transformer built from `layout.local_config(cfg)` exactly as a whole model
does. Tensor parallel slices: q/k/v (and their biases) by head, gate/up by MLP width (column
parallel); o_proj and down_proj along their input (row parallel; they have no bias, so the
all-reduce of the partial outputs is the whole result). Embedding, final norm and LM head are
replicated on every rank.

MLA (as SGLang splits it): the query (q_proj, or q_b_proj after the replicated q-LoRA input),
kv_b_proj and o_proj by head; the latent projection kv_a_proj_with_mqa and its norm whole on
every rank, so every rank writes the same latent cache. MoE: the router whole; the shared
experts split by width like the dense MLP; of the routed experts a rank keeps only those of its
expert-parallel group (RankLayout.experts), each split by width over TP / EP ranks. Either way
each rank's output is a partial sum that the TP all-reduce completes.

KDA (Kimi-Linear) by head (RankLayout.kda_heads): the q/k/v projections and their convolutions,
the forget gate's f_b_proj, dt_bias and A_log, beta's b_proj and the output gate's g_b_proj by
output rows, o_proj by input columns; the low-rank inputs f_a_proj and g_a_proj and the per-head
o_norm whole. Each rank then holds its heads' states, and its o_proj output is a partial sum.
"""
from __future__ import annotations

import re

import torch

from common.model.config import ModelConfig
from common.runner.layout import RankLayout

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"experts\.(\d+)\.")


def shard_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, layout: RankLayout) -> dict[str, torch.Tensor]:
    layers = layout.layers(cfg)
    q, kv = layout.q_heads(cfg), layout.kv_heads(cfg)
    d = cfg.head_dim
    width = cfg.intermediate_size // layout.tp
    cols = {  # parameter -> (dim, start, stop) of the slice this rank keeps
        "self_attn.q_proj": (0, q.start * d, q.stop * d),
        "self_attn.k_proj": (0, kv.start * d, kv.stop * d),
        "self_attn.v_proj": (0, kv.start * d, kv.stop * d),
        "self_attn.o_proj": (1, q.start * d, q.stop * d),
        **_mlp_cols("mlp.", layout.tp_rank, width),
    }
    if cfg.mla is not None:
        kv_b, v = cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim, cfg.mla.v_head_dim
        cols |= {"self_attn.q_b_proj": (0, q.start * d, q.stop * d),
                 "self_attn.kv_b_proj": (0, q.start * kv_b, q.stop * kv_b),
                 "self_attn.o_proj": (1, q.start * v, q.stop * v)}
    experts = range(0)
    if cfg.moe is not None:
        experts = layout.experts(cfg)
        cols |= _mlp_cols("mlp.experts.", layout.moe_tp_rank, cfg.moe.intermediate_size // layout.moe_tp)
        cols |= _mlp_cols("mlp.shared_experts.", layout.tp_rank, cfg.moe.shared_intermediate_size // layout.tp)
    kda_layers = set(cfg.kda.layers) if cfg.kda is not None else set()
    out = {}
    for name, t in tensors.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if layer not in layers:
            continue
        if layer in kda_layers and rest.startswith("self_attn."):
            if layout.tp > 1:
                t = _kda_slice(rest, t, layout.kda_heads(cfg), cfg.kda.head_dim)
            out[f"model.layers.{layer - layers.start}.{rest}"] = t
            continue
        param, _, kind = rest.rpartition(".")
        expert = _EXPERT.search(param)
        if expert is not None:
            if int(expert.group(1)) not in experts:  # another expert-parallel group's
                continue
            param = _EXPERT.sub("experts.", param)  # every routed expert splits alike
        if param in cols and layout.tp > 1:
            dim, start, stop = cols[param]
            dim = 0 if kind == "bias" else dim
            t = t.narrow(dim, start, stop - start).contiguous()
        out[f"model.layers.{layer - layers.start}.{rest}"] = t
    return out


_KDA_BY_ROWS = {f"self_attn.{p}.weight" for p in
                ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_b_proj", "g_b_proj")}


def _kda_slice(name: str, t: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    """A KDA layer's tensor `name` (under the layer) as the rank holding `heads` keeps it."""
    channels = (heads.start * head_dim, len(heads) * head_dim)
    if name in _KDA_BY_ROWS or name == "self_attn.dt_bias":
        return t.narrow(0, *channels).contiguous()
    if name == "self_attn.o_proj.weight":
        return t.narrow(1, *channels).contiguous()
    if name == "self_attn.b_proj.weight":
        return t.narrow(0, heads.start, len(heads)).contiguous()
    if name == "self_attn.A_log":  # one per head, [1, 1, H, 1] as transformers saves it, or [H]
        return t.flatten()[heads.start:heads.stop].contiguous()
    return t  # f_a_proj, g_a_proj, o_norm: whole on every rank


def _mlp_cols(prefix: str, rank: int, width: int) -> dict[str, tuple[int, int, int]]:
    """A SwiGLU MLP's slices: gate/up by output width, down by input width."""
    part = (rank * width, (rank + 1) * width)
    return {prefix + "gate_proj": (0, *part), prefix + "up_proj": (0, *part), prefix + "down_proj": (1, *part)}
