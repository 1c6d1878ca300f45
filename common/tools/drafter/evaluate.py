"""`pdflash dflash eval`: how far a drafter's blocks get accepted, measured by the engine.

Each evaluation set is run through the speculative engine with the block pinned to the
drafter's (every step speculates, so the number is the drafter's, not the policy's), T=0, and
through plain decoding; it reports the weighted accept length (1 + accepted drafts per verify
step over the whole set) and how many outputs equal plain decoding token for token (all of them
in fp32: speculation is lossless). Sets:

  gsm8k    GSM8K test questions as chat turns (the chat template), as `bench dflash` asks them
  fewshot  the users' format: the first `shots` shipped training exemplars, then the test
           question, plain completion, stopping at the next "Question" (as `bench gsm8k`)
  chat     16 general (non-math) chat prompts shipped with pdflash (tools/drafter/data)

The test questions are never training data: `dflash train` reads its prompts from a file the
user gives (the GSM8K train split), and the exemplars are training questions.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
import uuid

import torch

from common.dflash.drafter import Drafter, draft_dtype, shipped_drafter_path
from common.dflash.proposer import DFlashProposer
from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.engine.spec_policy import SpecConfig
from common.model import gemv
from common.model.tokenizer import IncrementalDecoder, Tokenizer
from common.runner.model_runner import ModelRunner
from common.service.loader import ModelOptions, add_model_args, load_model
from common.service.spec_args import DRAFT_DTYPES, refine_setting
from common.tools.bench import gsm8k_data, report

CHAT_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "chat_eval.jsonl")
SETS = ("gsm8k", "fewshot", "chat")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", action="append", default=None,
                   help="drafter folder (repeat to compare several; default: the shipped drafter)")
    p.add_argument("--draft-dtype", default="auto",
                   help=f"comma-separated, of {', '.join(DRAFT_DTYPES)}: each drafter is measured in each (as "
                        f"--draft-dtype of the services)")
    p.add_argument("--refine", default="saved",
                   help="comma-separated refine settings, each drafter measured with each: saved (its own), or "
                        "PASSES[@THRESHOLD] (0: one pass; see dflash train --refine)")
    p.add_argument("--sets", default="gsm8k,fewshot,chat", help=f"comma-separated, of {', '.join(SETS)}")
    p.add_argument("--num", type=int, default=64, help="prompts per set (chat has 16)")
    p.add_argument("--offset", type=int, default=0, help="first GSM8K test question")
    p.add_argument("--shots", type=int, default=5, help="few-shot exemplars (the fewshot set)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--no-compare", action="store_true", help="skip the plain run (no identical-output check)")
    p.add_argument("--out", default=os.path.join("bench-out", "dflash-eval"), help="output folder (eval.json)")
    add_model_args(p, kv_pages=0)


def refine_settings(spec: str) -> list[dict]:
    """--refine: [{}] for the drafter's own settings, or {refine_passes, refine_threshold} overrides."""
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        try:
            out.append({} if item == "saved" else refine_setting(item))
        except ValueError as e:
            raise ValueError(f"--refine {spec!r}: each item saved or PASSES[@THRESHOLD], e.g. 0,2@0.5; {e}") from None
    if not out:
        raise ValueError(f"--refine {spec!r}: no settings")
    return out


def eval_prompts(tok: Tokenizer, name: str, num: int, offset: int = 0, shots: int = 5
                 ) -> list[tuple[list[int], tuple[str, ...]]]:
    """(prompt ids, stop strings) of an evaluation set."""
    if name == "chat":
        with open(CHAT_PROMPTS) as f:
            texts = [json.loads(line)["question"] for line in f if line.strip()][:num]
        return [(tok.apply_chat_template([{"role": "user", "content": t}]), ()) for t in texts]
    items = gsm8k_data.load(gsm8k_data.DEFAULT_TEST)[offset:offset + num]
    if len(items) < num:
        raise ValueError(f"the shipped GSM8K test split has too few questions for --offset {offset} --num {num}")
    if name == "gsm8k":
        return [(tok.apply_chat_template([{"role": "user", "content": it.question}]), ()) for it in items]
    if name == "fewshot":
        exemplars = gsm8k_data.load(gsm8k_data.DEFAULT_TRAIN)[:shots]
        return [(tok.encode(gsm8k_data.few_shot_prompt(exemplars, it)), tuple(gsm8k_data.STOP)) for it in items]
    raise ValueError(f"unknown evaluation set {name!r} (known: {', '.join(SETS)})")


