"""Hugging Face folders: small random-weight Llama / Qwen2 / Qwen3 checkpoints written here with
transformers' save_pretrained (safetensors + the embedded model's tokenizer files), loaded with
common.service.loader.load_model, and compared with transformers on the same folder."""
from __future__ import annotations

import json
import os

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.seq_cache import SeqCache
from common.service.loader import ModelOptions, load_model

NEW_TOKENS = 24
SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
             bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# name -> (config class, extra config, rewrite config.json in the older rope_scaling form)
CHECKPOINTS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False), False),
    "llama3_rope": ("LlamaConfig", dict(rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE}), True),
    "qwen2_bias_tied": ("Qwen2Config", dict(tie_word_embeddings=True), False),
    "qwen3_qk_norm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False), False),
}


@pytest.fixture(scope="module")
def tokenizer_files(embedded_source, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    tok = AutoTokenizer.from_pretrained(embedded_source.folder, gguf_file=embedded_source.gguf_file)
    tok.save_pretrained(folder)
    return folder, len(tok)


def _write_checkpoint(name: str, folder, tokenizer_files) -> torch.nn.Module:
    import transformers

    cls_name, extra, legacy_rope = CHECKPOINTS[name]
    tok_folder, vocab = tokenizer_files
    cfg = getattr(transformers, cls_name)(vocab_size=vocab, **SMALL, **extra)
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    for f in os.listdir(tok_folder):
        with open(os.path.join(tok_folder, f), "rb") as src, open(os.path.join(folder, f), "wb") as dst:
            dst.write(src.read())
    if legacy_rope:  # how Llama-3 checkpoints written by older transformers spell it
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            raw = json.load(f)
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = params
        with open(path, "w") as f:
            json.dump(raw, f)
    return model


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory, tokenizer_files):
    """(folder, transformers model read back from it, our runner, our tokenizer)"""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    _write_checkpoint(request.param, folder, tokenizer_files)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner, tok = load_model(ModelOptions(model=str(folder), page_size=8, kv_pages=64))
    return request.param, hf, runner, tok


def test_folder_config_read(checkpoint, tokenizer_files):
    from transformers import AutoTokenizer

    name, hf, runner, tok = checkpoint
    cfg, hcfg = runner.cfg, hf.config
    assert cfg.arch == {"Llama": "llama", "Qwen2": "qwen2", "Qwen3": "qwen3"}[CHECKPOINTS[name][0][:-6]]
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (3, 4, 2)
    assert cfg.head_dim == (32 if name.startswith("qwen3") else 16)
    assert cfg.attn_bias == name.startswith("qwen2")
    assert cfg.qk_norm == name.startswith("qwen3")
    assert cfg.tie_embeddings == hcfg.tie_word_embeddings
    assert (cfg.rope_scaling is not None) == (name == "llama3_rope")
    if cfg.rope_scaling is not None:
        assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 8.0
    assert 2 in tok.eos_token_ids
    assert tok.encode("hello world") == AutoTokenizer.from_pretrained(tokenizer_files[0]).encode("hello world")


def test_folder_logits_and_greedy_match_transformers(checkpoint):
    name, hf, runner, tok = checkpoint
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}]),
        tok.encode("A random model continues this text for a while, and we compare every token"),
        # Past original_max_position_embeddings (64), where Llama-3 scaling matters most.
        tok.encode(" ".join(f"item {i}," for i in range(40))),
    ]
    for ids in prompts:
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        seq = SeqCache()
        runner.reserve(seq, len(ids))
        got = runner.extend([seq], [ids], all_logits=True).logits
        runner.release(seq)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

    engine = Engine(runner, tok.eos_token_ids, chunk_size=13)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=NEW_TOKENS)) for i, p in enumerate(prompts)]
    engine.run_all(reqs)
    for r in reqs:
        x = torch.tensor([r.prompt_ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                              eos_token_id=list(tok.eos_token_ids), pad_token_id=2)
        assert r.output_ids == out[0, len(r.prompt_ids):].tolist(), name
    assert runner.pool.num_free == runner.pool.num_pages
