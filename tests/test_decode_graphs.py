"""The static decode path (fixed buffers, padded batch, page tables padded to max pages) computes
what the dynamic path computes: on CPU it runs eagerly and is compared logit by logit; on a
GPU the same path is captured as CUDA graphs and compared with eager decoding."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.model.static_attention import HAS_TRITON, decode_attention_torch
from common.runner.decode_graphs import DecodeGraphs
from common.tools.gpu.checks import compare_static_decode

PROMPT_LENS = (5, 20, 37)  # three requests at different lengths, on a size-4 graph
STEPS = 32


def test_static_decode_matches_dynamic(make_embedded_runner, embedded_tokenizer):
    runner = make_embedded_runner(page_size=16, num_pages=24)
    ids = embedded_tokenizer.encode("A quiet harbour town wakes up slowly; the bakers first, then the fishermen, "
                                    "then the children who run down to the water before school.")
    graphs = DecodeGraphs(runner, (1, 4), capture=False)
    assert graphs.backend == "torch" and graphs.max_pages == 24
    r = compare_static_decode(runner, graphs, [ids[i:i + n] for i, n in enumerate(PROMPT_LENS)], STEPS)
    # Same K/V in each request's own pages: padded rows wrote only the scratch page.
    assert r["same_tokens"] and r["max_abs_logit_diff"] < 1e-3 and r["max_abs_kv_diff"] < 1e-4, r
    assert runner.pool.num_free == runner.pool.num_pages


def test_engine_outputs_unchanged_with_static_decode(make_embedded_runner, embedded_tokenizer):
    """Requests joining and finishing change the batch size (padded to 1, 2 or 4); batches
    larger than the largest size fall back to extend()."""
    ids = embedded_tokenizer.encode("Count the ships in the bay: one, two, three, four, five, six.")
    runs = []
    for sizes in (None, (1, 2, 4), (1, 2)):
        runner = make_embedded_runner(page_size=8, num_pages=32)
        runner.decode_graphs = sizes and DecodeGraphs(runner, sizes, capture=False)
        engine = Engine(runner, embedded_tokenizer.eos_token_ids)
        reqs = [Request(f"r{i}", ids[i:i + 6 + 3 * i], SamplingParams(max_new_tokens=6 + 2 * i, ignore_eos=True))
                for i in range(3)]
        engine.add(reqs[0])
        engine.step(), engine.step()
        engine.run_all(reqs[1:])
        runs.append([r.output_ids for r in reqs])
    assert runs[1] == runs[0] and runs[2] == runs[0]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_decode_kernel_and_static_path():
    """The Triton kernel against the torch reference, and the static decode path with it
    against extend() on a tiny model. On a GPU in fp32 and bf16 with graphs; without one under
    Triton's interpreter, fp32 only (the interpreter's bf16 tl.dot is wrong even for a plain
    16x16 product)."""
    cuda = torch.cuda.is_available()
    code = ("import json, torch; from common.tools.gpu.checks import kernel_check, tiny_static_check; "
            f"dtypes = [torch.float32] + [torch.bfloat16] * {cuda}; device = {'cuda' if cuda else 'cpu'!r}; "
            "print(json.dumps({'kernel': kernel_check(device, dtypes), "
            f"'static': tiny_static_check(device, 'fp32', 'triton', capture={cuda})}}))")
    env = dict(os.environ) | ({} if cuda else {"TRITON_INTERPRET": "1"})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.splitlines()[-1])
    for case in result["kernel"]:
        assert case["max_abs_err"] < (1e-4 if case["dtype"] == "float32" else 2e-2), case
    static = result["static"]
    assert static["same_tokens"] and static["max_abs_logit_diff"] < 1e-3 and static["max_abs_kv_diff"] < 1e-4, static


def test_torch_decode_attention_reads_only_its_length():
    """Keys past a row's length (stale data, other pages) do not change its output."""
    torch.manual_seed(0)
    kv = torch.randn(2, 9, 4, 2, 8)
    table = torch.tensor([[3, 1, 8, 8], [0, 2, 5, 8]])
    q = torch.randn(2, 4, 8)
    ctx = torch.tensor([6, 9])
    out = decode_attention_torch(q, kv, table, ctx)
    kv[:, 1, 2:] = 1e4  # row 0 reads page 1 only up to offset 1
    kv[:, 5, 1:] = -1e4  # row 1 reads page 5 only at offset 0
    kv[:, 8] = 3e4  # the scratch page (finite: a masked key still meets its value in the product)
    torch.testing.assert_close(decode_attention_torch(q, kv, table, ctx), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_graphs_match_eager(embedded_weights, embedded_tokenizer, dtype):
    from common.runner.model_runner import ModelRunner

    cfg, tensors = embedded_weights
    ids = embedded_tokenizer.encode("The lighthouse keeper climbed the stairs at dusk with a lamp and a notebook.")
    outs = []
    for eager in (True, False):
        runner = ModelRunner(cfg, tensors, dtype=dtype, device="cuda", num_pages=64, page_size=16,
                             enforce_eager=eager)
        assert (runner.decode_graphs is None) == eager
        engine = Engine(runner, embedded_tokenizer.eos_token_ids)
        reqs = [Request(f"r{i}", ids[i:i + 4 + 5 * i], SamplingParams(max_new_tokens=32, ignore_eos=True))
                for i in range(3)]
        engine.run_all(reqs)
        outs.append([r.output_ids for r in reqs])
    if dtype == "fp32":
        assert outs[1] == outs[0]
    else:  # bf16 kernels differ in rounding: the first tokens must agree
        assert all(a[:8] == b[:8] for a, b in zip(outs[0], outs[1])), outs
