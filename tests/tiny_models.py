"""Random-weight models and drafters small enough to split over many processes in a test."""
from __future__ import annotations

import torch

from common.dflash.drafter import Drafter, DrafterConfig
from common.model.config import ModelConfig


def random_model(num_layers: int = 16, hidden: int = 64, heads: int = 4, kv_heads: int = 2, mlp: int = 128,
                 vocab: int = 256, seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, Hugging Face-named fp32 tensors) of a random Llama-style model."""
    cfg = ModelConfig(arch="llama", num_layers=num_layers, hidden_size=hidden, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=mlp,
                      vocab_size=vocab, rope_theta=10000.0, rms_eps=1e-6, max_position=1024,
                      tie_embeddings=False, name=f"random-{num_layers}l")
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.1
    d = cfg.head_dim
    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": 1 + w(hidden),
         "lm_head.weight": w(vocab, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(heads * d, hidden), p + "self_attn.k_proj.weight": w(kv_heads * d, hidden),
              p + "self_attn.v_proj.weight": w(kv_heads * d, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * d),
              p + "mlp.gate_proj.weight": w(mlp, hidden), p + "mlp.up_proj.weight": w(mlp, hidden),
              p + "mlp.down_proj.weight": w(hidden, mlp), p + "input_layernorm.weight": 1 + w(hidden),
              p + "post_attention_layernorm.weight": 1 + w(hidden)}
    return cfg, t


def save_random_drafter(cfg: ModelConfig, capture_layers: tuple[int, ...], folder: str, seed: int = 0) -> str:
    """A random one-layer drafter for `cfg` capturing these target layers, saved to `folder`."""
    torch.manual_seed(seed)
    Drafter(DrafterConfig.for_target(cfg, num_layers=1, capture_layers=capture_layers, block_size=4)).save(folder)
    return folder
