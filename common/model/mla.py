"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent KV cache.

Per token the cache holds c = [RMSNorm(latent) (kv_lora_rank) | rotated shared key (rope dims)]
in one plane with one "head" ([1, pages, page_size, 1, kv_lora_rank + rope]). Head h's key is
[W_uk_h c_latent | k_rope] and its value W_uv_h c_latent, where kv_b_proj = [W_uk; W_uv] per head.

Two ways to attend, equal in exact arithmetic:
  expanded  up-project the new tokens' latents into per-head keys and values and run ordinary
            causal attention: the cheap way for a prompt that starts at position 0 (no cache
            to read back).
  absorbed  fold W_uk into the query (q_latent_h = W_uk_h^T q_nope_h), attend with
            [q_latent | q_rope] over the cached c itself, as multi-query attention with one key
            head whose values are c's latent part, and fold W_uv into the output. Nothing per
            head is ever materialised for the cached tokens: the way for decode, speculative
            verify and later prefill chunks (as DeepSeek and SGLang do).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model.attention import AttnMeta, attend_cached
from common.model.config import ModelConfig
from common.model.transformer import RMSNorm, apply_rope, linear

# The reference code normalises q_a and the latent with nn.RMSNorm's default epsilon, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _rope_deinterleave(rope_dim: int) -> torch.Tensor:
    """DeepSeek checkpoints lay each rotated pair out as neighbours (x0, x1), (x2, x3)...; this
    row order [x0, x2, ..., x1, x3, ...] turns them into rotate-half halves, so that permuting
    the projection rows once at load time lets the rotate-half RoPE of the dense models apply."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


class MLAttention(nn.Module):
    """`cfg.num_heads` is this rank's share of the query heads; the latent projection is whole on
    every rank, so every rank writes the same cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mla
        self.cfg = cfg
        self.qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        # What is read straight from the hidden state in one matmul: the query's low-rank
        # input (or the whole query without q-LoRA), then the latent, then the shared rope key.
        self.q_in = m.q_lora_rank or cfg.num_heads * self.qk_head_dim
        self.in_proj = nn.Linear(cfg.hidden_size, self.q_in + m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        if m.q_lora_rank:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, cfg.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * m.v_head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                kv_layer: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        m, H, T = self.cfg.mla, self.cfg.num_heads, x.shape[0]
        q, latent, k_rope = linear(x, self.in_proj.weight).split([self.q_in, m.kv_lora_rank, m.qk_rope_head_dim], -1)
        if m.q_lora_rank:
            q = linear(self.q_a_layernorm(q), self.q_b_proj.weight)
        q_nope, q_rope = q.view(T, H, self.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        if m.rope:  # NoPE models (Kimi-Linear) pass no tables: the slice stays as projected
            q_rope = apply_rope(q_rope, cos, sin)
            k_rope = apply_rope(k_rope.view(T, 1, m.qk_rope_head_dim), cos, sin)[:, 0]
        latent = self.kv_a_layernorm(latent)
        kv_layer[0].view(-1, m.kv_lora_rank + m.qk_rope_head_dim).index_copy_(
            0, meta.write_slots, torch.cat([latent, k_rope], -1))
        if meta.fresh_causal:
            out = self._expanded(q_nope, q_rope, latent, k_rope)
        else:
            out = self._absorbed(q_nope, q_rope, kv_layer, meta)
        return linear(out.reshape(T, H * m.v_head_dim), self.o_proj.weight)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, nope, latent] and W_uv [H, v, latent]: views of kv_b_proj."""
        m = self.cfg.mla
        w = self.kv_b_proj.weight.view(self.cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w.split([m.qk_nope_head_dim, m.v_head_dim], 1)

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                  k_rope: torch.Tensor) -> torch.Tensor:
        m, H, T = self.cfg.mla, self.cfg.num_heads, q_nope.shape[0]
        k_nope, v = linear(latent, self.kv_b_proj.weight).view(T, H, -1).split([m.qk_nope_head_dim, m.v_head_dim], -1)
        q = torch.cat([q_nope, q_rope], -1).transpose(0, 1)[None]  # [1, H, T, qk]
        k = torch.cat([k_nope, k_rope[:, None].expand(T, H, m.qk_rope_head_dim)], -1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q, k, v.transpose(0, 1)[None], is_causal=True, scale=m.softmax_scale)
        return out[0].transpose(0, 1)  # [T, H, v]

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_layer: torch.Tensor,
                  meta: AttnMeta) -> torch.Tensor:
        m = self.cfg.mla
        w_uk, w_uv = self._up_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, latent]
        q = torch.cat([q_latent, q_rope], -1)
        # The one latent plane serves as both keys and values: a stride-0 view of two planes
        # lets the paged attention paths (torch and Triton) read it without a copy. The values
        # come out latent + rope wide; the rope part is dropped.
        kv = kv_layer.expand(2, *kv_layer.shape[1:])
        if meta.static is not None:
            o = meta.static.attend(q, kv, m.softmax_scale)
        else:
            o = attend_cached(q, kv, meta, m.softmax_scale)
        return torch.bmm(o[..., :m.kv_lora_rank].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def hf_weights(self, tensors: dict[str, torch.Tensor], src: str) -> dict[str, torch.Tensor]:
        """This module's parameters (names relative to it) from Hugging Face tensors under `src`
        ("model.layers.{i}.self_attn.")."""
        m = self.cfg.mla
        # Without rotation the rope slice keeps the checkpoint's order (the cache then holds it as
        # the reference implementation does).
        perm = _rope_deinterleave(m.qk_rope_head_dim) if m.rope else torch.arange(m.qk_rope_head_dim)

        def rope_rows_q(w: torch.Tensor) -> torch.Tensor:  # per head [nope | rope] rows
            w = w.view(-1, self.qk_head_dim, w.shape[-1])
            return torch.cat([w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:][:, perm]], 1).flatten(0, 1)

        kv_a = tensors[src + "kv_a_proj_with_mqa.weight"]
        kv_a = torch.cat([kv_a[:m.kv_lora_rank], kv_a[m.kv_lora_rank:][perm]])
        own = {"kv_a_layernorm.weight": tensors[src + "kv_a_layernorm.weight"],
               "kv_b_proj.weight": tensors[src + "kv_b_proj.weight"],
               "o_proj.weight": tensors[src + "o_proj.weight"]}
        if m.q_lora_rank:
            own["in_proj.weight"] = torch.cat([tensors[src + "q_a_proj.weight"], kv_a])
            own["q_a_layernorm.weight"] = tensors[src + "q_a_layernorm.weight"]
            own["q_b_proj.weight"] = rope_rows_q(tensors[src + "q_b_proj.weight"])
        else:
            own["in_proj.weight"] = torch.cat([rope_rows_q(tensors[src + "q_proj.weight"]), kv_a])
        return own
