"""Correctness checks of the CUDA path that the GPU check command runs and the tests reuse on
CPU: the Triton paged decode kernel against the torch reference, and the static decode path
(CUDA graphs or not) against extend()."""
from __future__ import annotations

import torch

from common.kv.seq_cache import SeqCache
from common.model.shapes import SHAPES, random_token_ids, random_weights
from common.runner.decode_graphs import DecodeGraphs
from common.runner.model_runner import ModelRunner


def kernel_check(device: str, dtypes: list[torch.dtype]) -> list[dict]:
    """Max |Triton - torch reference| of decode attention over scattered pages, per case."""
    from common.model.static_attention import decode_attention_torch, decode_attention_triton

    torch.manual_seed(0)
    # (q heads, kv heads, head dim, page size, context lengths): one-key rows, rows that end
    # on a page boundary, long rows, and a batch of 32 x 8 KV heads (one context slice each).
    cases = [(9, 3, 64, 16, [1, 37, 100]), (8, 2, 128, 4, [5, 64, 700]),
             (32, 8, 128, 64, [1, 65, 300, 7]), (32, 8, 128, 64, [3 + 9 * i for i in range(32)])]
    results = []
    for dtype in dtypes:
        for hq, hkv, d, page, lens in cases:
            num_pages = sum(-(-n // page) for n in lens) + 3
            max_pages = max(-(-n // page) for n in lens) + 2
            kv = torch.randn(2, num_pages + 1, page, hkv, d, dtype=dtype, device=device)
            table = torch.full((len(lens), max_pages), num_pages, dtype=torch.long)
            free = torch.randperm(num_pages).tolist()
            for b, n in enumerate(lens):
                for j in range(-(-n // page)):
                    table[b, j] = free.pop()
            table = table.to(device)
            q = torch.randn(len(lens), hq, d, dtype=dtype, device=device)
            ctx = torch.tensor(lens, device=device)
            ref = decode_attention_torch(q.float(), kv.float(), table, ctx)
            got = decode_attention_triton(q, kv, table, ctx).float()
            results.append({"dtype": str(dtype).removeprefix("torch."), "heads": f"{hq}/{hkv}", "head_dim": d,
                            "page_size": page, "rows": len(lens), "max_abs_err": (got - ref).abs().max().item()})
    return results


def compare_static_decode(runner: ModelRunner, graphs: DecodeGraphs, prompts: list[list[int]],
                          steps: int) -> dict:
    """Decode the prompts twice in one runner, in different pages: through `graphs` and through
    extend(). Returns the largest logit difference, whether the greedy tokens stayed equal,
    and whether each request's pages ended with the same K/V."""
    def prefill() -> tuple[list[SeqCache], list[int]]:
        seqs = [SeqCache() for _ in prompts]
        for s, p in zip(seqs, prompts):
            runner.reserve(s, len(p) + steps)
        return seqs, runner.extend(seqs, prompts).logits.argmax(-1).tolist()

    dyn, dyn_tok = prefill()
    static, static_tok = prefill()
    saved, runner.decode_graphs = runner.decode_graphs, graphs
    worst, same_tokens = 0.0, True
    try:
        for _ in range(steps):
            expected = runner.extend(dyn, [[t] for t in dyn_tok]).logits
            got = runner.decode(static, static_tok)
            worst = max(worst, (got - expected).abs().max().item())
            dyn_tok, static_tok = expected.argmax(-1).tolist(), got.argmax(-1).tolist()
            same_tokens &= dyn_tok == static_tok
    finally:
        runner.decode_graphs = saved
    kv_err = 0.0
    for a, b in zip(dyn, static):
        ka = runner.kv[:, :, a.pages].flatten(2, 3)[:, :, :a.length].float()
        kb = runner.kv[:, :, b.pages].flatten(2, 3)[:, :, :b.length].float()
        kv_err = max(kv_err, (ka - kb).abs().max().item())
        runner.release(a), runner.release(b)
    return {"max_abs_logit_diff": worst, "same_tokens": same_tokens, "max_abs_kv_diff": kv_err}


def tiny_static_check(device: str, dtype: str, backend: str, capture: bool) -> dict:
    """compare_static_decode on the tiny random shape: 3 requests at different lengths on a
    size-4 graph, 32 steps."""
    cfg = SHAPES["tiny"]
    runner = ModelRunner(cfg, random_weights(cfg, torch.float32, "cpu"), dtype=dtype, device=device,
                         num_pages=24, page_size=16, enforce_eager=True)
    graphs = DecodeGraphs(runner, (1, 4), capture=capture, backend=backend)
    prompts = [random_token_ids(cfg, n, seed=n) for n in (5, 20, 37)]
    return compare_static_decode(runner, graphs, prompts, steps=32) | {
        "dtype": dtype, "backend": backend, "cuda_graphs": capture}
