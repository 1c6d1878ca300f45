"""One command for a GPU machine: is the CUDA path right, and how fast is it?

    pdflash gpu-check OUT_DIR [--model PATH] [--skip-bench]

Parts (each runs on its own: a failure prints its error and the next part goes on):
  kernel     Triton static attention vs the torch reference, fp32 and bf16: decode rows (GQA
             3/4, page sizes 4-64), causal verify blocks and draft blocks (with a window)
  static     static path (forward_static, Triton and torch attention) vs extend() on a tiny
             random model, decode (T = 1) and verify (T = 4): logits, tokens, K/V
  fused      the static step with the fused kernels (common.model.fused) against extend() without
             them, embedded shape and a toy with per-head q/k norms (random weights), fp32 and
             bf16, decode (T = 1) and verify (T = 4)
  draft      the drafter's block step with the fused kernels against it without them (a toy
             target and drafter, random weights): drafts and the block K/V, fp32 and bf16
  prefill    a fresh prompt's prefill through its CUDA graph (common/runner/prefill_graphs.py)
             against eager prefill, embedded shape (random weights), fp32 and bf16, 1-512 tokens:
             logits, captured layers, K/V; padding only in the scratch page; a control prompt
  greedy     the model's greedy tokens for a few prompts, 32 each: CPU fp32 (reference) against
             GPU fp32 graphs, fp32 eager, bf16 graphs, bf16 eager; the first divergence of each
  speculative  --spec dflash (block pinned to 16, CUDA graphs) against plain decoding (graphs)
             on 32 GSM8K chat prompts, fp32: one at a time and 8 at once, greedy and seeded
             sampling (T 0.8, top-p 0.95), and requests that stop inside a block; the drafter as
             saved, then with two refine passes at 0.5, then drafting ahead (--spec-ahead) with
             steps cycling through blocks of 4, 16, plain and 8; must be identical
  speculative-ahead  the same, drafting ahead only
  sampler    the sampler's draw kernel (common.engine.draw) against the PyTorch path at the
             embedded vocabulary, batch 64 and 256, T 0.7 with top-p 0.95 and without: tokens equal
             over 32 positions, and ms per draw for peaked and flat rows (common/tools/gpu/sampler_check.py)
  gemv       the decode GEMV kernels (common.model.gemv) against cuBLAS at the embedded and 8B
             shapes, M 1, 4, 8 and 16, fp32 and bf16: results, and microseconds per product in CUDA graphs
             and in plain launches (common/tools/gpu/gemv_check.py; several minutes: 226 s on the
             H200 before the tl.dot blocks joined the candidates)
  gemv-split the split-K GEMV shapes at the embedded layer's products, 8 and 16 rows, fp32 and
             bf16: 200 products one after another and 200 CUDA-graph replays, each equal to the
             first bit for bit, and the arrival counters zero after them
  flashinfer flashinfer's fused add-RMSNorm, SiLU x up, RoPE + paged-KV append and graph decode
             attention against ours (common.model.fused, Triton attention), embedded and 8B shapes,
             bf16, batch 1, 8, 32: results, and microseconds per op in CUDA graphs
             (common/tools/gpu/flashinfer_check.py; needs the `flashinfer` extra, else one line;
             its first run compiles the kernels with nvcc)
  replay     step times of the embedded shape (random weights) through the engine's decoder with
             graphs, fp32 and bf16, at batch 1, 8 and 32: plain, and speculative with each block;
             with PDFLASH_GEMV=auto, each dtype with cuBLAS alone as the baseline, and fp32 with
             our GEMV for every product it takes
  profile    kernels per plain and speculative step and their summed time (profile_*.txt)
  spec-overhead  a plain decode step under --spec none against a plain step under --spec dflash,
             batch 1 and 8, context ~100 and ~2000, and host synchronisations per step
             (common/tools/gpu/spec_overhead.py; under a minute)
  attention-launch  the attention kernel's launch choices (warps, stages, key block, program
             target, merge block) timed against the shipped one at the embedded and 8B shapes,
             then the 8B floor with the shipped and the best in turn, and the kernel check with
             the best (common/tools/gpu/attention_launch.py; a few minutes)
  bench      `pdflash bench engine --device cuda --dtype bf16`: ours vs transformers at batch
             1, 8, 32 (engine.json), with PDFLASH_GEMV=auto
  floor      the same with `--shape llama3-8b`: the 8B-shaped step against its memory floor
             (floor.json)
  moe-shapes MoE and KDA models in CUDA graphs: grouped experts against dense, and the
             DeepSeek-V2-Lite and Kimi-Linear-48B decode steps against their floors
             (common.tools.gpu.moe_shapes; moe_shapes.json, moe_shapes.md); `--small` runs it at
             small shapes, on the CPU when there is no GPU
  moe-graphs tiny DeepSeek-V3 and Kimi-Linear checkpoints: greedy with graphs equals eager in fp32
             (batch 1 and mixed) and logits equal transformers'; bf16 graphs against eager
             logits, and whether greedy divergences are near-ties (common.tools.gpu.moe_graphs;
             moe_graphs.json); on the CPU too when there is no GPU (nothing captured there)
  local-copy the local transport's CUDA IPC copy between two processes, bytes checked, and its
             time for a 2K-token room (common/tools/gpu/local_copy.py; no Mooncake needed)
  pd-local   a pd stack on the GPU with the local transport (CUDA IPC): greedy tokens against the
             engine (fp32), then 2K-token TTFT against pd over Mooncake TCP and colocated
             (common/tools/gpu/pd_local.py; needs Mooncake; pd_local_ab/)

Prints each part's results as it ends, then a summary with the targets; writes summary.json
(rewritten after every part), engine.json, floor.json and profile_*.txt to OUT_DIR. No network
access is needed; without the model file (gguf) `greedy` and `speculative` fail and `bench`
runs on random weights in the model's shape. A few minutes on one H200.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import traceback
import uuid

import torch

from common.engine.decoder import Decoder
from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig
from common.engine.step_costs import step_times, synthetic_requests
from common.model import gemv
from common.model.shapes import SHAPES, random_weights
from common.runner.model_runner import ModelRunner
from common.tools.gpu.checks import draft_check, fused_check, kernel_check, prefill_check, tiny_static_check
from common.tools.gpu import attention_launch, flashinfer_check, gemv_check
from common.tools.gpu.moe_graphs import moe_graphs
from common.tools.gpu.moe_shapes import moe_shapes
from common.tools.gpu.local_copy import local_copy
from common.tools.gpu.pd_local import pd_local, summary_lines
from common.tools.gpu import spec_overhead
from common.tools.gpu.sampler_check import sampler_check

TARGET_TOK_S_B1 = 1000.0  # embedded model, batch 1, decode tok/s
TARGET_X_FLOOR = 1.25  # Llama-3-8B shape, decode step / floor
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Write a short poem about the sea.", "Question: what is 17 times 23? Answer:"]


def _model(model: str | None):
    from common.model.tokenizer import Tokenizer
    from common.model.source import resolve_model
    from common.model.weights import load_weights

    src = resolve_model(model)
    cfg, tensors = load_weights(src)
    return cfg, tensors, Tokenizer(src, cfg.eos_token_ids)


def _greedy(model: str | None) -> dict:
    cfg, tensors, tok = _model(model)
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
    for name, args in {"cuda fp32 graphs": ("fp32", False), "cuda fp32 eager": ("fp32", True),
                       "cuda bf16 graphs": ("bf16", False), "cuda bf16 eager": ("bf16", True)}.items():
        got = run("cuda", *args)
        first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None) for r, g in zip(reference, got)]
        out["runs"][name] = {"first_divergence": first, "identical": sum(f is None for f in first)}
    out["prompts"] = len(prompts)
    return out


def _speculative(model: str | None, num: int = 32, variants: tuple[str, ...] = ("saved", "refine", "ahead")
                 ) -> list[dict]:
    """--spec dflash against plain decoding, both with CUDA graphs, fp32 (the drafter in bf16, as
    --draft-dtype auto runs it): identical outputs, with the drafter as saved, with two refine
    passes (static steps of their own: graph-captured like the first), and drafting ahead with
    steps that cycle through blocks of 4, 16, plain, 8, 5, 7 and 6 (verifying drafts kept
    ahead, drafting first after a plain step, and both in one batch as requests join; 5 to 7
    as the policy's blocks between take them)."""
    from common.dflash.drafter import Drafter, draft_dtype, shipped_drafter_path
    from common.dflash.proposer import DFlashProposer
    from common.tools.bench.gsm8k_data import DEFAULT_TEST, load

    started = time.perf_counter()
    cfg, tensors, tok = _model(model)
    questions = [it.question for it in load(DEFAULT_TEST)[200:200 + num]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    runner = ModelRunner(cfg, tensors, dtype="fp32", device="cuda", num_pages=2048, page_size=64)
    plain = Engine(runner, tok.eos_token_ids)
    proposers, specs = {}, {}
    settings = {"saved": ("", {}, False), "refine": (", 2 refine passes @0.5", {"refine_passes": 2, "refine_threshold": 0.5},
                                                     False), "ahead": (", drafted ahead, blocks 4/16/plain/8/5/7/6", {}, True)}
    for variant in variants:
        name, refine, ahead = settings[variant]
        drafter = Drafter.load(shipped_drafter_path(model), device="cuda", dtype=draft_dtype("auto", runner.dtype, "cuda"))
        drafter.set_refine(refine)
        proposers[name] = DFlashProposer(drafter, runner, runner.pool.num_pages)
        specs[name] = Engine(runner, tok.eos_token_ids, proposer=proposers[name], spec=SpecConfig(block=16, ahead=ahead))
        if ahead:
            specs[name].decoder.ahead_rows = 8  # batches of 8 draft ahead too (by default only single requests)
            specs[name].policy.choose = lambda reqs, choices=itertools.cycle([4, 16, 0, 8, 5, 7, 6]): next(choices)
    # Each engine's start-up captures its graphs and, on a GPU that has not met them, times the
    # products of every batch and block (minutes at a first start); said here, so that a check
    # stopped by a time limit shows where it was.
    print(f"  engines ready after {time.perf_counter() - started:.0f} s", flush=True)
    period = tuple(tok.encode("."))
    cases = {
        "greedy": lambda i: SamplingParams(max_new_tokens=96),
        "seeded T0.8 top-p 0.95": lambda i: SamplingParams(max_new_tokens=96, temperature=0.8, top_p=0.95, seed=i),
        "stops inside blocks": lambda i: SamplingParams(max_new_tokens=7 + 3 * (i % 5), stop_token_ids=period),
    }

    def run(engine: Engine, params, concurrency: int) -> list[Request]:
        reqs = [Request(uuid.uuid4().hex, p, params(i)) for i, p in enumerate(prompts)]
        engine.run_all(reqs, concurrency)
        return reqs

    rows = []
    for case, params in cases.items():
        for concurrency in (1, 8):
            want = run(plain, params, concurrency)
            for name, spec in specs.items():
                got = run(spec, params, concurrency)
                same = sum(a.output_ids == b.output_ids and a.finish_reason == b.finish_reason for a, b in zip(want, got))
                verify = sum(r.spec.verify_ct for r in got)
                accepted = sum(r.spec.accepted_drafts for r in got)
                rows.append({"case": case + name, "concurrency": concurrency, "identical": same, "requests": len(prompts),
                             "accept_length_weighted": 1 + accepted / max(verify, 1)})
                print(f"  {case}{name}, concurrency {concurrency}: {same}/{len(prompts)} identical", flush=True)
    assert runner.pool.num_free == runner.pool.num_pages
    assert all(p.pool.num_free == p.pool.num_pages for p in proposers.values())
    return rows


def _decoder(dtype: str, graphs: bool) -> Decoder:
    """The engine's decoder over the embedded shape with random weights and the shipped drafter's
    shape (random weights too: only the time matters), in the dtype --draft-dtype auto gives it
    (bf16 beside fp32; step times from before --draft-dtype had it in fp32)."""
    from common.dflash.drafter import SHIPPED, Drafter, draft_dtype
    from common.dflash.proposer import DFlashProposer

    cfg = SHAPES["embedded"]
    runner = ModelRunner(cfg, random_weights(cfg, torch.float32, "cuda"), dtype=dtype, device="cuda",
                         num_pages=32 * 8 + 8, page_size=64, enforce_eager=not graphs)
    drafter = Drafter.load(SHIPPED, device="cuda", dtype=draft_dtype("auto", runner.dtype, "cuda"))
    return Decoder(runner, cfg.eos_token_ids, DFlashProposer(drafter, runner, runner.pool.num_pages))


def _replay(context: int = 256) -> list[dict]:
    """Step time through the decoder (inputs, graph replay, the one host synchronisation), in ms;
    the decode GEMVs as PDFLASH_GEMV=auto picks them, and each dtype with cuBLAS alone to compare;
    fp32 also with our kernel and its DEFAULT blocks for every product of up to 16 rows."""
    rows = []
    for dtype, mode in (("fp32", "auto"), ("fp32", "cublas"), ("fp32", "triton"), ("bf16", "auto"), ("bf16", "cublas")):
        with gemv.forced(mode):  # while the graphs are captured: they keep what ran then
            decoder = _decoder(dtype, graphs=True)
            for bs in (1, 8, 32):
                with synthetic_requests(decoder, bs, 16, context) as reqs:
                    times = step_times(decoder, reqs, [0, 4, 8, 16], repeats=30)
                rows += [{"dtype": dtype, "gemv": mode, "batch": bs, "block": b, "context": context, "step_ms": 1e3 * t}
                         for b, t in times.items()]
            del decoder
    return rows


def _profile(out_dir: str, steps: int = 5) -> list[dict]:
    """What one plain or speculative step launches (run eagerly: the kernels a graph replays),
    embedded shape, fp32 and bf16, Triton attention; the per-kernel tables go to OUT_DIR."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for dtype in ("fp32", "bf16"):
        decoder = _decoder(dtype, graphs=False)
        for bs, block in ((1, 0), (1, 16), (32, 0), (32, 16)):
            with synthetic_requests(decoder, bs, block, 128) as reqs, torch.inference_mode():
                decoder.run(reqs, block)  # compile
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        decoder.run(reqs, block)
                    torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            name = f"profile_{dtype}_b{bs}_{'plain' if block == 0 else f'spec{block}'}.txt"
            with open(os.path.join(out_dir, name), "w") as f:
                f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30))
            rows.append({"dtype": dtype, "batch": bs, "block": block,
                         "kernels_per_step": sum(e.count for e in events) / steps,
                         "kernel_ms_per_step": sum(e.self_device_time_total for e in events) / steps / 1e3,
                         "table": name})
        del decoder
    return rows


def _bench(out_dir: str, model: str | None, floor: bool, name: str | None = None) -> dict:
    """bench engine on cuda: the comparison with transformers (engine.json), or the
    Llama-3-8B-shaped floor check alone (floor.json); saved as `name` if given."""
    from common.tools import cli

    path = os.path.join(out_dir, name or ("floor.json" if floor else "engine.json"))
    argv = ["bench", "engine", "--device", "cuda", "--dtype", "bf16", "--batches", "1,8,32",
            "--decode-prompt-tokens", "128", "--new-tokens", "64", "--repeats", "2", "--warmup", "1",
            "--prefill-tokens", "700", "--out", path]
    if floor:
        argv += ["--shape", "llama3-8b"]
    else:
        argv.append("--no-floor")
        try:
            from common.model.source import resolve_model
            from common.model.weights import load_weights

            load_weights(resolve_model(model))
            argv += ["--model", model] if model else []
        except Exception as e:  # no model file (or no gguf package): same shapes, random weights
            print(f"bench: model not loadable ({e}); using --random-weights")
            argv.append("--random-weights")
    with gemv.forced("auto"):
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
        lines.append(f"static   {r['dtype']} {r['backend']:6} T={r['T']:2}: max logit diff "
                     f"{r['max_abs_logit_diff']:.2e}, same tokens {r['same_tokens']}, kv diff {r['max_abs_kv_diff']:.1e}")
    for r in _rows(results, "fused"):
        lines.append(f"fused    {r['shape']} {r['dtype']} T={r['T']}: max logit diff vs unfused {r['max_abs_logit_diff']:.2e}, "
                     f"same tokens {r['same_tokens']}, kv diff {r['max_abs_kv_diff']:.1e}")
    for r in _rows(results, "draft"):
        lines.append(f"draft    {r['dtype']}: fused vs unfused, same drafts {r['same_drafts']}, "
                     f"block kv diff {r['max_abs_kv_diff']:.1e}")
    for r in _rows(results, "prefill"):
        lines.append(f"prefill  {r['dtype']} {r['tokens']:3} tokens, graph vs eager: max logit diff "
                     f"{r['max_abs_logit_diff']:.1e}, captured {r['max_abs_captured_diff']:.1e}, "
                     f"kv {r['max_abs_kv_diff']:.1e}; "
                     f"padding in scratch only {r['padding_in_scratch_only']}; control (last token changed) "
                     f"{r['control_logit_diff']:.1e}  {'ok' if r['ok'] else 'FAIL'}")
    g = results.get("greedy")
    if isinstance(g, dict):
        for name, r in g["runs"].items():
            lines.append(f"greedy   {name} vs cpu fp32: {r['identical']}/{g['prompts']} identical over 32 tokens, "
                         f"first divergence {r['first_divergence']}")
    for r in _rows(results, "speculative") + _rows(results, "speculative-ahead"):
        lines.append(f"spec     {r['case']}, concurrency {r['concurrency']}: {r['identical']}/{r['requests']} identical "
                     f"to plain decoding (accept length {r['accept_length_weighted']:.2f})")
    for r in _rows(results, "sampler"):
        lines.append(f"sampler  {r['rows']} batch {r['batch']:3} {r['mode']}: {r['tokens_differing']}/{r['of']} tokens "
                     f"differ; kernel {r['kernel_ms']:.3f} ms, plain {r['plain_ms']:.3f} ms (x{r['speedup']:.2f})")
    lines += gemv_check.summary_lines(_rows(results, "gemv"))
    lines += gemv_check.split_summary_lines(_rows(results, "gemv-split"))
    if isinstance(results.get("flashinfer"), dict):
        lines += flashinfer_check.summary_lines(results["flashinfer"])
    for r in _rows(results, "replay"):
        what = "plain" if r["block"] == 0 else f"spec B={r['block']:2}"
        lines.append(f"replay   {r['dtype']} gemv {r['gemv']:6} {what:10} batch {r['batch']:2}: "
                     f"{r['step_ms']:.3f} ms/step"
                     + (f" ({r['batch'] * 1e3 / r['step_ms']:.0f} tok/s)" if r["block"] == 0 else ""))
    for r in _rows(results, "profile"):
        what = "plain" if r["block"] == 0 else f"spec B={r['block']}"
        lines.append(f"profile  {r['dtype']} {what} batch {r['batch']:2}: {r['kernels_per_step']:.0f} kernels, "
                     f"{r['kernel_ms_per_step']:.3f} ms of kernel time per step ({r['table']})")
    lines += spec_overhead.summary_lines(_rows(results, "spec-overhead"))
    if isinstance(results.get("attention-launch"), dict):
        lines += attention_launch.summary_lines(results["attention-launch"])
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
    for part in ("moe-shapes", "moe-graphs"):
        if isinstance(results.get(part), dict):
            lines += [f"moe      {line}" for line in results[part]["lines"]]
    c = results.get("local-copy")
    if isinstance(c, dict):
        lines.append(f"local    CUDA IPC copy to another process: {c['bytes']} bytes, decode sees them: "
                     f"{c['decode_sees_them']}; ms per copy {c['timings_ms']}")
    if isinstance(results.get("pd-local"), dict):
        lines += summary_lines(results["pd-local"])
    for part, value in results.items():
        if isinstance(value, str):
            lines.append(f"ERROR    {part}: {value.splitlines()[-1] if value else value}")
    return lines


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir")
    p.add_argument("--model", default=None, help="model for greedy/bench (default: the embedded one)")
    p.add_argument("--skip-bench", action="store_true", help="only the correctness parts and replay timings")
    p.add_argument("--parts", default=None, help="comma-separated parts to run (default: all)")
    p.add_argument("--small", action="store_true",
                   help="moe-shapes at small shapes (the only part then; on the CPU when there is no GPU)")


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not args.small and args.parts != "moe-graphs":
        print("no CUDA device: nothing to check (--small runs moe-shapes on the CPU, --parts moe-graphs runs there too)")
        return 1
    if args.small and args.parts not in (None, "moe-shapes"):
        raise ValueError("--small runs only the moe-shapes part")
    from common.model.static_attention import HAS_TRITON

    results: dict = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else None,
                             "triton": HAS_TRITON}}
    parts = {
        "kernel": lambda: kernel_check("cuda", [torch.float32, torch.bfloat16]),
        "static": lambda: [tiny_static_check("cuda", dtype, backend, T) for dtype in ("fp32", "bf16")
                           for backend in ("triton", "torch") for T in (1, 4)],
        "fused": lambda: [fused_check("cuda", dtype, T, shape) for shape in ("embedded", "tiny-qk-norm")
                          for dtype in ("fp32", "bf16") for T in (1, 4)],
        "draft": lambda: [draft_check("cuda", dtype) for dtype in ("fp32", "bf16")],
        "prefill": lambda: [row for dtype in ("fp32", "bf16")
                            for row in prefill_check("cuda", dtype, "embedded", (1, 5, 16, 17, 100, 300, 512))],
        "greedy": lambda: _greedy(args.model),
        "speculative": lambda: _speculative(args.model),
        "speculative-ahead": lambda: _speculative(args.model, variants=("ahead",)),
        "sampler": sampler_check,
        "gemv": gemv_check.gemv_check,
        "gemv-split": gemv_check.split_repeats,
        "flashinfer": flashinfer_check.flashinfer_check,
        "replay": _replay,
        "profile": lambda: _profile(args.out_dir),
        "spec-overhead": spec_overhead.spec_overhead,
        "moe-shapes": lambda: moe_shapes(args.out_dir, args.small),
        "moe-graphs": lambda: moe_graphs(args.out_dir),
        "local-copy": local_copy,
    }
    if not args.skip_bench:
        parts["bench"] = lambda: _bench(args.out_dir, args.model, floor=False)
        parts["floor"] = lambda: _bench(args.out_dir, args.model, floor=True)
        parts["pd-local"] = lambda: pd_local(args.out_dir, args.model)
        parts["attention-launch"] = lambda: attention_launch.attention_launch(
            lambda name: _bench(args.out_dir, None, floor=True, name=name))
    if args.small:
        parts = {"moe-shapes": parts["moe-shapes"]}
    elif args.parts:
        wanted = args.parts.split(",")
        unknown = set(wanted) - set(parts)
        if unknown:
            raise ValueError(f"--parts: unknown {sorted(unknown)}; parts are {list(parts)}")
        parts = {name: fn for name, fn in parts.items() if name in wanted}
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

