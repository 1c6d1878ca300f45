"""Read a model's weights (common.model.source finds it) into a dict of Hugging Face-named
tensors: GGUF files (converted once, kept in common.model.cache) and Hugging Face folders
(config.json + *.safetensors)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict

import numpy as np
import torch

from common.model.cache import building, publish
from common.model.config import ModelConfig, RopeScaling
from common.model.errors import ModelNotFound
from common.model.kimi_linear import deepseek_ffn_names
from common.model.source import ModelSource, converted_folder


def load_weights(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return _load_gguf(src) if src.kind == "gguf" else _load_hf(src)


# ---- Hugging Face safetensors -------------------------------------------------------------

def _load_hf(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(src.folder, "config.json")) as f:
        cfg = ModelConfig.from_hf(json.load(f), name=os.path.basename(src.folder.rstrip("/")))
    files = sorted(f for f in os.listdir(src.folder) if f.endswith(".safetensors"))
    if not files:
        raise ModelNotFound(f"model folder {src.folder!r} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(src.folder, name)))
    if cfg.arch == "kimi_linear":  # one naming of the feed-forward for the model and its TP/EP split
        tensors = deepseek_ffn_names(tensors)
    gen_cfg = os.path.join(src.folder, "generation_config.json")
    if os.path.isfile(gen_cfg):
        with open(gen_cfg) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (eos,)
            cfg = _with_eos(cfg, tuple(dict.fromkeys(cfg.eos_token_ids + extra)))
    return cfg, tensors


def _with_eos(cfg: ModelConfig, eos: tuple[int, ...]) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, eos_token_ids=eos)


# ---- GGUF ----------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved per head for its rotary layout; undo it so the
    rotate-half RoPE of Hugging Face applies (the inverse of convert_hf_to_gguf's permute)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantizing a GGUF file takes seconds: the result is kept as safetensors and read from
    there by every later process."""
    from safetensors.torch import load_file, save_file

    folder = os.path.join(converted_folder(src), "weights")
    weights, config = os.path.join(folder, "model.safetensors"), os.path.join(folder, "pdflash_config.json")
    with building(folder):  # held while converting only: readers of a finished build read in parallel
        if not (os.path.isfile(weights) and os.path.isfile(config)):
            cfg, tensors = _convert_gguf(src)

            def build(tmp: str) -> None:
                save_file(tensors, os.path.join(tmp, "model.safetensors"))
                with open(os.path.join(tmp, "pdflash_config.json"), "w") as f:
                    json.dump(asdict(cfg), f)

            publish(build, folder)
            return cfg, tensors
    with open(config) as f:
        return _config_from_json(json.load(f)), load_file(weights)


def _config_from_json(d: dict) -> ModelConfig:
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    if d["rope_scaling"] is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ModelConfig(**d)


def _convert_gguf(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(src.path)

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    heads = meta(f"{arch}.attention.head_count")
    kv_heads = meta(f"{arch}.attention.head_count_kv", heads)
    hidden = meta(f"{arch}.embedding_length")
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims fastest-first
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            w = _unpermute_rotary(w, heads)
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            w = _unpermute_rotary(w, kv_heads)
        if t.name in _GGUF_TOP_NAMES:
            name = _GGUF_TOP_NAMES[t.name]
        else:
            _, layer, rest = t.name.split(".", 2)
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    eos = meta("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        arch=arch,
        num_layers=meta(f"{arch}.block_count"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=meta(f"{arch}.attention.key_length", hidden // heads),
        intermediate_size=meta(f"{arch}.feed_forward_length"),
        vocab_size=vocab,
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=meta(f"{arch}.context_length", 4096),
        tie_embeddings="lm_head.weight" not in tensors,
        attn_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in tensors,
        eos_token_ids=(eos,) if eos is not None else (),
        name=os.path.splitext(src.gguf_file or "model")[0],
    )
    return cfg, tensors
