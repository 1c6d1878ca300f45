"""One command for a GPU machine: is the CUDA path right, and how fast is it?

    pdflash gpu-check OUT_DIR [--model PATH] [--skip-bench]

Parts (each runs on its own: a failure prints its error and the next part goes on):
  kernel     Triton paged decode vs the torch reference, fp32 and bf16, GQA 3/4, page sizes 4-64
  static     static decode path (graphs captured, Triton and torch attention) vs extend(),
             on a tiny random model: logits and greedy tokens over 32 steps
  greedy     the model's greedy tokens for a few prompts, 32 each: CPU fp32 (reference) against
             GPU fp32 + graphs, bf16 + graphs, bf16 eager; the first divergence of each
  replay     decode step time of the embedded shape (random weights, bf16): graphs with each
             attention backend, and eager, at batch 1, 8 and 32 (what the GPU does alone)
  profile    kernels per decode step and their summed time, tables per kernel (profile_b*.txt)
  bench      `pdflash bench engine --device cuda --dtype bf16`: ours vs transformers at batch
             1, 8, 32 (engine.json)
  floor      the same with `--shape llama3-8b`: the 8B-shaped step against its memory floor
             (floor.json)

Prints each part's results as it ends, then a summary with the issue's targets; writes
summary.json (rewritten after every part), engine.json, floor.json and profile_b*.txt to OUT_DIR.
No network access is needed; without the model file (gguf) `greedy` fails and `bench` runs
on random weights in the model's shape. About 1-2 minutes on one H200.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

from common.kv.seq_cache import SeqCache
from common.model.shapes import SHAPES, random_token_ids, random_weights
from common.runner.decode_graphs import DecodeGraphs
from common.runner.model_runner import ModelRunner
from common.tools.gpu.checks import kernel_check, tiny_static_check

TARGET_TOK_S_B1 = 1000.0  # embedded model, batch 1, decode tok/s
TARGET_X_FLOOR = 1.25  # Llama-3-8B shape, decode step / floor
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Write a short poem about the sea.", "Question: what is 17 times 23? Answer:"]


def _greedy(model: str | None) -> dict:
    from common.engine.engine import Engine
    from common.engine.request import Request
    from common.engine.sampling import SamplingParams
    from common.model.tokenizer import Tokenizer
    from common.model.weights import load_weights, resolve_model

    src = resolve_model(model)
    cfg, tensors = load_weights(src)
    tok = Tokenizer(src, cfg.eos_token_ids)
    prompts = [tok.encode(p) for p in PROMPTS]

    def run(device: str, dtype: str, eager: bool) -> list[list[int]]:
        runner = ModelRunner(cfg, tensors, dtype=dtype, device=device, num_pages=32, page_size=64,
                             enforce_eager=eager)
        engine = Engine(runner, tok.eos_token_ids)
        reqs = [Request(str(i), p, SamplingParams(max_new_tokens=32, ignore_eos=True)) for i, p in enumerate(prompts)]
        engine.run_all(reqs)
        return [r.output_ids for r in reqs]

    reference = run("cpu", "fp32", True)
    out = {"reference": "cpu fp32", "runs": {}}
    for name, args in {"cuda fp32 graphs": ("fp32", False), "cuda bf16 graphs": ("bf16", False),
                       "cuda bf16 eager": ("bf16", True)}.items():
        got = run("cuda", *args)
        first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None) for r, g in zip(reference, got)]
        out["runs"][name] = {"first_divergence": first, "identical": sum(f is None for f in first)}
    out["prompts"] = len(prompts)
    return out


def _replay(steps: int = 50, context: int = 256) -> list[dict]:
    """Decode step time without the engine around it (sampling, bookkeeping), in ms."""
    cfg = SHAPES["embedded"]
    tensors = random_weights(cfg, torch.bfloat16, "cuda")
    rows = []
    for mode in ("triton", "torch", "eager"):
        runner = ModelRunner(cfg, tensors, dtype="bf16", device="cuda", num_pages=32 * 6 + 8, page_size=64,
                             enforce_eager=True)
        if mode != "eager":
            runner.decode_graphs = DecodeGraphs(runner, (1, 8, 32), backend=mode)
        for bs in (1, 8, 32):
            seqs = [SeqCache() for _ in range(bs)]
            for s in seqs:
                runner.reserve(s, context + steps + 8)
                s.length = context  # the cache holds garbage: only the time matters
            tokens = random_token_ids(cfg, bs)
            for _ in range(3):
                runner.decode(seqs, tokens)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.decode(seqs, tokens)
            torch.cuda.synchronize()
            rows.append({"mode": mode, "batch": bs, "context": context,
                         "step_ms": 1e3 * (time.perf_counter() - t0) / steps})
            for s in seqs:
                runner.release(s)
        del runner
    return rows


def _profile(out_dir: str, steps: int = 5) -> list[dict]:
    """What one decode step launches (the static path run eagerly: the kernels a graph
    replays), embedded shape, bf16, Triton attention; the per-kernel tables go to OUT_DIR."""
    from torch.profiler import ProfilerActivity, profile

    cfg = SHAPES["embedded"]
    pages_each = -(-(128 + 2 * steps) // 64)
    runner = ModelRunner(cfg, random_weights(cfg, torch.bfloat16, "cuda"), dtype="bf16", device="cuda",
                         num_pages=32 * pages_each, page_size=64, enforce_eager=True)
    runner.decode_graphs = DecodeGraphs(runner, (1, 32), capture=False)
    rows = []
    for bs in (1, 32):
        seqs = [SeqCache() for _ in range(bs)]
        for s in seqs:
            runner.reserve(s, 128 + 2 * steps)
            s.length = 128
        tokens = random_token_ids(cfg, bs)
        runner.decode(seqs, tokens)  # compile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.decode(seqs, tokens)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        with open(os.path.join(out_dir, f"profile_b{bs}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))
        rows.append({"batch": bs, "kernels_per_step": sum(e.count for e in events) / steps,
                     "kernel_ms_per_step": sum(e.self_device_time_total for e in events) / steps / 1e3})
        for s in seqs:
            runner.release(s)
    return rows


def _bench(out_dir: str, model: str | None, floor: bool) -> dict:
    """bench engine on cuda: the comparison with transformers (engine.json), or the
    Llama-3-8B-shaped floor check alone (floor.json)."""
    from common.tools import cli

    path = os.path.join(out_dir, "floor.json" if floor else "engine.json")
    argv = ["bench", "engine", "--device", "cuda", "--dtype", "bf16", "--batches", "1,8,32",
            "--decode-prompt-tokens", "128", "--new-tokens", "64", "--repeats", "2", "--warmup", "1",
            "--prefill-tokens", "700", "--out", path]
    if floor:
        argv += ["--shape", "llama3-8b"]
    else:
        argv.append("--no-floor")
        try:
            from common.model.weights import load_weights, resolve_model

            load_weights(resolve_model(model))
            argv += ["--model", model] if model else []
        except Exception as e:  # no model file (or no gguf package): same shapes, random weights
            print(f"bench: model not loadable ({e}); using --random-weights")
            argv.append("--random-weights")
    rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"bench engine exited {rc}")
    with open(path) as f:
        return json.load(f)


def _rows(results: dict, part: str) -> list[dict]:
    value = results.get(part)
    return value if isinstance(value, list) else []  # a failed part holds its traceback


def _summary(results: dict) -> list[str]:
    lines = []
    k = results.get("kernel")
    if isinstance(k, list):
        for dtype in ("float32", "bfloat16"):
            errs = [r["max_abs_err"] for r in k if r["dtype"] == dtype]
            lines.append(f"kernel   {dtype}: max |triton - torch| {max(errs):.2e} over {len(errs)} cases")
    for r in _rows(results, "static"):
        lines.append(f"static   {r['dtype']} {r['backend']:6} graphs={r['cuda_graphs']}: max logit diff "
                     f"{r['max_abs_logit_diff']:.2e}, same tokens {r['same_tokens']}, kv diff {r['max_abs_kv_diff']:.1e}")
    g = results.get("greedy")
    if isinstance(g, dict):
        for name, r in g["runs"].items():
            lines.append(f"greedy   {name} vs cpu fp32: {r['identical']}/{g['prompts']} identical over 32 tokens, "
                         f"first divergence {r['first_divergence']}")
    for r in _rows(results, "replay"):
        lines.append(f"replay   {r['mode']:6} batch {r['batch']:2}: {r['step_ms']:.3f} ms/step "
                     f"({r['batch'] * 1e3 / r['step_ms']:.0f} tok/s)")
    for r in _rows(results, "profile"):
        lines.append(f"profile  batch {r['batch']:2}: {r['kernels_per_step']:.0f} kernels, "
                     f"{r['kernel_ms_per_step']:.3f} ms of kernel time per step (profile_b{r['batch']}.txt)")
    for b in (results.get("bench"), results.get("floor")):
        if not isinstance(b, dict):
            continue
        for r in b.get("rows", []):
            what = "prefill" if r["metric"] == "prefill" else f"decode b{r['batch']:<2}"
            lines.append(f"bench    {what}: ours {r['ours_tok_s']:9.1f} tok/s  transformers {r['hf_tok_s']:9.1f} "
                         f"tok/s  x{r['ratio']:.2f}" + (f"  step {r['ours_step_ms']:.3f} ms" if r["ours_step_ms"] else ""))
            if r["metric"] == "decode" and r["batch"] == 1:
                ok = r["ours_tok_s"] >= TARGET_TOK_S_B1
                lines.append(f"TARGET   embedded batch-1 decode >= {TARGET_TOK_S_B1:.0f} tok/s: "
                             f"{r['ours_tok_s']:.0f} {'MET' if ok else 'NOT MET'}")
        for r in b.get("floor", []):
            lines.append(f"floor    {r['shape']} batch {r['batch']:2}: step {r['step_ms']:.3f} ms, floor "
                         f"{r['floor_ms']:.3f} ms, x{r['x_floor']:.2f}")
            if r["batch"] == 1:
                ok = r["x_floor"] <= TARGET_X_FLOOR
                lines.append(f"TARGET   {r['shape']} batch-1 step <= {TARGET_X_FLOOR}x floor: "
                             f"x{r['x_floor']:.2f} {'MET' if ok else 'NOT MET'}")
        lines.append(f"device   {b.get('gpu')}: memory bandwidth {b.get('memory_bandwidth_gbs', 0):.0f} GB/s")
    for part, value in results.items():
        if isinstance(value, str):
            lines.append(f"ERROR    {part}: {value.splitlines()[-1] if value else value}")
    return lines


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir")
    p.add_argument("--model", default=None, help="model for greedy/bench (default: the embedded one)")
    p.add_argument("--skip-bench", action="store_true", help="only the correctness parts and replay timings")


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    from common.model.static_attention import HAS_TRITON

    results: dict = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "triton": HAS_TRITON}}
    parts = {
        "kernel": lambda: kernel_check("cuda", [torch.float32, torch.bfloat16]),
        "static": lambda: [tiny_static_check("cuda", dtype, backend, capture) for dtype in ("fp32", "bf16")
                           for backend, capture in (("triton", True), ("torch", True), ("triton", False))],
        "greedy": lambda: _greedy(args.model),
        "replay": _replay,
        "profile": lambda: _profile(args.out_dir),
    }
    if not args.skip_bench:
        parts["bench"] = lambda: _bench(args.out_dir, args.model, floor=False)
        parts["floor"] = lambda: _bench(args.out_dir, args.model, floor=True)
    t_start = time.perf_counter()
    for name, fn in parts.items():
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            results[name] = fn()
        except Exception:
            results[name] = traceback.format_exc()
            print(results[name], file=sys.stderr, flush=True)
        results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        for line in _summary({name: results[name]}):  # now too: a run cut short still says something
            print(line, flush=True)
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:  # after each part: a crash keeps the rest
            json.dump(results, f, indent=2)
    print(f"\n== summary ({time.perf_counter() - t_start:.0f} s, parts {results['seconds']})")
    for line in _summary(results):
        print(line)
    print(f"\nsaved {os.path.join(args.out_dir, 'summary.json')}")
    return 0

