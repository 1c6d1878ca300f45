"""Cut a model's Hugging Face-named weights down to what one rank holds (common.runner.layout).

Layers outside the rank's pipeline stage are dropped and the rest renumbered from 0, so the
result loads into a Transformer built from `layout.local_config(cfg)` exactly as a whole model
does. Tensor parallel slices: q/k/v (and their biases) by head, gate/up by MLP width (column
parallel); o_proj and down_proj along their input (row parallel; they have no bias, so the
all-reduce of the partial outputs is the whole result). Embedding, final norm and LM head are
replicated on every rank.
"""
from __future__ import annotations

import re

import torch

from common.model.config import ModelConfig
from common.runner.layout import RankLayout

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


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
        "mlp.gate_proj": (0, layout.tp_rank * width, (layout.tp_rank + 1) * width),
        "mlp.up_proj": (0, layout.tp_rank * width, (layout.tp_rank + 1) * width),
        "mlp.down_proj": (1, layout.tp_rank * width, (layout.tp_rank + 1) * width),
    }
    out = {}
    for name, t in tensors.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if layer not in layers:
            continue
        param, _, kind = rest.rpartition(".")
        if param in cols and layout.tp > 1:
            dim, start, stop = cols[param]
            dim = 0 if kind == "bias" else dim
            t = t.narrow(dim, start, stop - start).contiguous()
        out[f"model.layers.{layer - layers.start}.{rest}"] = t
    return out
