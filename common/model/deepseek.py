"""The DeepSeek-V3 architecture (Kimi-K2, Moonlight): the dense decoder's embedding, norms, RoPE
tables, LM head and pipeline pieces, with MLA attention in every layer and a MoE feed-forward
from layer `first_dense_layers` on (a dense SwiGLU MLP before it)."""
from __future__ import annotations

import torch
from torch import nn

from common.model.config import ModelConfig
from common.model.mla import MLAttention
from common.model.moe import MoE
from common.model.transformer import MLP, DecoderLayer, Reduce, Transformer


def deepseek_layer(cfg: ModelConfig, reduce: Reduce, layer: int) -> DecoderLayer:
    moe = cfg.moe is not None and layer >= cfg.moe.first_dense_layers
    return DecoderLayer(cfg, reduce, MLAttention(cfg), MoE(cfg) if moe else MLP(cfg))


class DeepseekTransformer(Transformer):
    def make_layer(self, cfg: ModelConfig, reduce: Reduce, layer: int) -> nn.Module:
        return deepseek_layer(cfg, reduce, layer)

    def layer_hf_weights(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        layer = self.layers[i]
        own = {"input_layernorm.weight": tensors[p + "input_layernorm.weight"],
               "post_attention_layernorm.weight": tensors[p + "post_attention_layernorm.weight"]}
        own |= {f"self_attn.{k}": t for k, t in layer.self_attn.hf_weights(tensors, p + "self_attn.").items()}
        own |= {f"mlp.{k}": t for k, t in layer.mlp.hf_weights(tensors, p + "mlp.").items()}
        return own
