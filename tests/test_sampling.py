"""Sampling (the batched sampler on synthetic logits) and stopping (with the real model):
greedy, top-k, top-p, seeds, stop strings, stop token ids, EOS, max_new_tokens, streaming text."""
from __future__ import annotations

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampler import sample
from common.engine.sampling import InvalidRequest, SamplingParams
from common.model.tokenizer import IncrementalDecoder

V = 1000


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, V, generator=g) * 3


def test_greedy_and_top_k_1_are_argmax(logits):
    want = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams()] * 4, [0] * 4) == want
    assert sample(logits, [SamplingParams(temperature=1.5, top_k=1, seed=3)] * 4, [0] * 4) == want


def test_tiny_top_p_is_greedy(logits):
    for step in range(20):
        assert sample(logits, [SamplingParams(temperature=2.0, top_p=1e-9, seed=step)] * 4, [step] * 4) \
            == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_position_keyed():
    flat = torch.zeros(1, V)  # uniform: every draw is a fair test of the generator
    p = SamplingParams(temperature=1.0, seed=42)
    run = [sample(flat, [p], [i])[0] for i in range(32)]
    assert run == [sample(flat, [p], [i])[0] for i in range(32)]
    # Position-keyed: the token at step i does not depend on what was drawn before or on the batch.
    assert [sample(flat, [p], [i])[0] for i in reversed(range(32))] == run[::-1]
    batch = sample(flat.expand(3, V), [SamplingParams(temperature=1.0, seed=7), p, SamplingParams()], [0, 5, 0])
    assert batch[1] == run[5]
    assert len(set(run)) > 20  # the steps draw different tokens
    other = [sample(flat, [SamplingParams(temperature=1.0, seed=43)], [i])[0] for i in range(32)]
    assert sum(a != b for a, b in zip(run, other)) > 25  # P(equal) = 1/1000 per position


def test_top_k_and_top_p_keep_only_the_head(logits):
    row = logits[:1]
    top5 = set(row[0].topk(5).indices.tolist())
    drawn = {sample(row, [SamplingParams(temperature=5.0, top_k=5, seed=1)], [i])[0] for i in range(200)}
    assert drawn <= top5 and len(drawn) >= 4
    # two tokens hold 0.6 and 0.3 of the mass: top_p=0.7 keeps exactly those two
    two = torch.full((1, V), -30.0)
    two[0, 3], two[0, 9], two[0, 11] = 0.0, -0.6931, -1.7918  # p ~ 0.6, 0.3, 0.1 (of the three)
    drawn = {sample(two, [SamplingParams(temperature=1.0, top_p=0.7, seed=2)], [i])[0] for i in range(200)}
    assert drawn == {3, 9}


def test_temperature_follows_the_distribution():
    # p(token 1) = 0.75 at temperature 1; at temperature 0.5 the odds square: 0.9
    logits = torch.tensor([[0.0, 1.0986123]]).expand(4000, 2)
    for temp, want in ((1.0, 0.75), (0.5, 0.9)):
        params = [SamplingParams(temperature=temp, seed=s) for s in range(4000)]
        freq = sum(sample(logits, params, [0] * 4000)) / 4000
        assert abs(freq - want) < 0.03, (temp, freq)


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
])
def test_invalid_params(bad, match):
    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(**{"max_new_tokens": 8, **bad}).validate(10, 100)
    with pytest.raises(InvalidRequest, match="context"):
        SamplingParams(max_new_tokens=50).validate(60, 100)


# ---- stopping, with the real model -----------------------------------------------------------

def _generate(runner, tok, ids, params) -> tuple[Request, str]:
    engine = Engine(runner, tok.eos_token_ids)
    req = Request("r", ids, params, IncrementalDecoder(tok, params.stop))
    text = "".join(out.text for outputs in engine.run([req]) for out in outputs)
    assert runner.pool.num_free == runner.pool.num_pages
    return req, text


@pytest.fixture(scope="module")
def story(embedded_runner, embedded_tokenizer):
    ids = embedded_tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a short story about a cat."}])
    req, text = _generate(embedded_runner, embedded_tokenizer, ids, SamplingParams(max_new_tokens=40))
    assert req.finish_reason == "length" and len(req.output_ids) == 40
    assert text == embedded_tokenizer.decode(req.output_ids)  # streamed deltas add up
    return ids, req.output_ids, text


def test_max_new_tokens_gives_length(story):
    ids, out, text = story
    assert len(out) == 40 and len(text) > 40


