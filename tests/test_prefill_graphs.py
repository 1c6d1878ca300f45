"""A fresh prompt's prefill at a padded length (common.runner.prefill_graphs), which a GPU replays
from a CUDA graph, run eagerly here through the GPU check's own comparison (`gpu-check --parts
prefill`): the same logits, captured states and K/V as the prompt's own prefill, padding writing
only the scratch page; and engines that prefill so give the same tokens. The control changes the
prompt's last token: the logits then differ by far more than the tolerance."""
from __future__ import annotations

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig
from common.runner.model_runner import ModelRunner
from common.runner.prefill_graphs import PrefillGraphs, padded_length
from common.tools.gpu.checks import prefill_check
from tests.tiny_models import random_model, speculating_engine


def with_padded_prefill(runner: ModelRunner) -> PrefillGraphs:
    """The runner's extend() prefills as on a GPU, without graphs."""
    runner.prefill_graphs = runner.padded_prefill(graphs=False)
    return runner.prefill_graphs


def test_padded_lengths():
    """Powers of two up to 64 tokens, multiples of 64 above."""
    assert [padded_length(n) for n in (1, 16, 17, 33, 64, 65, 128, 129, 257, 512)] == \
        [16, 16, 32, 64, 64, 128, 128, 192, 320, 512]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """Lengths padded to 16, 16, 16 (none), 32, 64."""
    return prefill_check("cpu", "fp32", "tiny", (1, 5, 16, 17, 40))


def test_padded_prefill_equals_the_prompts_own(rows):
    for r in rows:
        assert r["max_abs_logit_diff"] < 1e-5 and r["max_abs_captured_diff"] < 1e-5, r
        assert r["max_abs_kv_diff"] < 1e-5 and r["padding_in_scratch_only"] and r["ok"], r


def test_control_a_different_last_token_is_seen(rows):
    assert all(r["control_logit_diff"] > 1e-3 for r in rows), rows


def run(engine: Engine, prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=8 + 3 * i, temperature=0.0))
            for i, p in enumerate(prompts)]
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
