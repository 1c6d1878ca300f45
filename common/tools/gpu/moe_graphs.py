"""The `moe-graphs` part of `pdflash gpu-check`: MoE models decoding in CUDA graphs give what eager
steps give, in fp32 (the dense expert path) and in bf16 (grouped matmuls).

  fp32  tiny DeepSeek-V3 and Kimi-Linear checkpoints (random weights, written by transformers:
        common.tools.tiny_hf): greedy tokens through the engine, graphs against eager, prompt by
        prompt (batch 1) and all at once (a mixed batch padded to a graph's size): must be
        identical; decode logits (graphs, fed the greedy tokens) against transformers' on the
        CPU: within FP32_TOL
  bf16  the same checkpoints and the small random DeepSeek-V3 / Kimi-Linear shapes: decode
        logits with graphs against eager (both fed eager's greedy tokens): within BF16_TOL of
        the largest logit, and eager against a second eager run (non-deterministic kernels show
        there); how many greedy outputs (mixed batch) are identical, and at each
        first divergence the gap between eager's two best logits there: a gap within the
        graphs-eager logit difference is a near-tie that bf16 rounding flips, not a fault

Writes moe_graphs.json. Without CUDA it runs on the CPU, where nothing is captured (the rows say
`cuda_graphs: false`): the code is checked, not the graphs.
"""
from __future__ import annotations

import json
import os
import uuid

import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.seq_cache import SeqCache
from common.model.attention import table_slots
from common.model.config import ModelConfig
from common.model.shapes import SHAPES, RandomWeights, random_token_ids
from common.model.static_attention import StaticAttn
from common.model.source import resolve_model
from common.model.weights import load_weights
from common.runner.graphs import GraphCache
from common.runner.model_runner import ModelRunner
from common.tools.tiny_hf import write_deepseek, write_kimi_linear

CHECKPOINTS = {"deepseek-v3-tiny": (write_deepseek, "qlora_yarn_grouped"),
               "kimi-linear-tiny": (write_kimi_linear, "checkpoint_style")}
PROMPT_LENGTHS = (3, 17, 40, 9, 26)  # 5 at once: a graph of 8 rows, 3 of them padding
NEW_TOKENS = 16
FP32_TOL = 1e-3  # max |ours - transformers| of a logit, fp32 (logits of a few units)
BF16_TOL = 0.05  # max |graphs - eager| of a logit over the largest |logit|, bf16


