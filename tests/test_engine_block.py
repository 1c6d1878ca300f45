"""The block forward (speculative verify): several new tokens per request against the cache, in
one batched call, equal feeding them one at a time; truncate() then re-extend equals a fresh run."""
from __future__ import annotations

import pytest
import torch

from common.kv.seq_cache import SeqCache

# fp32: the same math in different shapes (batched + masked vs one query) differs by ~1e-5.
TOL = dict(rtol=1e-4, atol=2e-4)


@pytest.fixture(scope="module")
def texts(embedded_tokenizer):
    enc = embedded_tokenizer.encode
    prompts = [enc("The quick brown fox jumps over the lazy dog near the river bank"),
               enc("Once upon a time"),
               enc("In 1969, astronauts first landed on the Moon. The mission was called Apollo 11, and")]
    blocks = [enc(" and then it ran away"), enc(","), enc(" the crew of three men flew for eight days")]
    return prompts, blocks


def _fresh(runner, ids_parts: list[list[int]]) -> tuple[SeqCache, list[torch.Tensor]]:
    """A new sequence fed ids_parts one extend() call each; logits of every new token."""
    seq = SeqCache()
    runner.reserve(seq, sum(map(len, ids_parts)))
    out = [runner.extend([seq], [part], all_logits=True).logits for part in ids_parts]
    return seq, out


def test_block_forward_equals_one_at_a_time(embedded_runner, texts):
    runner = embedded_runner
    prompts, blocks = texts
    assert len({len(b) for b in blocks}) == 3 and len({len(p) for p in prompts}) == 3
    seqs = [SeqCache() for _ in prompts]
    for s, p, b in zip(seqs, prompts, blocks):
        runner.reserve(s, len(p) + len(b))
    try:
        runner.extend(seqs, prompts)  # batched prefill of three different lengths
        out = runner.extend(seqs, blocks, all_logits=True)
        assert out.logits.shape == (sum(map(len, blocks)), runner.cfg.vocab_size)
        assert [s.length for s in seqs] == [len(p) + len(b) for p, b in zip(prompts, blocks)]
        rows = torch.split(out.logits, [len(b) for b in blocks])
        for p, b, got in zip(prompts, blocks, rows):
            ref_seq, ref = _fresh(runner, [p] + [[t] for t in b])
            runner.release(ref_seq)
            torch.testing.assert_close(got, torch.cat(ref[1:]), **TOL)
        # Without all_logits: one row per request, its last new token.
        last = runner.extend(seqs, [[b[-1]] for b in blocks]).logits
        assert last.shape == (3, runner.cfg.vocab_size)
    finally:
        for s in seqs:
            runner.release(s)
    assert runner.pool.num_free == runner.pool.num_pages


def test_truncate_then_reextend_equals_fresh(embedded_runner, texts):
    runner = embedded_runner
    prompts, blocks = texts
    p, b = prompts[2], blocks[2]
    other = [t + 1 for t in b[1:4]]  # rejected draft: keep b[0], replace the rest
    seq = SeqCache()
    runner.reserve(seq, len(p) + len(b))
    try:
        runner.extend([seq], [p])
        runner.extend([seq], [b], all_logits=True)
        pages = list(seq.pages)
        runner.truncate(seq, len(p) + 1)
        assert seq.length == len(p) + 1 and seq.pages == pages  # pages stay reserved
        got = runner.extend([seq], [other], all_logits=True).logits
        with pytest.raises(ValueError):
            runner.truncate(seq, seq.length + 1)
    finally:
        runner.release(seq)
    ref_seq, ref = _fresh(runner, [p + b[:1] + other])
    runner.release(ref_seq)
    torch.testing.assert_close(got, ref[0][-len(other):], **TOL)
    assert runner.pool.num_free == runner.pool.num_pages


def test_extend_needs_reserved_pages(embedded_runner):
    runner = embedded_runner
    seq = SeqCache()
    runner.reserve(seq, 3)
    try:
        with pytest.raises(RuntimeError, match="pages"):
            runner.extend([seq], [list(range(10, 10 + runner.page_size + 1))])
        assert seq.length == 0
    finally:
        runner.release(seq)
