"""Model shapes with random weights: they have the real shapes, so they time like the model
without needing its files (benchmarks, GPU checks, tests)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from common.model.config import ModelConfig

# DeepSeek-V2-Lite's published config.json (16B total, 2.4B active), as a deepseek_v3 config: its
# own routing (topk_method "greedy", scoring_func "softmax": top-6 of a softmax over all 64
# experts, unnormalised) is not implemented, so it routes as DeepSeek-V3 does (top-6 of sigmoid
# scores in one group). Either way each token reads 6 routed experts, which is what its step
# time depends on.
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v3", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1,
    "topk_group": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    "tie_word_embeddings": False, "eos_token_id": 100001,
}
# Kimi-Linear-48B-A3B's published config.json: 27 layers, every fourth and the last MLA (1-based
# lists), the rest KDA; 256 routed experts, 8 per token, one shared.
KIMI_LINEAR_48B = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "linear_attn_config": {"kda_layers": [i for i in range(1, 27) if i % 4], "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1,
    "rms_norm_eps": 1e-5, "model_max_length": 1048576, "tie_word_embeddings": False, "eos_token_id": 163586,
}
# The same architectures at sizes a CPU runs in seconds (every width a multiple of 16 bytes in
# bf16, as grouped expert matmuls want): one dense layer then MoE; Kimi's first 5 layers' pattern.
_SMALL_MLA = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
              "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 1024,
              "moe_intermediate_size": 64, "intermediate_size": 256}
DEEPSEEK_SMALL = DEEPSEEK_V2_LITE | _SMALL_MLA | {"num_hidden_layers": 4, "n_routed_experts": 16,
                                                  "num_experts_per_tok": 4, "max_position_embeddings": 4096}
KIMI_LINEAR_SMALL = KIMI_LINEAR_48B | _SMALL_MLA | {
    "num_hidden_layers": 5, "num_experts": 16, "num_experts_per_token": 4, "model_max_length": 4096,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "num_heads": 4, "head_dim": 32,
                           "short_conv_kernel_size": 4}}

# A toy that runs in a second on a CPU, for smoke tests of the commands.
TINY = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=512, rope_theta=10000.0, rms_eps=1e-5,
                   max_position=2048, tie_embeddings=False, eos_token_ids=(0,), name="random-tiny")

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
    "tiny": TINY,
    # The toy with Qwen3's per-head norms on q and k.
    "tiny-qk-norm": replace(TINY, arch="qwen3", qk_norm=True, name="random-tiny-qk-norm"),
    "deepseek-v2-lite": ModelConfig.from_hf(DEEPSEEK_V2_LITE, "random-deepseek-v2-lite"),
    "kimi-linear-48b": ModelConfig.from_hf(KIMI_LINEAR_48B, "random-kimi-linear-48b-a3b"),
    "deepseek-small": ModelConfig.from_hf(DEEPSEEK_SMALL, "random-deepseek-small"),
    "kimi-linear-small": ModelConfig.from_hf(KIMI_LINEAR_SMALL, "random-kimi-linear-small"),
}


def first_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model cut to its first n layers: the same per-layer shapes, dense/MoE split and
    KDA/MLA pattern (n >= the layer count: the model as it is)."""
    if n >= cfg.num_layers:
        return cfg
    if n < 1:
        raise ValueError(f"a model needs at least one layer, not {n}")
    kda = None if cfg.kda is None else replace(cfg.kda, layers=tuple(i for i in cfg.kda.layers if i < n))
    return replace(cfg, num_layers=n, kda=kda, name=f"{cfg.name}-{n}-of-{cfg.num_layers}-layers")


@dataclass(frozen=True)
class RandomWeights:
    """Weights to draw instead of reading (ModelRunner takes this in place of tensors): normal
    with standard deviation `std`, norm scales 1 and buffers (router biases) 0, from `seed`."""

    seed: int = 0
    std: float = 0.02


def fill_random_(model: nn.Module, weights: RandomWeights) -> nn.Module:
    """Fill a model built on the meta device and moved with to_empty, in place where it lies: a
    16B model in seconds on a GPU, with no host copy and no second copy in another dtype. Each
    rank of a split model draws its own (speed only: they are not shards of one model)."""
    params = list(model.named_parameters())
    g = torch.Generator(device=params[0][1].device).manual_seed(weights.seed)
    with torch.no_grad():
        for name, p in params:
            if name.endswith("norm.weight") or name.endswith("o_norm"):  # RMSNorm and KDA output-norm scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, weights.std, generator=g)
        for b in model.buffers():
            b.zero_()
    return model


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
        if cfg.qk_norm:  # not ones: a kernel that skipped a weight would pass
            t |= {p + "self_attn.q_norm.weight": 1 + 10 * rand(cfg.head_dim),
                  p + "self_attn.k_norm.weight": 1 + 10 * rand(cfg.head_dim)}
    return t


def random_token_ids(cfg: ModelConfig, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist()
