"""`pdflash bench dflash`: acceptance and speed of speculative decoding, in-process.

Runs the same prompts (GSM8K test questions, chat template, greedy) through the engine with
and without the drafter, at each concurrency: wall-clock output tok/s of both, the speedup,
both accept lengths (see docs/BENCHMARKS.md), the histogram with its invariants checked, and
whether the speculative outputs equal the plain ones (exact in fp32; in bf16 the first
divergence position is reported, since a batched verify rounds differently from one-at-a-time
decoding).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import uuid

import torch

from common.tools.bench import gsm8k_data
from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.service.loader import ModelOptions, add_model_args, add_spec_args, load_model, load_proposer



def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default=gsm8k_data.DEFAULT_TEST, help="JSONL with a 'question' field (default: the shipped GSM8K test questions)")
    p.add_argument("--num", type=int, default=16, help="questions")
    p.add_argument("--offset", type=int, default=0, help="skip this many questions first")
    p.add_argument("--concurrency", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", default=os.path.join("bench-out", "dflash.json"))
    add_model_args(p, kv_pages=2048)
    add_spec_args(p)
    p.set_defaults(spec="dflash")


def load_questions(path: str, num: int, offset: int) -> list[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset {path!r} not found (pass --dataset)")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["question"] for r in rows[offset:offset + num]]


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int):
    """Keep `concurrency` requests in flight until all prompts are done; returns (requests, seconds)."""
    reqs = [Request(uuid.uuid4().hex, ids, params) for ids in prompts]
    start = time.perf_counter()
    engine.run_all(reqs, concurrency)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return reqs, time.perf_counter() - start


def check_invariants(req: Request, block: int) -> None:
    s = req.spec
    assert sum(s.histogram) == s.verify_ct, "sum(histogram) != verify_ct"
    assert sum(k * n for k, n in enumerate(s.histogram)) == s.accepted_drafts, "sum(k*hist[k]) != accepted"
    assert s.proposed_drafts == (block - 1) * s.verify_ct, "proposed != (B-1) * verify_ct"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(args: argparse.Namespace) -> int:
    runner, tok = load_model(ModelOptions.from_args(args))
    proposer = load_proposer(args, runner)
    if proposer is None:
        raise ValueError("pdflash bench dflash needs --spec dflash")
    questions = load_questions(args.dataset, args.num, args.offset)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    plain = Engine(runner, tok.eos_token_ids)
    spec = Engine(runner, tok.eos_token_ids, proposer=proposer)
    run_engine(plain, prompts[:2], SamplingParams(max_new_tokens=8), 2)  # warm-up
    run_engine(spec, prompts[:2], SamplingParams(max_new_tokens=8), 2)
    results = {"command": "pdflash bench dflash", "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "device": str(runner.device),
               "block_size": proposer.block_size, "runs": []}
    for c in [int(x) for x in args.concurrency.split(",")]:
        base, t_base = run_engine(plain, prompts, params, c)
        fast, t_fast = run_engine(spec, prompts, params, c)
        hist = [0] * proposer.block_size
        for r in fast:
            check_invariants(r, proposer.block_size)
            hist = [a + b for a, b in zip(hist, r.spec.histogram)]
        verify = sum(r.spec.verify_ct for r in fast)
        accepted = sum(r.spec.accepted_drafts for r in fast)
        tokens_base = sum(len(r.output_ids) for r in base)
        tokens_fast = sum(len(r.output_ids) for r in fast)
        divergences = [first_divergence(a.output_ids, b.output_ids) for a, b in zip(base, fast)]
        row = {
            "concurrency": c, "requests": len(fast),
            "plain_tok_s": tokens_base / t_base, "spec_tok_s": tokens_fast / t_fast,
            "speedup": (tokens_fast / t_fast) / (tokens_base / t_base),
            "accept_length_weighted": 1 + accepted / verify,
            "accept_length_interface": sum(len(r.output_ids) / r.spec.verify_ct for r in fast) / len(fast),
            "draft_acceptance": accepted / ((proposer.block_size - 1) * verify),
            "verify_steps": verify, "accepted_drafts": accepted, "histogram": hist,
            "identical_outputs": sum(d is None for d in divergences),
            "first_divergence": [d for d in divergences if d is not None],
        }
        results["runs"].append(row)
        print(f"concurrency {c}: plain {row['plain_tok_s']:.1f} tok/s, dflash {row['spec_tok_s']:.1f} tok/s, "
              f"speedup {row['speedup']:.2f}x | accept length weighted {row['accept_length_weighted']:.2f}, "
              f"interface {row['accept_length_interface']:.2f} | identical {row['identical_outputs']}/{len(fast)}"
              f" | histogram {hist}", flush=True)
    print("histogram invariants hold for every request")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"saved {args.out}")
    return 0