def _run(engine: Engine, tok: Tokenizer, prompts, max_new_tokens: int, concurrency: int, desc: str) -> list[Request]:
    from tqdm import tqdm

    reqs = [Request(uuid.uuid4().hex, ids, SamplingParams(max_new_tokens=max_new_tokens, stop=stop),
                    decoder=IncrementalDecoder(tok, stop) if stop else None) for ids, stop in prompts]
    with tqdm(total=len(reqs), desc=desc, unit="prompt", mininterval=2, file=sys.stderr) as bar:
        for outputs in engine.run(reqs, concurrency):
            bar.update(sum(o.finished for o in outputs))
    return reqs


def spec_engine(runner: ModelRunner, tok: Tokenizer, drafter: Drafter, concurrency: int) -> Engine:
    """An engine that speculates with `drafter` at its whole block every step (no policy choice:
    the accept length is the drafter's alone)."""
    proposer = DFlashProposer(drafter, runner, runner.pool.num_pages)
    return Engine(runner, tok.eos_token_ids, max_running=concurrency, proposer=proposer,
                  spec=SpecConfig(block=drafter.cfg.block_size))


@torch.inference_mode()
def evaluate(engine: Engine, tok: Tokenizer, prompts, *, max_new_tokens: int = 256, concurrency: int = 16,
             plain: list[list[int]] | None = None, desc: str = "speculative") -> dict:
    """Weighted accept length of a speculating engine's drafter on these prompts; with `plain`
    (the outputs of plain decoding), also how many outputs are identical."""
    start = time.perf_counter()
    reqs = _run(engine, tok, prompts, max_new_tokens, concurrency, desc)
    seconds = time.perf_counter() - start
    verify = sum(r.spec.verify_ct for r in reqs)
    accepted = sum(r.spec.accepted_drafts for r in reqs)
    hist = [sum(x) for x in zip(*(r.spec.histogram for r in reqs))]
    result = {"prompts": len(reqs), "output_tokens": sum(len(r.output_ids) for r in reqs),
              "verify_steps": verify, "accept_length_weighted": round(1 + accepted / verify, 3) if verify else 0.0,
              "accept_histogram": hist, "seconds": round(seconds, 2)}
    if plain is not None:
        result["identical"] = sum(r.output_ids == p for r, p in zip(reqs, plain))
    return result


@torch.inference_mode()
def plain_outputs(runner: ModelRunner, tok: Tokenizer, prompts: dict[str, list], max_new_tokens: int,
                  concurrency: int) -> dict[str, list[list[int]]]:
    """Each set's outputs of plain decoding, from one engine."""
    engine = Engine(runner, tok.eos_token_ids, max_running=concurrency)
    return {name: [r.output_ids for r in _run(engine, tok, p, max_new_tokens, concurrency, f"plain: {name}")]
            for name, p in prompts.items()}


