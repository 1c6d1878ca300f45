"""`pdflash bench dflash`: speculative decoding against plain decoding, in-process, over a grid.

For every prompt length (`gsm8k`: GSM8K test questions in the chat template; a number N: a long
context of about N tokens, solved GSM8K problems, followed by a question) and every concurrency,
the same prompts run through a plain engine and through a `--spec dflash` engine (both with CUDA
graphs on a GPU), alternating which goes first from one grid point to the next. Reported per
point: output tok/s over the whole run and over decode steps alone, the speedups, both accept
lengths (docs/BENCHMARKS.md), the share of decode steps that speculated, the blocks used, the
histogram invariants (checked for every request), and whether the outputs equal plain decoding
(exactly in fp32; in bf16 the first divergence, since a batched verify rounds differently from
one-token decoding). Writes the JSON and a PNG of speedup against concurrency per prompt length.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
import uuid
from typing import Any

import torch

from common.engine.engine import Engine
from common.engine.meta import meta_info
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.step_clock import BlockTime, StepClock
from common.model import gemv
from common.model.tokenizer import Tokenizer
from common.service.loader import ModelOptions, add_model_args, load_model, load_proposer, spec_config
from common.service.spec_args import add_spec_args
from common.tools.bench import gsm8k_data, plot, report, stats

LONG_QUESTION_OFFSET = 500  # long prompts' context comes from test items after this one


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default=gsm8k_data.DEFAULT_TEST,
                   help="GSM8K-style JSONL (question, answer); default: the shipped GSM8K test questions")
    p.add_argument("--num", type=int, default=32, help="requests per grid point (at least the concurrency is run)")
    p.add_argument("--offset", type=int, default=0, help="first question")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated requests in flight")
    p.add_argument("--lengths", default="gsm8k,2048,8192",
                   help="comma-separated prompt kinds: gsm8k (chat questions) or N (a context of about N tokens "
                        "then a question; capped so that prompt + answer fit the model's context)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each arm per grid point, taking turns; tok/s and speedup over all of them "
                        "(a machine whose speed drifts, such as a shared VM, slows both arms alike)")
    p.add_argument("--out", default=os.path.join("bench-out", "dflash"), help="output folder (dflash.json, speedup.png)")
    add_model_args(p, kv_pages=0)
    add_spec_args(p)
    p.set_defaults(spec="dflash")


def run(args: argparse.Namespace) -> int:
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    lengths = [x.strip() for x in args.lengths.split(",") if x.strip()]
    if not levels or min(levels) < 1 or min(args.num, args.max_new_tokens, args.rounds) < 1:
        raise ValueError("--concurrency values, --num, --max-new-tokens and --rounds must be at least 1")
    for kind in lengths:
        if kind != "gsm8k" and not kind.isdigit():
            raise ValueError(f"--lengths: {kind!r} is neither gsm8k nor a token count")
    opts = ModelOptions.from_args(args)
    if not opts.kv_pages:  # the largest grid point's requests at once, with room for the blocks
        longest = max([600] + [int(k) for k in lengths if k != "gsm8k"])
        need = max(levels) * (longest + args.max_new_tokens + 64)
        opts = dataclasses.replace(opts, kv_pages=-(-need // opts.page_size) + 8)
    runner, tok = load_model(opts)
    proposer = load_proposer(args, runner)
    if proposer is None:
        raise ValueError("pdflash bench dflash needs --spec dflash")
    items = gsm8k_data.load(args.dataset)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    plain = Engine(runner, tok.eos_token_ids, max_running=max(levels))
    spec = Engine(runner, tok.eos_token_ids, max_running=max(levels), proposer=proposer, spec=spec_config(args))
    if runner.device.type == "cuda":  # each step's time on the device, beside its wall time
        plain.decoder.clock, spec.decoder.clock = StepClock(), StepClock()
    # A CPU maps a fresh cache's pages on first write: whichever engine first reached a page would
    # pay for it. Touch them all before timing anything.
    runner.kv.fill_(0)
    proposer.kv.fill_(0)
    for c in levels:  # untimed, sampling as the runs do: captures every graph these batch sizes use
        for engine in (plain, spec):
            run_engine(engine, [tok.encode("Warm up the engine.")] * c, dataclasses.replace(params, max_new_tokens=24), c)
    result: dict[str, Any] = {"bench": "dflash", "device": str(runner.device), "dtype": str(runner.dtype),
                              "drafter_block": proposer.block_size, "drafter_dtype": str(proposer.dtype),
                              "pinned_block": args.spec_block, "draft_ahead": spec.decoder.ahead,
                              "provenance": report.provenance(args), "runs": []}
    for i, kind in enumerate(lengths):
        for j, c in enumerate(levels):
            prompts = make_prompts(tok, items, kind, max(args.num, c), args, runner.cfg.max_position)
            order = [("plain", plain), ("dflash", spec)]
            if (i + j) % 2:
                order.reverse()
            if runner.device.type == "cuda":
                # Untimed: the first prefill of a batch of these prompts in a dtype pays one-off GPU
                # work (kernel compilation, library set-up) that the short warm-up above does not:
                # on the H200 it made whichever arm ran first 2-3x slower at that point.
                for _, engine in order:
                    run_engine(engine, prompts, dataclasses.replace(params, max_new_tokens=2), c)
            runs: dict[str, list[dict]] = {"plain": [], "dflash": []}
            for k in range(args.rounds):
                for name, engine in order if k % 2 == 0 else order[::-1]:
                    runs[name].append(run_engine(engine, prompts, params, c))
            row = summarize(kind, c, prompts * args.rounds, merged(runs["plain"]), merged(runs["dflash"]),
                            runner.dtype == torch.float32)
            row["round_speedups"] = [_tok_s(f) / _tok_s(b) for b, f in zip(runs["plain"], runs["dflash"])]
            row["round_speculated_shares"] = [_speculated_share(run["reqs"]) for run in runs["dflash"]]
            # Where a round stalls (a fresh GPU machine's first round at a concurrency has spent
            # seconds in prefill, in either arm), this says which round and arm.
            row["round_prefill_ms"] = {name: [1e3 * run["prefill_seconds"] / len(run["reqs"]) for run in arm]
                                       for name, arm in runs.items()}
            result["runs"].append(row)
            print(line(row), flush=True)
    if runner.device.type == "cuda":
        result["gemv_choices"] = gemv.choices()
        triton = sum(v != "cublas" for v in result["gemv_choices"].values())
        print(f"gemv auto: {triton} of {len(result['gemv_choices'])} products on Triton kernels (gemv_choices in "
              f"dflash.json)", flush=True)
    bad = [r for r in result["runs"] if r["invariant_violations"]]
    report.write_json(os.path.join(args.out, "dflash.json"), result)
    report.write_text(os.path.join(args.out, "dflash.md"), markdown(result))
    speedup_png(os.path.join(args.out, "speedup.png"), result)
    print(markdown(result))
    print(f"saved {args.out}/dflash.json, dflash.md and speedup.png")
    return 1 if bad else 0


def make_prompts(tok: Tokenizer, items: list[gsm8k_data.Item], kind: str, n: int, args: argparse.Namespace,
                 max_position: int) -> list[list[int]]:
    questions = [it.question for it in items[args.offset:args.offset + n]]
    if len(questions) < n:
        raise ValueError(f"{args.dataset} has {len(items)} questions; --offset {args.offset} + {n} needed")
    if kind == "gsm8k":
        return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    # Room for the answer and a verify block past it.
    target = min(int(kind), max_position - args.max_new_tokens - 64)
    prompts = []
    for k, q in enumerate(questions):
        context, m = [], LONG_QUESTION_OFFSET + 37 * k
        used = len(tok.encode(q)) + 40  # the question, the instructions and the chat template
        while True:
            item = items[m % len(items)]
            piece = f"Problem: {item.question}\nSolution: {item.answer}\n\n"
            cost = len(tok.encode(piece))
            if used + cost > target:
                break
            context.append(piece)
            used += cost
            m += 1
        text = "Here are some solved problems.\n\n" + "".join(context) + f"Now solve this one.\nProblem: {q}"
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        prompts.append(ids[-target:] if len(ids) > target else ids)
    return prompts


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    """Keep `concurrency` requests in flight until all are done."""
    reqs = [Request(uuid.uuid4().hex, ids, params) for ids in prompts]
    before, graphs = dict(engine.step_seconds), engine.decoder.graphs.captures
    clock = engine.decoder.clock
    if clock is not None:
        clock.take()  # steps before this run are not its own
    start = time.perf_counter()
    engine.run_all(reqs, concurrency)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return {"reqs": reqs, "seconds": time.perf_counter() - start,
            "decode_seconds": engine.step_seconds["decode"] - before["decode"],
            "prefill_seconds": engine.step_seconds["prefill"] - before["prefill"],
            "graphs_captured": engine.decoder.graphs.captures - graphs,
            "device": clock.take() if clock is not None else {}}


def merged(runs: list[dict]) -> dict:
    """One arm's rounds as one run: every request, the seconds and the device times summed."""
    device: dict[int, BlockTime] = {}
    for run in runs:
        for block, t in run["device"].items():
            device.setdefault(block, BlockTime()).add(t.steps, t.seconds)
    return {"reqs": [r for run in runs for r in run["reqs"]], "device": dict(sorted(device.items())),
            **{key: sum(run[key] for run in runs)
               for key in ("seconds", "decode_seconds", "prefill_seconds", "graphs_captured")}}


