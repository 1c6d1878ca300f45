"""Tiny random-weight Hugging Face checkpoints of the MoE architectures, written by transformers:
the oracles of the tests and the models of the GPU check's `moe-graphs` part.

DeepSeek-V3 (3 layers: one dense MLP, two MoE; 8 experts, 3 chosen) in two variants, and
Kimi-Linear (5 layers: KDA, KDA, MLA, KDA, MLA; layer 0 dense, the rest MoE; 6 experts, 2
chosen) in two, their config.json written in the styles the models' users meet. Norms and
router biases are drawn off their init values (ones, zeros), so that loading them matters.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

VOCAB = 256
DEEPSEEK_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                      num_experts_per_tok=3, first_k_dense_replace=1, initializer_range=0.1, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
DEEPSEEK_VARIANTS = {
    # q-LoRA, grouped routing (2 of 4 groups), YaRN with a softmax mscale and a cos/sin factor,
    # written in the rope_scaling form of the released DeepSeek-V3 config.json.
    "qlora_yarn_grouped": dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True,
                               routed_scaling_factor=2.5, rope_parameters=YARN, max_position_embeddings=128),
    # No q-LoRA, one group, unnormalised weights, two shared experts, plain RoPE.
    "no_qlora": dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=False,
                     routed_scaling_factor=1.5, max_position_embeddings=256),
}

KDA_LAYERS, MLA_LAYERS = [1, 2, 4], [3, 5]  # 1-based, as the checkpoint's config lists them
KIMI_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=6, num_experts_per_token=2,
                  first_k_dense_replace=1, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
KIMI_VARIANTS = {
    # The model's own config.json: layer lists and KDA sizes in linear_attn_config only.
    "checkpoint_style": dict(q_lora_rank=None, routed_scaling_factor=2.446, num_shared_experts=1, head_dim=16),
    # As transformers saves it, without linear_attn_config; q-LoRA MLA, two shared experts.
    "transformers_style": dict(q_lora_rank=24, routed_scaling_factor=1.5, num_shared_experts=2, head_dim=32),
}


def write_deepseek(name: str, folder) -> None:
    """The tiny checkpoint DEEPSEEK_VARIANTS[name] as a Hugging Face folder."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    variant = DEEPSEEK_VARIANTS[name]

    def released_rope(raw: dict) -> None:  # rope_parameters as the released config.json spells them
        if "rope_parameters" in variant:
            params = raw.pop("rope_parameters")
            raw["rope_theta"] = params.pop("rope_theta")
            raw["rope_scaling"] = {"type": params.pop("rope_type"), **params}

    _save(name, lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_SMALL, **variant)), folder, released_rope)


def write_kimi_linear(name: str, folder, kda_heads: int = 2) -> None:
    """The tiny checkpoint KIMI_VARIANTS[name] as a Hugging Face folder, its config.json in the
    model repository's style (`linear_attn_config`, 1-based layer lists) or transformers'
    (`layer_types`, `linear_num_heads`, ...); `kda_heads` KDA heads (4 lets TP 4 split them)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    v = dict(KIMI_VARIANTS[name])
    lin = {"kda_layers": KDA_LAYERS, "full_attn_layers": MLA_LAYERS, "num_heads": kda_heads,
           "head_dim": v.pop("head_dim"), "short_conv_kernel_size": 4}
    drop = (["layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"]
            if name == "checkpoint_style" else ["linear_attn_config"])

    def one_style(raw: dict) -> None:
        for key in drop:
            raw.pop(key)

    _save(name, lambda: KimiLinearForCausalLM(KimiLinearConfig(**KIMI_SMALL, **v, linear_attn_config=lin)), folder,
          one_style)


def _save(name: str, build: Callable[[], torch.nn.Module], folder, edit_config: Callable[[dict], None]) -> None:
    """build() seeded by the name, norms and router biases redrawn, saved to folder, its
    config.json edited in place."""
    torch.manual_seed(sum(map(ord, name)))
    model = build().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    edit_config(raw)
    with open(path, "w") as f:
        json.dump(raw, f)
