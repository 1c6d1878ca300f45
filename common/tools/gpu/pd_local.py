"""gpu-check part `pd-local`: PD on one GPU with the local transport (CUDA IPC, device to device).

1. `pdflash up --mode pd` on cuda, fp32: a few prompts (and a 2K-token one) through it, greedy,
   against the single-process engine on the same GPU: identical tokens, and every room's KV
   copied locally (meta_info transfer_transport).
2. `pdflash bench ab --interleave` over that stack, the same with `--no-local-transfer` (Mooncake
   TCP) and a colocated replica: TTFT of 2K-token prompts, 32 new tokens, one at a time.
Needs Mooncake (the services start it, the fallback and the TCP arm use it).
"""
from __future__ import annotations

import json
import os
import random

import requests

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.runner.model_runner import ModelRunner
from common.tools import cli
from common.tools.bench.client import random_ids
from common.tools.bench.stack import Stack

STACK = ["--device", "cuda", "--dtype", "fp32", "--page-size", "64", "--kv-pages", "256"]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Write a short poem about the sea."]
NEW_TOKENS = 32
INPUT_LEN, TTFT_REQUESTS = 2048, 16
TARGET_X_COLOCATED = 1.2  # pd TTFT / colocated TTFT


def pd_local(out_dir: str, model: str | None) -> dict:
    from common.model.tokenizer import Tokenizer
    from common.model.source import resolve_model
    from common.model.weights import load_weights

    src = resolve_model(model)
    cfg, tensors = load_weights(src)
    tok = Tokenizer(src, cfg.eos_token_ids)
    prompts = [tok.encode(p) for p in TEXT_PROMPTS] + [random_ids(random.Random(0), INPUT_LEN, cfg.vocab_size)]
    expected = _engine_greedy(cfg, tensors, tok.eos_token_ids, prompts)
    model_args = ["--model", model] if model else []
    with Stack(["--mode", "pd", *STACK, *model_args], log_path=os.path.join(out_dir, "pd_local_stack.log")) as stack:
        got = [_generate(stack.url, ids) for ids in prompts]
        greedy = {"prompts": len(prompts), "identical": sum(g["output_ids"] == e for g, e in zip(got, expected)),
                  "first_divergence": [next((i for i, (a, b) in enumerate(zip(g["output_ids"], e)) if a != b), None)
                                       for g, e in zip(got, expected)],
                  "transports": [g["meta_info"].get("transfer_transport") for g in got]}
        ttft = _ttft(stack.url, out_dir, model_args)
    return {"greedy": greedy, "ttft": ttft}


def _engine_greedy(cfg, tensors, eos: tuple[int, ...], prompts: list[list[int]]) -> list[list[int]]:
    """The single-process engine on the same GPU, one prompt at a time (as the stack serves them)."""
    runner = ModelRunner(cfg, tensors, dtype="fp32", device="cuda", num_pages=64, page_size=64)
    engine = Engine(runner, eos)
    reqs = [Request(str(i), ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
            for i, ids in enumerate(prompts)]
    engine.run_all(reqs, concurrency=1)
    return [r.output_ids for r in reqs]


def _generate(url: str, ids: list[int]) -> dict:
    resp = requests.post(url + "/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    resp.raise_for_status()
    return resp.json()


def _ttft(local_url: str, out_dir: str, model_args: list[str]) -> dict:
    """bench ab, interleaved: colocated (the baseline), pd with the local transport (the stack
    already up), pd over Mooncake TCP. Per arm: TTFT mean and p50, and the transports seen."""
    up = " ".join([*STACK, *model_args])
    ab_dir = os.path.join(out_dir, "pd_local_ab")
    rc = cli.main(["bench", "ab", "--interleave", "--stack", f"colocated=--mode colocated {up}",
                   "--stack", f"pd-local={local_url}", "--stack", f"pd-mooncake=--mode pd --no-local-transfer {up}",
                   "serving", "--input-len", str(INPUT_LEN), "--output-len", str(NEW_TOKENS), "--concurrency", "1",
                   "--num", str(TTFT_REQUESTS), "--out", ab_dir])
    with open(os.path.join(ab_dir, "ab.json")) as f:
        arms = json.load(f)["arms"]
    if rc != 0:
        raise RuntimeError(f"bench ab exited {rc}: " + "; ".join(f"{a['label']}: {a['error']}" for a in arms if a["error"]))
    rows = {a["label"]: {"ttft_mean_s": a["summary"]["ttft_s"]["mean"], "ttft_p50_s": a["summary"]["ttft_s"]["p50"],
                         "tpot_mean_ms": a["summary"]["tpot_ms"]["mean"],
                         "transports": a["summary"]["transfer_transports"]} for a in arms}
    base = rows["colocated"]["ttft_mean_s"]
    for row in rows.values():
        row["x_colocated"] = row["ttft_mean_s"] / base
    return rows


def summary_lines(result: dict) -> list[str]:
    g, lines = result["greedy"], []
    lines.append(f"pd-local greedy vs engine (cuda fp32, {NEW_TOKENS} tokens): {g['identical']}/{g['prompts']} identical, "
                 f"first divergence {g['first_divergence']}, transports {g['transports']}")
    for label, r in result["ttft"].items():
        lines.append(f"pd-local {label:11} TTFT mean {r['ttft_mean_s']:.4f} s, p50 {r['ttft_p50_s']:.4f} s "
                     f"(x{r['x_colocated']:.2f} colocated), TPOT {r['tpot_mean_ms']:.2f} ms, transports {r['transports']}")
    x = result["ttft"]["pd-local"]["x_colocated"]
    lines.append(f"TARGET   pd TTFT <= {TARGET_X_COLOCATED}x colocated ({INPUT_LEN}-token prompts, local transport): "
                 f"x{x:.2f} {'MET' if x <= TARGET_X_COLOCATED else 'NOT MET'}")
    return lines
