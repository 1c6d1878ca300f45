"""The static path (fixed buffers, padded batch, page tables padded to the runner's width) that
CUDA graphs replay computes what the dynamic path computes: decode (T = 1) and verify blocks
(T = 16) through forward_static against extend(), logit by logit, on CPU; the Triton kernel
against the torch reference (under Triton's interpreter without a GPU); and on a GPU, the
engine's graphs against eager decoding."""
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
from common.model.static_attention import HAS_TRITON, static_attention_torch
from common.tools.gpu.checks import compare_static_forward

PROMPT_LENS = (5, 20, 37)  # three requests at different lengths


@pytest.mark.parametrize("T", [1, 16])
def test_static_forward_matches_extend(make_embedded_runner, embedded_tokenizer, T):
    runner = make_embedded_runner(page_size=16, num_pages=48)
    ids = embedded_tokenizer.encode("A quiet harbour town wakes up slowly; the bakers first, then the fishermen, "
                                    "then the children who run down to the water before school.")
    r = compare_static_forward(runner, [ids[i:i + n] for i, n in enumerate(PROMPT_LENS)], steps=3 if T > 1 else 6, T=T)
    # Same K/V in each request's own pages: nothing else was written there.
    assert r["same_tokens"] and r["max_abs_logit_diff"] < 1e-3 and r["max_abs_kv_diff"] < 1e-4, r
    assert runner.pool.num_free == runner.pool.num_pages


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_and_static_path():
    """The Triton kernel against the torch reference, the static path with it (and with the
    fused kernels, with and without per-head q/k norms) against extend() (without them) on a tiny
    model, and the drafter's block step with and without the fused kernels. On a GPU in fp32 and bf16; without one under Triton's
    interpreter, fp32 only (the interpreter's bf16 tl.dot is wrong even for a plain 16x16
    product)."""
    cuda = torch.cuda.is_available()
    code = ("import json, torch; from common.tools.gpu.checks import draft_check, fused_check, kernel_check, tiny_static_check; "
            f"dtypes = [torch.float32] + [torch.bfloat16] * {cuda}; device = {'cuda' if cuda else 'cpu'!r}; "
            "print(json.dumps({'kernel': kernel_check(device, dtypes), "
            "'static': [tiny_static_check(device, 'fp32', 'triton', T) for T in (1, 4)] + "
            "[fused_check(device, 'fp32', T, shape) for shape in ('tiny', 'tiny-qk-norm') for T in (1, 4)], "
            "'draft': draft_check(device, 'fp32')}))")
    env = dict(os.environ) | ({} if cuda else {"TRITON_INTERPRET": "1"})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.splitlines()[-1])
    assert len(result["kernel"]) >= 8
    for case in result["kernel"]:
        assert case["max_abs_err"] < (1e-4 if case["dtype"] == "float32" else 2e-2), case
    for static in result["static"]:
        assert static["same_tokens"] and static["max_abs_logit_diff"] < 1e-3 and static["max_abs_kv_diff"] < 1e-4, static
    assert result["draft"]["same_drafts"] and result["draft"]["max_abs_kv_diff"] < 1e-4, result["draft"]


def test_torch_static_attention_reads_only_its_keys():
    """Keys past what a query may see (stale data, other pages, the rest of its block when
    causal, before the window) do not change its output."""
    torch.manual_seed(0)
    kv = torch.randn(2, 9, 4, 2, 8)
    table = torch.tensor([[3, 1, 8, 8], [0, 2, 5, 8]])
    q = torch.randn(2, 4, 8)
    ctx = torch.tensor([6, 9])
    out = static_attention_torch(q, kv, table, ctx)
    kv[:, 1, 2:] = 1e4  # row 0 reads page 1 only up to offset 1
    kv[:, 5, 1:] = -1e4  # row 1 reads page 5 only at offset 0
    kv[:, 8] = 3e4  # the scratch page (finite: a masked key still meets its value in the product)
    torch.testing.assert_close(static_attention_torch(q, kv, table, ctx), out)
    # T = 2, causal: row 1's first query (position 7) must not see key 8; with a window from
    # key 4, nothing before it counts.
    q2 = torch.randn(4, 4, 8)
    causal = static_attention_torch(q2, kv, table, ctx, T=2)
    start = torch.tensor([0, 4])
    windowed = static_attention_torch(q2, kv, table, ctx, T=2, kv_start=start)
    kv[:, 5, 0] = 7e3  # key 8 of row 1: only its last query sees it
    kv[:, 0, :] = -5e3  # keys 0-3 of row 1: outside its window
    torch.testing.assert_close(static_attention_torch(q2, kv, table, ctx, T=2, kv_start=start)[2], windowed[2])
    assert not torch.allclose(static_attention_torch(q2, kv, table, ctx, T=2)[3], causal[3])


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
        assert runner.use_graphs != eager
        engine = Engine(runner, embedded_tokenizer.eos_token_ids)
        reqs = [Request(f"r{i}", ids[i:i + 4 + 5 * i], SamplingParams(max_new_tokens=32, ignore_eos=True))
                for i in range(3)]
        engine.run_all(reqs)
        outs.append([r.output_ids for r in reqs])
    if dtype == "fp32":
        assert outs[1] == outs[0]
    else:  # bf16 kernels differ in rounding: the first tokens must agree
        assert all(a[:8] == b[:8] for a, b in zip(outs[0], outs[1])), outs


def test_a_launch_takes_query_blocks_that_tl_dot_can_tile():
    """fp32 attention's query blocks (Launch.ieee_block_m): 0 (one program for a row's queries)
    or a power of two of at least 16; anything else is refused before a kernel is built."""
    from common.model.static_attention import Launch

    for ok in (0, 16, 32):
        Launch(ieee_block_m=ok)
    for bad in (8, 24):
        with pytest.raises(ValueError, match="ieee_block_m"):
            Launch(ieee_block_m=bad)
