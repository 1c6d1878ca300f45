"""Model shapes with random weights: they have the real shapes, so they time like the model
without needing its files (benchmarks, GPU checks, tests)."""
from __future__ import annotations

import torch

from common.model.config import ModelConfig

SHAPES = {
    # The embedded SmolLM2-135M-Instruct.
    "embedded": ModelConfig(arch="llama", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
                            head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
                            rms_eps=1e-5, max_position=8192, tie_embeddings=True, eos_token_ids=(2,),
                            name="random-smollm2-135m"),
    # Llama-3-8B (its context cut to 8K: longer tables only cost memory here).
    "llama3-8b": ModelConfig(arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                             head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                             rms_eps=1e-5, max_position=8192, tie_embeddings=False, eos_token_ids=(128001,),
                             name="random-llama3-8b"),
    # A toy that runs in a second on a CPU, for smoke tests of the commands.
    "tiny": ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=512, rope_theta=10000.0, rms_eps=1e-5,
                        max_position=2048, tie_embeddings=False, eos_token_ids=(0,), name="random-tiny"),
}


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named Llama tensors drawn on the device (an 8B model in seconds, not
    minutes), small enough that activations stay finite."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02)

    H, I = cfg.hidden_size, cfg.intermediate_size
    t = {"model.embed_tokens.weight": rand(cfg.vocab_size, H),
         "model.norm.weight": torch.ones(H, dtype=dtype, device=device)}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = rand(cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": rand(cfg.q_size, H),
              p + "self_attn.k_proj.weight": rand(cfg.kv_size, H),
              p + "self_attn.v_proj.weight": rand(cfg.kv_size, H),
              p + "self_attn.o_proj.weight": rand(H, cfg.q_size),
              p + "mlp.gate_proj.weight": rand(I, H),
              p + "mlp.up_proj.weight": rand(I, H),
              p + "mlp.down_proj.weight": rand(H, I),
              p + "input_layernorm.weight": torch.ones(H, dtype=dtype, device=device),
              p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype, device=device)}
    return t


def random_token_ids(cfg: ModelConfig, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist()
