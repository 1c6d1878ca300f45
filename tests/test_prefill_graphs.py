"""A fresh prompt's prefill at a padded length (common.runner.prefill_graphs), which a GPU replays
from a CUDA graph, run eagerly here: the same logits, captured states and K/V as the prompt's own
prefill, padding writing only the scratch page; and engines that prefill so give the same tokens.
The control changes the prompt's last token: the comparison then fails, so it is tight enough to
see one token's difference."""
from __future__ import annotations

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig
from common.kv.seq_cache import SeqCache
from common.runner.model_runner import ModelRunner
from common.runner.prefill_graphs import PrefillGraphs
from tests.tiny_models import random_model, speculating_engine

CAPTURE = (0, 2)


def with_padded_prefill(runner: ModelRunner) -> PrefillGraphs:
    """The runner's extend() prefills as on a GPU, without graphs."""
    runner.prefill_graphs = PrefillGraphs(runner.model, runner.cache, runner.page_size, runner.scratch_slot,
                                          runner.cfg.max_position, runner.device, graphs=False)
    return runner.prefill_graphs


def slots(runner: ModelRunner, seq: SeqCache, n: int) -> torch.Tensor:
    """The first n tokens' K/V of seq, every layer: [layers, 2, n, heads, dim]."""
    kv = runner.kv[:, :, seq.pages]
    return kv.reshape(*kv.shape[:2], -1, *kv.shape[-2:])[:, :, :n]


def compare(n: int, change_last: bool) -> None:
    cfg, tensors = random_model(num_layers=3)
    runner = ModelRunner(cfg, tensors, num_pages=24, page_size=16)
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    own, padded = SeqCache(), SeqCache()
    runner.reserve(own, n)
    runner.reserve(padded, n)
    out = runner.extend([own], [tokens], capture_layers=CAPTURE)
    graphs = with_padded_prefill(runner)
    other = tokens[:-1] + [(tokens[-1] + 1) % cfg.vocab_size] if change_last else tokens
    hidden, captured = graphs.run(padded.pages, other, CAPTURE)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert close(runner.model.logits(hidden), out.logits)
    for layer in CAPTURE:
        assert captured[layer].shape == out.captured[layer].shape == (n, cfg.hidden_size)
        assert close(captured[layer], out.captured[layer])
    assert close(slots(runner, padded, n), slots(runner, own, n))
    untouched = [p for p in range(runner.pool.num_pages) if p not in own.pages + padded.pages]
    assert not runner.kv[:, :, untouched].any()  # padding went to the scratch page alone


@pytest.mark.parametrize("n", [1, 5, 16, 17, 40])  # padded to 16, 16, 16 (none), 32, 64
def test_padded_prefill_equals_the_prompts_own(n):
    compare(n, change_last=False)


def test_control_a_different_last_token_is_seen():
    with pytest.raises(AssertionError):
        compare(17, change_last=True)


def run(engine: Engine, prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=8 + 3 * i, temperature=0.0)) for i, p in enumerate(prompts)]
    engine.run_all(reqs, concurrency)
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_engines_prefilling_padded_give_the_same_tokens(tmp_path, concurrency):
    """Plain and speculating engines (the drafter's context comes from the captured states);
    at concurrency 3 the first prompts prefill together (eagerly) and later ones alone (padded)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 30, 3, 21, 12)]
    for make in (lambda: Engine(ModelRunner(*random_model(num_layers=2), num_pages=64, page_size=16), ()),
                 lambda: speculating_engine(str(tmp_path / "drafter"), spec=SpecConfig(block=4))):
        expected = run(make(), prompts, concurrency)
        engine = make()
        graphs, padded = with_padded_prefill(engine.runner), []
        graphs.run = lambda *args, run=graphs.run: padded.append(len(args[1])) or run(*args)
        assert run(engine, prompts, concurrency) == expected
        assert padded == ([9, 30, 3, 21, 12] if concurrency == 1 else [21, 12])
        assert engine.runner.pool.num_free == engine.runner.pool.num_pages
