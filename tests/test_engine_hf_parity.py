"""The embedded model against Hugging Face transformers, which reads the same GGUF file on its
own (so this also checks our GGUF reading and Q/K un-permute): greedy tokens, hidden states, bf16."""
from __future__ import annotations

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.seq_cache import SeqCache

NEW_TOKENS = 40
_LONG_TEXT = (
    "In the beginning of the twentieth century, the small town of Millbrook was known for two things: "
    "its annual apple festival and the old stone bridge that crossed the river at the center of town. "
    "Farmers from the surrounding valleys would bring their harvest to the market square every Saturday, "
    "and children would race paper boats under the bridge while their parents haggled over prices. "
    "But in the spring of 1912, something happened that would change the town forever."
)


def _prompts(tok) -> dict[str, list[int]]:
    chat = tok.apply_chat_template
    return {
        "chat_story": chat([{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]),
        "chat_system": chat([{"role": "system", "content": "You are a patient teacher who gives thorough answers."},
                             {"role": "user", "content": "Explain in detail how a car engine works, step by step."}]),
        "chat_multi_turn": chat([{"role": "user", "content": "What is the capital of France?"},
                                 {"role": "assistant", "content": "The capital of France is Paris."},
                                 {"role": "user", "content": "Tell me about its history, its museums and its food."}]),
        "raw_code_short": tok.encode("def fibonacci(n):\n"),
        "raw_long": tok.encode(_LONG_TEXT),
    }


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    return _prompts(embedded_tokenizer)


def _hf_greedy_picks(hf, ids: list[int], ours: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and after each of our tokens, from one forward
    pass over both: equal to `ours` exactly when its own greedy decoding would produce `ours`."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1:]
    return logits.argmax(-1).tolist()


def _our_greedy(runner, eos, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = Engine(runner, eos)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=n)) for i, p in enumerate(prompts)]
    engine.run_all(reqs)
    return [r.output_ids for r in reqs]


def test_greedy_fp32_matches_transformers(embedded_runner, embedded_tokenizer, hf_embedded_model, prompts):
    eos = embedded_tokenizer.eos_token_ids
    assert set(prompts) and len(prompts) >= 5
    ours = _our_greedy(embedded_runner, eos, list(prompts.values()), NEW_TOKENS)
    for (name, ids), got in zip(prompts.items(), ours):
        # The prompts were picked so the model does not stop early: the comparison is long.
        assert len(got) == NEW_TOKENS, f"{name} stopped after {len(got)} tokens"
        want = _hf_greedy_picks(hf_embedded_model, ids, got)
        assert got == want, f"{name}: first difference at token {_first_diff(got, want)}"
    assert embedded_runner.pool.num_free == embedded_runner.pool.num_pages


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _hf_hidden(hf, ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states


LAYERS = (1, 8, 27)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # The residual stream reaches |x| ~ 1e4 in a few channels (layer 27); measured fp32
    # differences are <= 2e-7 of the largest value, so atol = 1e-6 of it leaves a 5x margin.
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item())


def test_capture_layers_equal_transformers_hidden_states(embedded_runner, hf_embedded_model, prompts):
    runner = embedded_runner
    ids = prompts["raw_long"]
    ref = _hf_hidden(hf_embedded_model, ids)
    split = 50  # the prompt's first part as one prefill, the rest as a block over the cache
    seq = SeqCache()
    runner.reserve(seq, len(ids))
    try:
        first = runner.extend([seq], [ids[:split]], capture_layers=LAYERS)
        rest = runner.extend([seq], [ids[split:]], capture_layers=LAYERS)
    finally:
        runner.release(seq)
    assert set(first.captured) == set(LAYERS) == set(rest.captured)
    for layer in LAYERS:
        got = torch.cat([first.captured[layer], rest.captured[layer]])
        assert got.shape == (len(ids), runner.cfg.hidden_size)
        _close(got, ref[layer + 1][0])  # hidden_states[0] is the embedding output


def test_no_capture_when_not_asked(embedded_runner, prompts):
    runner = embedded_runner
    seq = SeqCache()
    runner.reserve(seq, 8)
    try:
        out = runner.extend([seq], [prompts["raw_code_short"]])
    finally:
        runner.release(seq)
    assert out.captured == {}


def test_bf16_runs_and_starts_like_fp32(make_embedded_runner, embedded_runner, embedded_tokenizer):
    """bf16 keeps ~3 significant digits, so long greedy runs drift from fp32. What we hold it to:
    valid tokens, the same first 8 greedy tokens on a simple prompt, and prompt logits near fp32:
    mean abs difference < 0.3 (measured ~0.13; logits are ~10-20 in size) and the same argmax at
    >= 90% of prompt positions (measured 100%)."""
    tok = embedded_tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    bf16 = make_embedded_runner(dtype="bf16", num_pages=16)
    assert bf16.kv.dtype == torch.bfloat16
    got_bf16 = _our_greedy(bf16, tok.eos_token_ids, [ids], 16)[0]
    got_fp32 = _our_greedy(embedded_runner, tok.eos_token_ids, [ids], 16)[0]
    assert got_bf16 and all(0 <= t < bf16.cfg.vocab_size for t in got_bf16)
    assert got_bf16[:8] == got_fp32[:8], (tok.decode(got_bf16), tok.decode(got_fp32))
    assert "Paris" in tok.decode(got_bf16)

    logits = []
    for runner in (bf16, embedded_runner):
        seq = SeqCache()
        runner.reserve(seq, len(ids))
        logits.append(runner.extend([seq], [ids], all_logits=True).logits)
        runner.release(seq)
    assert logits[0].dtype == torch.float32  # logits come back fp32 whatever the weights
    assert (logits[0] - logits[1]).abs().mean() < 0.3
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9
    assert bf16.pool.num_free == bf16.pool.num_pages