@torch.inference_mode()
def step_logits(runner: ModelRunner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits before each of `tokens` ([len(tokens), vocab], fp32, on the CPU): the first from
    prefilling the prompt, the others from decode steps (forward_static, one token) fed the
    token before, replayed from a CUDA graph where the runner uses graphs."""
    seq = SeqCache()
    runner.reserve(seq, len(prompt) + len(tokens))
    rows = [runner.extend([seq], [prompt]).logits[0].float()]
    device = runner.device
    ids, length, slot = (torch.zeros(1, dtype=torch.long, device=device) for _ in range(3))
    table = torch.full((1, runner.max_pages + 1), runner.scratch_page, dtype=torch.long, device=device)

    def step() -> torch.Tensor:
        attn = StaticAttn(table, length + 1, 1, causal=True, backend=runner.static_backend)
        slots = table_slots(table, length[:, None], runner.page_size).flatten()
        hidden, _ = runner.forward_static(ids, length, slots, attn, (), slot if runner.state_pool is not None else None)
        return runner.model.logits(hidden)[0].float()

    graphs = GraphCache(runner.use_graphs)
    if graphs.enabled:  # capturing runs the step once: over the scratch page and state slot 0, owned by no one
        graphs.capture("decode", step)
    table[0, :len(seq.pages)] = torch.tensor(seq.pages, device=device)
    slot.fill_(seq.state_slot)
    for t in tokens[:-1]:
        ids.fill_(t)
        length.fill_(seq.length)
        rows.append(graphs.run("decode", step).clone())
        seq.length += 1
    runner.release(seq)
    return torch.stack(rows).cpu()


def greedy(runner: ModelRunner, prompts: list[list[int]], concurrency: int | None) -> list[list[int]]:
    """NEW_TOKENS greedy tokens of each prompt through the engine, `concurrency` at a time (None: all)."""
    reqs = [Request(uuid.uuid4().hex, p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts]
    Engine(runner, ()).run_all(reqs, concurrency)
    return [r.output_ids for r in reqs]


def runners(cfg: ModelConfig, weights, device: str, dtype: str, prompts: list) -> dict[str, ModelRunner]:
    """A runner with CUDA graphs (where the device has them) and an eager one."""
    return {name: ModelRunner(cfg, weights, dtype=dtype, device=device, num_pages=64, page_size=16,
                              enforce_eager=eager, state_slots=len(prompts))
            for name, eager in (("graphs", False), ("eager", True))}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def fp32_check(name: str, folder: str, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    cfg, tensors = load_weights(resolve_model(folder))
    prompts = [random_token_ids(cfg, n, seed=n) for n in PROMPT_LENGTHS]
    run = runners(cfg, tensors, device, "fp32", prompts)
    row: dict = {"model": name, "dtype": "fp32", "cuda_graphs": run["graphs"].use_graphs, "requests": len(prompts)}
    outs = {}
    for batch, concurrency in (("batch 1", 1), ("mixed", None)):
        outs[batch] = {k: greedy(r, prompts, concurrency) for k, r in run.items()}
        first = [first_divergence(g, e) for g, e in zip(outs[batch]["graphs"], outs[batch]["eager"])]
        row[batch] = {"identical": sum(f is None for f in first), "first_divergence": first}
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    worst = 0.0
    for prompt, out in zip(prompts, outs["batch 1"]["graphs"]):
        ours = step_logits(run["graphs"], prompt, out)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        worst = max(worst, (ours - ref).abs().max().item())
    row["max_abs_logit_diff_vs_transformers"] = worst
    row["ok"] = row["batch 1"]["identical"] == row["mixed"]["identical"] == len(prompts) and worst <= FP32_TOL
    return row


def bf16_check(name: str, cfg: ModelConfig, weights, device: str) -> dict:
    prompts = [random_token_ids(cfg, n, seed=n) for n in PROMPT_LENGTHS]
    run = runners(cfg, weights, device, "bf16", prompts)
    outs = {k: greedy(r, prompts, None) for k, r in run.items()}
    worst, rerun, largest, divergences = 0.0, 0.0, 0.0, []
    for prompt, g, e in zip(prompts, outs["graphs"], outs["eager"]):
        eager = step_logits(run["eager"], prompt, e)
        diff = (step_logits(run["graphs"], prompt, e) - eager).abs().max().item()
        # Eager against itself: what is left of graphs - eager if a kernel of the step is not
        # deterministic (a random model turns one bf16 rounding into logits percents apart).
        rerun = max(rerun, (step_logits(run["eager"], prompt, e) - eager).abs().max().item())
        worst, largest = max(worst, diff), max(largest, eager.abs().max().item())
        i = first_divergence(g, e)
        if i is not None:
            top2 = eager[i].topk(2).values
            divergences.append({"at": i, "top2_gap": (top2[0] - top2[1]).item(), "logit_diff": diff})
    return {"model": name, "dtype": "bf16", "cuda_graphs": run["graphs"].use_graphs, "requests": len(prompts),
            "identical": len(prompts) - len(divergences), "divergences": divergences,
            "max_abs_logit_diff": worst, "eager_rerun_max_abs_logit_diff": rerun, "max_abs_logit": largest,
            "ok": worst <= BF16_TOL * largest}


def moe_graphs(out_dir: str) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "fp32": [], "bf16": []}
    folders = {}
    for name, (write, variant) in CHECKPOINTS.items():
        folders[name] = os.path.join(out_dir, "moe_graphs_models", name)
        write(variant, folders[name])
        result["fp32"].append(fp32_check(name, folders[name], device))
    for name, folder in folders.items():
        result["bf16"].append(bf16_check(name, *load_weights(resolve_model(folder)), device))
    for shape in ("deepseek-small", "kimi-linear-small"):
        result["bf16"].append(bf16_check(shape, SHAPES[shape], RandomWeights(seed=3), device))
    result["ok"] = all(r["ok"] for r in result["fp32"] + result["bf16"])
    result["lines"] = summary_lines(result)
    with open(os.path.join(out_dir, "moe_graphs.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def summary_lines(result: dict) -> list[str]:
    lines = []
    for r in result["fp32"]:
        lines.append(f"fp32 {r['model']:17} graphs {'on' if r['cuda_graphs'] else 'OFF'}: identical to eager "
                     f"{r['batch 1']['identical']}/{r['requests']} at batch 1, {r['mixed']['identical']}/{r['requests']}"
                     f" mixed; max |logit - transformers| {r['max_abs_logit_diff_vs_transformers']:.1e}"
                     f" {'ok' if r['ok'] else 'FAIL'}")
    for r in result["bf16"]:
        gaps = ", ".join(f"@{d['at']} gap {d['top2_gap']:.3f}" for d in r["divergences"]) or "none"
        lines.append(f"bf16 {r['model']:17} graphs {'on' if r['cuda_graphs'] else 'OFF'}: max |graphs - eager| logit "
                     f"{r['max_abs_logit_diff']:.2e} of {r['max_abs_logit']:.1f} {'ok' if r['ok'] else 'FAIL'} "
                     f"(eager rerun {r['eager_rerun_max_abs_logit_diff']:.2e}); "
                     f"greedy identical {r['identical']}/{r['requests']}; divergences: {gaps}")
    return lines