def test_stop_string_ends_text_before_it(embedded_runner, embedded_tokenizer, story):
    ids, out, text = story
    words = text.split()
    stop = " " + words[len(words) // 2]  # a word in the middle of the greedy text
    at = text.find(stop)
    req, streamed = _generate(embedded_runner, embedded_tokenizer, ids,
                              SamplingParams(max_new_tokens=40, stop=("never appears", stop)))
    assert req.finish_reason == "stop" and req.matched_stop == stop
    assert streamed == text[:at] == req.decoder.text
    assert len(req.output_ids) < 40 and req.output_ids == out[:len(req.output_ids)]


def test_stop_token_id(embedded_runner, embedded_tokenizer, story):
    ids, out, _ = story
    tok_id = out[10]
    first = out.index(tok_id)
    req, _ = _generate(embedded_runner, embedded_tokenizer, ids,
                       SamplingParams(max_new_tokens=40, stop_token_ids=(tok_id,)))
    assert req.finish_reason == "stop" and req.matched_stop == tok_id
    assert req.output_ids == out[:first + 1]


def test_eos_stops_unless_ignored(embedded_runner, embedded_tokenizer):
    tok = embedded_tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    req, text = _generate(embedded_runner, tok, ids, SamplingParams(max_new_tokens=30))
    assert req.finish_reason == "stop" and req.matched_stop in tok.eos_token_ids
    assert req.output_ids[-1] in tok.eos_token_ids and len(req.output_ids) < 30
    assert "<|im_end|>" not in text
    n = len(req.output_ids)
    req2, _ = _generate(embedded_runner, tok, ids, SamplingParams(max_new_tokens=n + 3, ignore_eos=True))
    assert req2.finish_reason == "length" and req2.output_ids[:n] == req.output_ids


class FullDecoder(IncrementalDecoder):
    """The reference: decodes every id at every update."""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class SentencePieceStyle:
    """A tokenizer.json decoder of the SentencePiece kind, over a small vocabulary: ids 0-255 are
    byte-fallback tokens <0xXX> (a run of them decodes as one; invalid UTF-8 makes every byte
    U+FFFD), then words that start with a space marker, then a skipped special token."""

    def __init__(self, decoder):
        self.vocab = [f"<0x{b:02X}>" for b in range(256)] + ["▁x", "▁a", "▁b", "'", "▁'", "</s>"]
        self.special = len(self.vocab) - 1
        self.decoder = decoder

    def decode(self, ids: list[int]) -> str:
        return self.decoder.decode([self.vocab[i] for i in ids if i != self.special])


def stream_both(tok, stream: list[int], stop: tuple[str, ...] = (), lengths: list | None = None) -> None:
    """Every update of IncrementalDecoder gives what decoding everything gives; `lengths` gets
    the length of every decode it makes."""
    ref, dec = FullDecoder(tok, stop), IncrementalDecoder(tok, stop)
    decode = tok.decode
    for i in range(1, len(stream) + 1):
        want = ref.update(stream[:i], i == len(stream))
        tok.decode = lambda x: (lengths is not None and lengths.append(len(x)), decode(x))[1]
        try:
            assert dec.update(stream[:i], i == len(stream)) == want, (stop, i)
        finally:
            del tok.decode
        assert dec.matched_stop == ref.matched_stop
        if ref.matched_stop:
            return


def test_incremental_decoder_decodes_a_window_and_matches_whole_decoding(embedded_tokenizer):
    import random

    tok = embedded_tokenizer
    rng = random.Random(0)
    ids = tok.encode("Café 🙂🎉 日本語のテキスト — naïve “quotes” ok. The answer is 42.\n\n" * 12)
    # Any id of the vocabulary (odd bytes), with runs of the special tokens (0-16, skipped).
    odd = [rng.randrange(49152) if rng.random() < 0.8 else rng.randrange(17) for _ in range(300)]
    for stream in (ids, odd, ids[:100] + [2] * 20 + ids[100:200]):
        lengths = []
        for stop in ((), ("42.\n\nCaf",), ("テキスト",)):
            stream_both(tok, stream, stop, lengths)
        # Never the whole stream: text settles 3 windows behind, more where a character is split
        # or special tokens decode to nothing.
        assert max(lengths) <= (4 * IncrementalDecoder.WINDOW + 1 if stream is ids else len(stream) / 3)


def test_incremental_decoder_matches_whole_decoding_with_sentencepiece_decoders():
    import random

    from tokenizers import decoders

    rng = random.Random(1)
    llama2 = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                decoders.Strip(" ", 1, 0)])
    for decoder in (llama2, decoders.Metaspace(prepend_scheme="first")):
        tok = SentencePieceStyle(decoder)
        word, special = range(256, tok.special), tok.special
        for _ in range(60):
            stream = []
            while len(stream) < 120:
                kind = rng.random()
                if kind < 0.4:  # characters the vocabulary lacks, as byte-fallback runs
                    stream += list("".join(rng.choice("é日🙂ж한") for _ in range(rng.randrange(1, 6))).encode())
                elif kind < 0.9:
                    stream += [rng.choice(word) for _ in range(rng.randrange(1, 4))]
                else:  # a run of skipped special tokens
                    stream += [special] * rng.randrange(1, 12)
            stream_both(tok, stream)


def test_incremental_decoder_streams_multibyte_text(embedded_tokenizer):
    tok = embedded_tokenizer
    text = "Café 🙂🎉 日本語のテキスト — naïve “quotes” ok"
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    deltas = [dec.update(ids[:i], finished=False) for i in range(1, len(ids) + 1)]
    deltas.append(dec.update(ids, finished=True))
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # half characters are held back

    # A stop string split across tokens is found; nothing after it is ever emitted.
    dec = IncrementalDecoder(tok, stop=("テキスト",))
    out = "".join(dec.update(ids[:i], finished=False) for i in range(1, len(ids) + 1))
    assert dec.matched_stop == "テキスト"
    assert out == tok.decode(ids)[:tok.decode(ids).index("テキスト")]