def step_costs(base: dict, fast: dict) -> dict | None:
    """Milliseconds a decode step takes on the device (its graph replay) and in wall time
    (host work included), per arm and block; and each block's device time in plain steps."""
    if not base["device"]:
        return None
    plain = base["device"].get(0, BlockTime()).ms_per_step
    wall = lambda run: 1e3 * run["decode_seconds"] / max(1, sum(t.steps for t in run["device"].values()))
    return {"plain_device_ms": plain, "plain_wall_ms": wall(base), "dflash_wall_ms": wall(fast),
            "dflash_device_ms": {b: t.ms_per_step for b, t in fast["device"].items()},
            "dflash_steps": {b: t.steps for b, t in fast["device"].items()},
            "in_plain_steps": {b: t.ms_per_step / plain for b, t in fast["device"].items() if plain}}


def _tok_s(run: dict) -> float:
    return sum(len(r.output_ids) for r in run["reqs"]) / run["seconds"]


def _speculated_share(reqs: list[Request]) -> float:
    verify = sum(r.spec.verify_ct for r in reqs)
    steps = verify + sum(r.spec.plain_steps for r in reqs)
    return verify / steps if steps else 0.0


def summarize(kind: str, concurrency: int, prompts: list[list[int]], base: dict, fast: dict, fp32: bool) -> dict:
    tokens_base = sum(len(r.output_ids) for r in base["reqs"])
    tokens_fast = sum(len(r.output_ids) for r in fast["reqs"])
    metas = [meta_info(r) for r in fast["reqs"]]
    spec = stats.spec_summary(metas)
    verify = sum(r.spec.verify_ct for r in fast["reqs"])
    plain_steps = sum(r.spec.plain_steps for r in fast["reqs"])
    blocks: dict[int, int] = {}
    for r in fast["reqs"]:
        for b, n in enumerate(r.spec.block_histogram):
            if n:
                blocks[b] = blocks.get(b, 0) + n
    divergences = [_first_divergence(a.output_ids, b.output_ids) for a, b in zip(base["reqs"], fast["reqs"])]
    # Decode tokens: all but the first of each request, which prefill samples.
    decode_base = (tokens_base - len(prompts)) / base["decode_seconds"]
    decode_fast = (tokens_fast - len(prompts)) / fast["decode_seconds"]
    return {
        "prompt": kind, "concurrency": concurrency, "requests": len(prompts),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "plain_tok_s": _tok_s(base), "dflash_tok_s": _tok_s(fast), "speedup": _tok_s(fast) / _tok_s(base),
        "plain_decode_tok_s": decode_base, "dflash_decode_tok_s": decode_fast,
        "decode_speedup": decode_fast / decode_base,
        # Wall time of the prefill steps over the requests: at concurrency 1, each one's prefill.
        "plain_prefill_ms": 1e3 * base["prefill_seconds"] / len(prompts),
        "dflash_prefill_ms": 1e3 * fast["prefill_seconds"] / len(prompts),
        "accept_length_weighted": spec["accept_length_weighted"] if spec else None,
        "accept_length_interface": spec["accept_length_interface"] if spec else None,
        "speculated_share": _speculated_share(fast["reqs"]),
        "verify_steps": verify, "plain_steps": plain_steps, "blocks": dict(sorted(blocks.items())),
        "histogram": spec["histogram"] if spec else [],
        "invariant_violations": spec["invariants"]["violations"] if spec else [],
        "identical_outputs": sum(d is None for d in divergences),
        "first_divergence": [d for d in divergences if d is not None],
        "exact_expected": fp32,
        # Graphs captured inside the timed runs (a capture's time counts against its arm): sampling
        # modes are captured on first use, greedy steps at start-up.
        "graphs_captured": {"plain": base["graphs_captured"], "dflash": fast["graphs_captured"]},
        "step_ms": step_costs(base, fast),  # CUDA only
    }


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def line(r: dict) -> str:
    acc = r["accept_length_weighted"]
    return (f"{r['prompt']:>5} c={r['concurrency']:<2}: plain {r['plain_tok_s']:8.1f} tok/s, dflash "
            f"{r['dflash_tok_s']:8.1f} tok/s, speedup {r['speedup']:.2f}x (decode {r['decode_speedup']:.2f}x) | "
            f"prefill {r['plain_prefill_ms']:.1f} / {r['dflash_prefill_ms']:.1f} ms a request | "
            f"accept length {acc if acc is None else f'{acc:.2f}'} | speculated {100 * r['speculated_share']:.0f}% "
            f"blocks {r['blocks']} | identical {r['identical_outputs']}/{r['requests']}"
            + (f" | graphs captured while timed {captured}" if any((captured := r["graphs_captured"]).values()) else "")
            + (f" | rounds {min(rounds):.2f}-{max(rounds):.2f}x" if len(rounds := r["round_speedups"]) > 1 else "")
            + (f" | device ms a step: plain, blocks (in plain steps) {_device_cell(c)}; wall ms a step: plain "
               f"{c['plain_wall_ms']:.3f}, dflash {c['dflash_wall_ms']:.3f}" if (c := r.get("step_ms")) else ""))


