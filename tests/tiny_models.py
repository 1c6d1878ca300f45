"""Random-weight models and drafters small enough to split over many processes in a test."""
from __future__ import annotations

import json
import os
import shutil

import torch

from common.dflash.drafter import Drafter, DrafterConfig
from common.dflash.proposer import DFlashProposer
from common.engine.engine import Engine
from common.model.config import ModelConfig
from common.runner.model_runner import ModelRunner


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


def save_random_drafter(cfg: ModelConfig, capture_layers: tuple[int, ...], folder: str, seed: int = 0,
                        block_size: int = 4) -> str:
    """A random one-layer drafter for `cfg` capturing these target layers, saved to `folder`."""
    torch.manual_seed(seed)
    Drafter(DrafterConfig.for_target(cfg, num_layers=1, capture_layers=capture_layers, block_size=block_size)).save(folder)
    return folder


def speculating_engine(drafter_folder: str, num_layers: int = 2, seed: int = 0, capture_layers: tuple[int, ...] = (0, 1),
                       block_size: int = 4, num_pages: int = 128, page_size: int = 16, **engine_args) -> Engine:
    """A speculating Engine, no EOS, over random_model(num_layers, seed=seed) and a random drafter
    saved to `drafter_folder` (the same drafter each time for the same arguments)."""
    cfg, tensors = random_model(num_layers=num_layers, seed=seed)
    save_random_drafter(cfg, capture_layers, drafter_folder, block_size=block_size)
    runner = ModelRunner(cfg, tensors, num_pages=num_pages, page_size=page_size)
    proposer = DFlashProposer(Drafter.load(drafter_folder), runner, runner.pool.num_pages)
    return Engine(runner, (), proposer=proposer, **engine_args)


def save_random_checkpoint(folder: str, tokenizer_folder: str, **shape) -> ModelConfig:
    """random_model(**shape) as a Hugging Face folder (config.json, model.safetensors) with the
    tokenizer files of `tokenizer_folder` copied beside (give `vocab` its vocabulary's size): a
    checkpoint the services and `pdflash generate` load like any other."""
    from safetensors.torch import save_file

    cfg, tensors = random_model(**shape)
    shutil.copytree(tokenizer_folder, folder)
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.hidden_size,
          "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab_size,
          "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position,
          "tie_word_embeddings": cfg.tie_embeddings}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return cfg
