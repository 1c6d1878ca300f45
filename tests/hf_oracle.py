"""Tiny random-weight Hugging Face checkpoints as oracles: a test module writes one per variant
into a folder; transformers reads it back (the reference) and so does our loader."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from common.model.source import resolve_model
from common.model.weights import load_weights
from common.runner.model_runner import ModelRunner


def checkpoint_fixture(variants, write: Callable[[str, object], None]):
    """A module-scoped fixture over `variants`: (name, transformers model, our config, our
    tensors, folder) of the checkpoint that write(name, folder) saves."""

    @pytest.fixture(scope="module", params=list(variants))
    def checkpoint(request, tmp_path_factory):
        from transformers import AutoModelForCausalLM

        folder = tmp_path_factory.mktemp(request.param)
        write(request.param, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        cfg, tensors = load_weights(resolve_model(str(folder)))
        return request.param, hf, cfg, tensors, folder

    return checkpoint


def tiny_runner(checkpoint, **kw) -> ModelRunner:
    _, _, cfg, tensors, _ = checkpoint
    return ModelRunner(cfg, tensors, num_pages=64, page_size=8, **kw)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def prefill_then_decode(runner, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of every position of `ids`: the first prompt_len tokens in one prefill, the rest
    one decode step at a time (the request's pages are returned after)."""
    from common.kv.seq_cache import SeqCache

    seq = SeqCache()
    runner.reserve(seq, len(ids))
    got = [runner.extend([seq], [ids[:prompt_len]], all_logits=True).logits]
    got += [runner.extend([seq], [[t]]).logits for t in ids[prompt_len:]]
    runner.release(seq)
    return torch.cat(got)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly n tokens."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()