def markdown(result: dict) -> str:
    f = report.fmt
    rows = [[r["prompt"], str(r["concurrency"]), f(r["prompt_tokens_mean"], 0), f(r["plain_tok_s"], 1),
             f(r["dflash_tok_s"], 1), f"{f(r['speedup'])}x", f"{f(r['decode_speedup'])}x",
             f"{f(r['plain_prefill_ms'], 1)} / {f(r['dflash_prefill_ms'], 1)}", f(r["accept_length_weighted"]),
             f(r["accept_length_interface"]), f"{100 * r['speculated_share']:.0f}%",
             " ".join(f"{b}:{n}" for b, n in r["blocks"].items()) or "-",
             f"{r['identical_outputs']}/{r['requests']}", _device_cell(r.get("step_ms"))] for r in result["runs"]]
    head = (f"## DFlash vs plain decoding, {result['device']} {result['dtype']}, drafter block "
            f"{result['drafter_block']} in {result['drafter_dtype']}, block {'pinned to ' + str(result['pinned_block']) if result['pinned_block'] else 'chosen per step'}"
            f"{', drafted ahead' if result.get('draft_ahead') else ''}\n\n")
    return head + report.md_table(
        ["prompt", "concurrency", "prompt tokens", "plain tok/s", "dflash tok/s", "speedup", "decode speedup",
         "prefill ms a request (plain / dflash)", "accept length (weighted)", "accept length (interface)",
         "steps speculated", "blocks (B:steps)", "identical",
         "device ms a step: plain, blocks (in plain steps)"], rows)


def _device_cell(c: dict | None) -> str:
    if not c:
        return "-"
    blocks = ", ".join(f"B={b} {ms:.3f} ({c['in_plain_steps'].get(b, 0):.2f})"
                       for b, ms in c["dflash_device_ms"].items() if b)
    return f"{c['plain_device_ms']:.3f}, {blocks}" if blocks else f"{c['plain_device_ms']:.3f}"


def speedup_png(path: str, result: dict) -> None:
    plt = plot._pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for kind in dict.fromkeys(r["prompt"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["prompt"] == kind]
        ax.plot([r["concurrency"] for r in runs], [r["speedup"] for r in runs], marker="o",
                label=f"{kind} ({runs[0]['prompt_tokens_mean']:.0f} prompt tokens)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.97, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("dflash / plain output tok/s")
    ax.set_title(f"DFlash speedup, {result['device']} {result['dtype']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
