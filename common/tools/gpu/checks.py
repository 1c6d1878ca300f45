"""Correctness checks of the static (CUDA-graph) path that the GPU check command runs and the
tests reuse on CPU: the Triton static attention kernel against the torch reference, the
static forward (decode and verify shapes) against extend(), with and without the fused kernels,
the drafter's block step with and without them, and a fresh prompt's padded prefill (a CUDA graph
on a GPU) against its eager prefill."""
from __future__ import annotations

import contextlib

import torch

from common.kv.seq_cache import SeqCache
from common.model import fused
from common.model.attention import table_slots
from common.model.shapes import SHAPES, random_token_ids, random_weights
from common.model.static_attention import StaticAttn, static_attention_torch, static_attention_triton
from common.runner.model_runner import ModelRunner


def kernel_check(device: str, dtypes: list[torch.dtype]) -> list[dict]:
    """Max |Triton - torch reference| of static attention over scattered pages, per case."""
    torch.manual_seed(0)
    # (q heads, kv heads, head dim, page size, context lengths, T, causal, window): one-key
    # decode rows, rows that end on a page boundary, long rows, a batch of 32 x 8 KV heads,
    # verify blocks (causal, T = 16, and T = 6, whose 18 queries per KV head take a second block
    # of queries in fp32) and draft blocks (both ways, with and without a window).
    # Under Triton's interpreter (no GPU) the 32-head cases run 8 heads over 2 KV heads: the same
    # 4 query heads a KV head, a quarter of the programs (on two cores each took 18 s of the
    # check's 58 with 32 heads).
    wide = (32, 8) if torch.device(device).type == "cuda" else (8, 2)
    cases = [(9, 3, 64, 16, [1, 37, 100], 1, True, None), (8, 2, 128, 4, [5, 64, 700], 1, True, None),
             (*wide, 128, 64, [1, 65, 300, 7], 1, True, None),
             (*wide, 128, 64, [3 + 9 * i for i in range(32)], 1, True, None),
             (9, 3, 64, 16, [16, 40, 300], 16, True, None), (*wide, 128, 64, [20, 129, 700], 16, True, None),
             (9, 3, 64, 16, [16, 40, 300], 6, True, None),
             (9, 3, 64, 16, [16, 40, 300], 16, False, None), (9, 3, 64, 16, [16, 40, 300], 16, False, 24)]
    results = []
    for dtype in dtypes:
        for hq, hkv, d, page, lens, T, causal, window in cases:
            num_pages = sum(-(-n // page) for n in lens) + 3
            max_pages = max(-(-n // page) for n in lens) + 2
            kv = torch.randn(2, num_pages + 1, page, hkv, d, dtype=dtype, device=device)
            table = torch.full((len(lens), max_pages), num_pages, dtype=torch.long)
            free = torch.randperm(num_pages).tolist()
            for b, n in enumerate(lens):
                for j in range(-(-n // page)):
                    table[b, j] = free.pop()
            table = table.to(device)
            q = torch.randn(len(lens) * T, hq, d, dtype=dtype, device=device)
            kv_len = torch.tensor(lens, device=device)
            start = None if window is None else (kv_len - T - window).clamp(min=0)
            ref = static_attention_torch(q.float(), kv.float(), table, kv_len, T, causal, start)
            got = static_attention_triton(q, kv, table, kv_len, T, causal, start).float()
            results.append({"dtype": str(dtype).removeprefix("torch."), "heads": f"{hq}/{hkv}", "head_dim": d,
                            "page_size": page, "rows": len(lens), "T": T, "causal": causal, "window": window,
                            "max_abs_err": (got - ref).abs().max().item()})
    return results


def compare_static_forward(runner: ModelRunner, prompts: list[list[int]], steps: int, T: int = 1,
                           backend: str | None = None, unfused_reference: bool = False) -> dict:
    """Run the prompts twice in one runner, in different pages (prefilled once, the prompts' K/V
    copied to the second), T tokens per row per step: through forward_static (page tables padded
    to the runner's width, as graphs see them) and through extend() (with `unfused_reference`,
    without the fused kernels). Returns the largest logit difference, whether the greedy tokens
    stayed equal, and whether each request's pages ended with the same K/V."""
    page, device = runner.page_size, runner.device
    width = runner.max_pages + 1

    def reserved() -> list[SeqCache]:
        seqs = [SeqCache() for _ in prompts]
        for s, p in zip(seqs, prompts):
            runner.reserve(s, len(p) + steps * T)
        return seqs

    dyn, static = reserved(), reserved()
    first = runner.extend(dyn, prompts).logits.argmax(-1).tolist()
    dyn_tok, static_tok = [[t] * T for t in first], [[t] * T for t in first]
    # The second copy starts from the first's prompt K/V, copied: a second prefill computed the
    # same pages again, and under Triton's interpreter a prefill through the fused kernels is most
    # of a fused check's time. Attention models only: a recurrent state would need copying too.
    assert runner.state_pool is None, "compare_static_forward copies K/V pages only"
    for a, b in zip(dyn, static):
        runner.kv[:, :, b.pages] = runner.kv[:, :, a.pages]
        b.length = a.length
    worst, same_tokens = 0.0, True
    with torch.inference_mode():
        for _ in range(steps):
            with fused.disabled() if unfused_reference else contextlib.nullcontext():
                expected = runner.extend(dyn, dyn_tok, all_logits=True).logits
            table = torch.full((len(static), width), runner.scratch_page, dtype=torch.long)
            for i, s in enumerate(static):
                table[i, :len(s.pages)] = torch.tensor(s.pages)
            table = table.to(device)
            starts = torch.tensor([s.length for s in static], device=device)
            positions = starts[:, None] + torch.arange(T, device=device)[None, :]
            slots = table_slots(table, positions, page).flatten()
            attn = StaticAttn(table, starts + T, T, causal=True, backend=backend or runner.static_backend)
            ids = torch.tensor([t for row in static_tok for t in row], device=device)
            hidden, _ = runner.forward_static(ids, positions.flatten(), slots, attn)
            got = runner.model.logits(hidden)
            for s in static:
                s.length += T
            worst = max(worst, (got - expected).abs().max().item())
            dyn_tok = expected.argmax(-1).view(len(prompts), T).tolist()
            static_tok = got.argmax(-1).view(len(prompts), T).tolist()
            same_tokens &= dyn_tok == static_tok
    kv_err = 0.0
    for a, b in zip(dyn, static):
        ka = runner.kv[:, :, a.pages].flatten(2, 3)[:, :, :a.length].float()
        kb = runner.kv[:, :, b.pages].flatten(2, 3)[:, :, :b.length].float()
        kv_err = max(kv_err, (ka - kb).abs().max().item())
        runner.release(a), runner.release(b)
    return {"max_abs_logit_diff": worst, "same_tokens": same_tokens, "max_abs_kv_diff": kv_err, "T": T}


def fused_check(device: str, dtype: str, T: int, shape: str = "embedded") -> dict:
    """Random weights of `shape`: the static step with the fused kernels against extend()
    without them, 3 requests at different lengths, 8 steps."""
    cfg = SHAPES[shape]
    runner = ModelRunner(cfg, random_weights(cfg, torch.float32, device), dtype=dtype, device=device,
                         num_pages=24, page_size=64)
    prompts = [random_token_ids(cfg, n, seed=n) for n in (5, 70, 300)]
    return compare_static_forward(runner, prompts, steps=8, T=T, unfused_reference=True) | {"dtype": dtype, "shape": shape}


def tiny_static_check(device: str, dtype: str, backend: str, T: int) -> dict:
    """compare_static_forward on the tiny random shape: 3 requests at different lengths, 8 steps."""
    cfg = SHAPES["tiny"]
    runner = ModelRunner(cfg, random_weights(cfg, torch.float32, "cpu"), dtype=dtype, device=device,
                         num_pages=24, page_size=16)
    prompts = [random_token_ids(cfg, n, seed=n) for n in (5, 20, 37)]
    return compare_static_forward(runner, prompts, steps=8, T=T, backend=backend) | {"dtype": dtype, "backend": backend}


def draft_check(device: str, dtype: str) -> dict:
    """DFlashProposer.draft with the fused kernels against it without them: the tiny shape and a
    two-layer drafter with random weights (its norms' too), 3 rows at different context lengths
    over a random draft context. Whether the drafts are equal, and the largest difference of the
    block K/V they write."""
    from common.dflash.drafter import Drafter, DrafterConfig
    from common.dflash.proposer import DFlashProposer

    cfg, B = SHAPES["tiny"], 4
    runner = ModelRunner(cfg, random_weights(cfg, torch.float32, "cpu"), dtype=dtype, device=device,
                         num_pages=24, page_size=16)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.for_target(cfg, num_layers=2, capture_layers=(0, 1), block_size=B))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:  # not ones: a kernel that skipped a weight would pass
                p.add_(0.2 * torch.randn_like(p))
    proposer = DFlashProposer(drafter.to(device=device, dtype=runner.dtype), runner, runner.pool.num_pages)
    proposer.kv.normal_(generator=torch.Generator(device).manual_seed(1))
    page = runner.page_size
    length = torch.tensor([5, 20, 37], device=device)
    table = torch.full((3, runner.max_pages + 1), proposer.scratch_slot // page, dtype=torch.long)
    for i in range(3):
        table[i, :3] = torch.arange(3 * i, 3 * i + 3)
    table = table.to(device)
    positions = length[:, None] + torch.arange(B, device=device)[None, :]
    slots = table_slots(table, positions, page).flatten()
    last = torch.tensor([7, 11, 13], device=device)

    def block_step() -> tuple[list[list[int]], torch.Tensor]:
        drafts = proposer.draft(last, length, table, B)
        return drafts.tolist(), proposer.kv.flatten(2, 3)[:, :, slots].float()

    with torch.inference_mode():
        drafts, kv = block_step()
        with fused.disabled():
            expected, expected_kv = block_step()
    return {"same_drafts": drafts == expected, "max_abs_kv_diff": (kv - expected_kv).abs().max().item(), "dtype": dtype}


def prefill_check(device: str, dtype: str, shape: str, lengths: tuple[int, ...]) -> list[dict]:
    """Random weights of `shape`: each prompt prefilled at its padded length through
    common.runner.prefill_graphs (the runner's CUDA graphs on a GPU, the same code eagerly
    elsewhere) against extend()'s eager prefill of it in other pages. Per length: the largest
    difference of the last token's logits, of the captured layers' states and of the prompt's
    K/V; whether every cache slot but the two prompts' and the scratch page's stayed zero (so the
    padding wrote nowhere else); and, as a control, the logit difference when the padded prompt's
    last token is another one. `ok`: all that holds, fp32 within 1e-4, the control over 1e-3."""
    cfg = SHAPES[shape]
    runner = ModelRunner(cfg, random_weights(cfg, torch.float32, "cpu"), dtype=dtype, device=device,
                         num_pages=4 * -(-max(lengths) // 16), page_size=16)
    graphs = runner.prefill_graphs or runner.padded_prefill(graphs=False)
    runner.prefill_graphs = None  # extend() prefills eagerly: the reference
    capture = (0, cfg.num_layers - 1)
    rows = []
    for n in lengths:
        tokens = random_token_ids(cfg, n, seed=n)
        own, padded = SeqCache(), SeqCache()
        runner.reserve(own, n)
        runner.reserve(padded, n)
        with torch.inference_mode():  # as the engine runs: no autograd over the weights
            runner.kv.zero_()
            out = runner.extend([own], [tokens], capture_layers=capture)
            changed = tokens[:-1] + [tokens[-1] % (cfg.vocab_size - 1) + 1]
            control = runner.model.logits(graphs.run(padded.pages, changed, capture)[0])
            hidden, captured = graphs.run(padded.pages, tokens, capture)
            logits = runner.model.logits(hidden)
        slots = runner.kv[:, :, :runner.pool.num_pages].flatten(2, 3).float()  # every slot but the scratch page's
        prompt_slots = [table_slots(torch.tensor([s.pages]), torch.arange(n)[None], runner.page_size)[0]
                        for s in (own, padded)]
        elsewhere = torch.ones(slots.shape[2], dtype=torch.bool, device=slots.device)
        elsewhere[torch.cat(prompt_slots)] = False
        row = {"device": device, "dtype": dtype, "shape": shape, "tokens": n,
               "max_abs_logit_diff": (logits - out.logits).abs().max().item(),
               "max_abs_captured_diff": max((captured[i] - out.captured[i]).abs().max().item() for i in capture),
               "max_abs_kv_diff": (slots[:, :, prompt_slots[1]] - slots[:, :, prompt_slots[0]]).abs().max().item(),
               "padding_in_scratch_only": not slots[:, :, elsewhere].any().item(),
               "control_logit_diff": (control - out.logits).abs().max().item()}
        tolerance = 1e-4 if dtype == "fp32" else float("inf")
        row["ok"] = (max(row["max_abs_logit_diff"], row["max_abs_captured_diff"], row["max_abs_kv_diff"]) <= tolerance
                     and row["padding_in_scratch_only"] and row["control_logit_diff"] > 1e-3)
        rows.append(row)
        runner.release(own)
        runner.release(padded)
    return rows