def measure(args: argparse.Namespace, runner: ModelRunner, tok: Tokenizer, sets: list[str], dtypes: list[str],
            refines: list[dict]) -> dict:
    """Every drafter x dtype x refine setting on every set: the command's eval.json."""
    prompts = {name: eval_prompts(tok, name, args.num, args.offset, args.shots) for name in sets}
    plain = {} if args.no_compare else plain_outputs(runner, tok, prompts, args.max_new_tokens, args.concurrency)
    paths = args.draft_model or [shipped_drafter_path(args.model)]
    result = {"bench": "dflash-eval", "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
              "max_new_tokens": args.max_new_tokens, "provenance": report.provenance(args), "drafters": []}
    resolved = list(dict.fromkeys(draft_dtype(d, runner.dtype, runner.device) for d in dtypes))  # auto may repeat one
    for path, dtype, refine in itertools.product(paths, resolved, refines):
        drafter = Drafter.load(path, device=runner.device, dtype=dtype)
        drafter.set_refine(refine)
        cfg = drafter.cfg
        row = {"drafter": path, "draft_dtype": str(dtype).removeprefix("torch."), "refine_passes": cfg.refine_passes,
               "refine_threshold": cfg.refine_threshold, "sets": {}}
        label = row["draft_dtype"] + (f", refine {cfg.refine_passes}@{cfg.refine_threshold}" if cfg.refine_passes else "")
        info_path = os.path.join(path, "train_info.json")
        if os.path.isfile(info_path):  # what it was trained on, for the scaling curve
            with open(info_path) as f:
                info = json.load(f)
            row["trained_response_tokens"] = info.get("trained_response_tokens")
        engine = spec_engine(runner, tok, drafter, args.concurrency)  # one for every set: its graphs captured once
        for name, p in prompts.items():
            row["sets"][name] = evaluate(engine, tok, p, max_new_tokens=args.max_new_tokens,
                                         concurrency=args.concurrency, plain=plain.get(name),
                                         desc=f"{os.path.basename(path.rstrip('/'))} ({label}): {name}")
            r = row["sets"][name]
            same = f", identical {r['identical']}/{r['prompts']}" if "identical" in r else ""
            print(f"{path} ({label}): {name}: accept length {r['accept_length_weighted']:.2f} over "
                  f"{r['verify_steps']} verify steps, {r['prompts']} prompts{same}", flush=True)
        result["drafters"].append(row)
        del engine, drafter  # freed before the next drafter's engine is built
    return result


def run(args: argparse.Namespace) -> int:
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    dtypes = [d.strip() for d in args.draft_dtype.split(",") if d.strip()]
    if not dtypes or set(dtypes) - set(DRAFT_DTYPES):
        raise ValueError(f"--draft-dtype {args.draft_dtype!r}: expected a comma-separated list of {', '.join(DRAFT_DTYPES)}")
    refines = refine_settings(args.refine)
    if min(args.num, args.max_new_tokens, args.concurrency) < 1:
        raise ValueError("--num, --max-new-tokens and --concurrency must be at least 1")
    opts = ModelOptions.from_args(args)
    if not opts.kv_pages:  # every request in flight with its longest prompt (few-shot ~900 tokens) and a block
        per = -(-(1200 + args.max_new_tokens + 32) // opts.page_size)
        opts = dataclasses.replace(opts, kv_pages=args.concurrency * per + 8)
    runner, tok = load_model(opts)
    # This command measures accept lengths, not speed: no product's kernel is timed here
    # (gemv.kept_only; choices kept on disk are taken, else cuBLAS). On a fresh GPU timing adds
    # seconds per product shape (the fp32 target's, the drafter's) to the first engines' start.
    with gemv.kept_only():
        result = measure(args, runner, tok, sets, dtypes, refines)
    report.write_json(os.path.join(args.out, "eval.json"), result)
    print(f"saved {args.out}/eval.json")
    fp32 = runner.dtype == torch.float32
    bad = [(row["drafter"], row["draft_dtype"], n) for row in result["drafters"] for n, r in row["sets"].items()
           if fp32 and "identical" in r and r["identical"] != r["prompts"]]
    for path, dtype, name in bad:
        print(f"error: {path} ({dtype}): {name}: outputs differ from plain decoding in fp32", file=sys.stderr)
    return 1 if bad else 0
