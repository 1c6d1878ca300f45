"""The Kimi-Linear architecture (`KimiLinearForCausalLM`): KDA layers (common.model.kda) with a
recurrent state per request, NoPE MLA layers over the latent paged KV (common.model.mla), a dense
SwiGLU MLP in the first `first_dense_layers` layers and DeepSeek-V3-routed MoE after
(common.model.moe: sigmoid scores, biased top-k, renormalised, scaled). No rotary embedding.

The cache the model runs over is a `HybridCache`: the paged KV of the MLA layers only (a KDA
layer has no per-token cache) and the state slots of the KDA layers. The feed-forward tensors are
renamed as DeepSeek-V3 names them when the checkpoint is read (`deepseek_ffn_names`), so that the
dense MLP, the MoE and their TP/EP split (common.runner.shard) read them as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import re

from common.model.attention import AttnMeta
from common.model.config import ModelConfig
from common.model.deepseek import DeepseekTransformer
from common.model.kda import BlockInputs, KimiDeltaAttention
from common.model.mla import MLAttention
from common.model.moe import MoE
from common.model.transformer import MLP, Reduce, RMSNorm


@dataclass
class HybridCache:
    """kv [MLA layers, planes, pages, page size, heads, dim]; recurrent [KDA layers, slots, H, D, D]
    fp32 and conv [KDA layers, slots, 3*H*D, W-1]: each layer's entry in the order of its kind.
    block: the KDA layers' scratch of verify blocks (speculative engines only)."""

    kv: torch.Tensor
    recurrent: torch.Tensor
    conv: torch.Tensor
    block: BlockInputs | None = None


class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: Reduce, layer: int):
        super().__init__()
        self.reduce = reduce
        self.is_kda = layer in cfg.kda.layers
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = KimiDeltaAttention(cfg) if self.is_kda else MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MoE(cfg) if cfg.moe is not None and layer >= cfg.moe.first_dense_layers else MLP(cfg)

    def forward(self, h: torch.Tensor, cache: HybridCache, index: int, meta: AttnMeta) -> torch.Tensor:
        """`index`: this layer's entry among the cache's layers of its kind."""
        x = self.input_layernorm(h)
        if self.is_kda:
            block = cache.block.layer(index) if meta.state_block else None
            x = self.self_attn(x, cache.recurrent[index], cache.conv[index], meta, block)
        else:
            x = self.self_attn(x, None, None, cache.kv[index], meta)
        h = h + self.reduce(x)
        return h + self.reduce(self.mlp(self.post_attention_layernorm(h)))


class KimiLinearTransformer(DeepseekTransformer):
    """DeepSeek-V3's module with Kimi's layers; weights load as there (layer_hf_weights), each
    layer's attention reading its own kind's tensors."""

    def __init__(self, cfg: ModelConfig, reduce: Reduce, first_layer: int = 0):
        super().__init__(cfg, reduce, first_layer)
        # Each layer's index among the cache entries of its kind (KDA state or MLA pages).
        kinds = [layer.is_kda for layer in self.layers]
        self.cache_index = [sum(k == kind for k in kinds[:i]) for i, kind in enumerate(kinds)]

    def make_layer(self, cfg: ModelConfig, reduce: Reduce, layer: int) -> nn.Module:
        return KimiDecoderLayer(cfg, reduce, layer)

    def init_rope(self, device: torch.device) -> None:
        """NoPE: no tables (the inherited ones would span the whole 1M-token context)."""

    def run_layers(self, h: torch.Tensor, kv_cache: HybridCache, meta: AttnMeta,
                   capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, kv_cache, self.cache_index[i], meta)
            if self.first_layer + i in capture_layers:
                captured[self.first_layer + i] = h
        return h, captured


_KIMI_FFN = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(.*)")
_EXPERT_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def deepseek_ffn_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kimi-Linear's checkpoint tensors with the feed-forward ones renamed as DeepSeek-V3 names
    them: block_sparse_moe -> mlp, routed experts' w1 / w3 / w2 -> gate_proj / up_proj /
    down_proj (the dense MLP, shared experts and router keep their names)."""
    out = {}
    for name, t in tensors.items():
        m = _KIMI_FFN.fullmatch(name)
        if m is not None:
            rest = re.sub(r"^(experts\.\d+\.)(w[123])\.", lambda e: f"{e.group(1)}{_EXPERT_W[e.group(2)]}.", m.group(2))
            name = f"{m.group(1)}mlp.{rest}"
        out[name] = t
    return out
