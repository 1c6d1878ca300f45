"""`pdflash dflash train`: train a DFlash drafter for a target model by self-distillation.

  1. data      the target answers prompts through the Engine (batched, CUDA graphs on a GPU):
               the prompt file as chat turns and in the users' few-shot format, plus problems and
               questions it writes itself, each greedy and sampled; sharded and resumable in
               OUT/data/ (see common.tools.drafter.data and .sources); with --gen-workers N,
               N processes generate at once, each with its own engine on the device
  2. training  the frozen target runs once over each sequence and its capture layers feed the
               drafter; random anchors in the response, all blocks of a batch in one forward
               (see common.tools.drafter.objective); AdamW, warmup + cosine, bf16 autocast on CUDA
  3. output    OUT/drafter/ (config.json + model.safetensors, what Drafter.load reads),
               OUT/snapshots/step-N/ (with --snapshot-every, for a scaling curve),
               OUT/checkpoint.pt (resume with --resume), OUT/train_log.jsonl, OUT/train_info.json
               (args, data stats, final metrics, times, the command that reproduces the run)

Both stages resume where a previous run stopped (--stage data with --gen-time-limit, and
--time-limit or --stop-at, split the work into calls of any length); --stage all trains on what
a generation cut by --gen-time-limit finished, and --steps auto fits the training to
--time-limit. `pdflash dflash eval` measures a drafter with the engine.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from common.dflash.drafter import Drafter, DrafterConfig
from common.engine.engine import CHUNK_SIZE
from common.runner.model_runner import ModelRunner
from common.service.loader import ModelOptions, add_model_args, load_model
from common.tools.bench.gsm8k_data import Item
from common.tools.drafter import sources
from common.tools.drafter.data import (DataStore, GenSettings, Part, Sequence, check_pool, data_stats, file_sha256,
                                       generate, pooled_sequences, read_prompts)
from common.tools.drafter.feature_cache import FeatureCache, Places
from common.tools.drafter.objective import SOFT_TOP_K, Batch, make_batch
from common.tools.drafter.plan import plan_steps, replan_points, replanned_total
from common.tools.drafter.trainer import (DRAFTING_ONLY, EpochOrder, Trainer, checkpoint_schedule, load_checkpoint, rounded,
                                          save_checkpoint, save_drafter)

# Flags that steer one invocation but not what it produces: left out of the reproduce command.
RUN_CONTROL = {"resume", "stop_at", "stop_after", "time_limit", "no_progress", "log_every", "save_every", "stage",
               "gen_time_limit", "gen_workers", "compile", "feature_cache"}
PATHS = {"prompts", "data", "pool", "out", "model", "init"}
# Prefill tokens a step while generating on CUDA. Answering 7,473 few-shot GSM8K prompts on the
# H200 (bf16): 3,002 tok/s with steps of 8,192 tokens, 5,052 with 32,768 (docs/PERFORMANCE.md,
# 2026-12-04 (second evening)).
GEN_CHUNK_SIZE = 32768
# What --feature-cache auto leaves free for the training itself: a step of 64 x 32 anchors peaked
# at 14.4 GiB on an H100 (2026-12-07), and a run with 52.0 GiB held at 65.4 GiB (74.7 of the
# card's 79.6 GiB in use, the allocator's reserve with it).
CACHE_RESERVE_GIB = 24


def add_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data (self-distillation)")
    d.add_argument("--prompts", required=True, help="JSONL file of prompts, e.g. the GSM8K training split")
    d.add_argument("--prompt-field", default="question", help="JSON field that holds the prompt")
    d.add_argument("--formats", default="chat",
                   help="how the prompts are posed, comma-separated: chat (a chat user turn), fewshot (the users' "
                        "'Question: ...\\nAnswer:' completion format with --shots worked examples of the same file; "
                        "needs an 'answer' field)")
    d.add_argument("--shots", type=int, default=5, help="worked examples per few-shot prompt")
    d.add_argument("--self-math", type=int, default=0, help="N math word problems the target writes, then answers")
    d.add_argument("--self-chat", type=int, default=0, help="N general questions the target writes, then answers")
    d.add_argument("--max-seqs", type=int, default=None, help="use only the first N prompts of the file")
    d.add_argument("--gen-max-new-tokens", type=int, default=256)
    d.add_argument("--gen-max-running", type=int, default=None, help="engine batch (default 256 on CUDA, 32 on CPU)")
    d.add_argument("--gen-chunk-size", type=int, default=None,
                   help=f"prompt tokens per prefill step while generating (default {GEN_CHUNK_SIZE} on CUDA, "
                        f"{CHUNK_SIZE} on CPU, as serving): the engine refills its batch a quarter at a time, and on "
                        "CUDA each prefill step costs host time whatever its size, so larger steps are fewer; a "
                        "step's activations grow with it (lower it where memory is short)")
    d.add_argument("--gen-workers", type=int, default=1,
                   help="generating processes sharing the device, each with its own target and engine over every "
                        "Nth prompt: on a GPU one's host work overlaps the others' device work (each holds its own "
                        "KV pages for --gen-max-running requests)")
    d.add_argument("--samples-per-prompt", type=int, default=0, help="K sampled answers per prompt besides the greedy one")
    d.add_argument("--source-samples", default=None, metavar="SOURCE=K[,...]",
                   help="K sampled answers for that source's prompts instead of --samples-per-prompt (e.g. "
                        "--samples-per-prompt 4 --source-samples fewshot=1: more samples of the chat answers, "
                        "without four times the few-shot prompts' prefill)")
    d.add_argument("--sample-temperatures", default="0.8",
                   help="comma-separated; sampled answer k uses the ((k-1) mod n)-th")
    d.add_argument("--sample-top-p", type=float, default=0.95)
    d.add_argument("--data", default=None, help="data folder (default OUT/data); reused and extended if it exists")
    d.add_argument("--pool", default=None, metavar="DIR[,DIR...]",
                   help="train also on the finished sequences of these data folders (other runs' --data, of the same "
                        "model and prompt file; read, never written); a sequence already in the data counts once")
    d.add_argument("--gen-time-limit", type=float, default=None,
                   help="stop generating after this many seconds (what finished is kept: --stage all trains on it, "
                        "--stage data goes on when run again), counted from generation's start, its engine's "
                        "building included; with --gen-workers from the command's start, the processes' model "
                        "loading included: all stop together")
    d.add_argument("--eval-prompts", type=int, default=0, help="hold out the last N prompts (generated first, so that a "
                   "time-limited generation answers them); report their loss, acc1 and accept length")
    d.add_argument("--source-repeat", default=None,
                   help="comma-separated SOURCE=N: an epoch sees that source's sequences N times (e.g. chat=2); a "
                        "fraction sees that share of them, drawn afresh each epoch (fewshot=0.5); N=0 leaves a source "
                        "out of training (self-math-q=0: the written problems only pose self-math's "
                        "questions)")
    d.add_argument("--greedy-repeat", type=int, default=1,
                   help="an epoch sees each greedy answer this many times (the engine verifies at T=0)")
    m = p.add_argument_group("drafter")
    m.add_argument("--init", default=None, metavar="DRAFTER",
                   help="start from this drafter folder's weights, e.g. to train a shipped drafter on more data; "
                        "same shape, or more --layers (added after its own, starting as the identity), or more "
                        "--capture-layers (their features start with zero weight)")
    m.add_argument("--layers", type=int, default=2, help="draft layers")
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--mask-token-id", type=int, default=16, help="MASK token (16 = <empty_output> in SmolLM2, unused in chat)")
    m.add_argument("--capture-layers", default=None, help="comma-separated target layers (default: the DFlash rule, 5 layers)")
    m.add_argument("--sliding-window", type=int, default=None, help="draft context window in tokens (default: all)")
    m.add_argument("--refine", type=float, default=0.0, metavar="SHARE",
                   help="train this share of the blocks (0-1) as a refine pass sees them: their first tokens given, "
                        "the rest scored (0: none; the drafter then drafts in one pass)")
    m.add_argument("--refine-passes", type=int, default=None,
                   help="refine passes the saved drafter runs after its first (default: 2 with --refine, else 0, also "
                        "when --init loads a drafter with passes)")
    m.add_argument("--refine-threshold", type=float, default=0.5,
                   help="the probability from which a draft is kept and given to the next refine pass")
    t = p.add_argument_group("training")
    t.add_argument("--out", default=os.path.join("results", "dflash-train"), help="output folder")
    t.add_argument("--epochs", type=float, default=5.0)
    t.add_argument("--steps", type=_steps, default=None,
                   help="total optimizer steps (overrides --epochs); auto: as many as fit in --time-limit, planned "
                        "before training from timed steps on its first batches and re-planned at 30%% and 60%% of "
                        "them from the run's own pace, so that the learning rate anneals as the time ends (a "
                        "--resume keeps the plan; the command in train_info.json gives the re-plans as --replans)")
    t.add_argument("--replans", default=None, metavar="STEP:TOTAL[,...]",
                   help="at each STEP, go on to TOTAL steps, the learning rate's cosine spread over the steps left "
                        "from where it is: the schedule of a --steps auto run that re-planned (its command says so)")
    t.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    t.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence")
    t.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of block position k")
    t.add_argument("--sampled-labels", choices=["argmax", "greedy-path"], default="argmax",
                   help="labels of sampled answers: the target's greedy choice at every block position (argmax), "
                        "or only while the sampled tokens before it in the block are the greedy choices too "
                        "(greedy-path: the rest are ignored)")
    t.add_argument("--soft-labels", type=float, default=0.0, metavar="W",
                   help=f"weight of the target's own next-token distribution (its top {SOFT_TOP_K} tokens) in each "
                        "label, 0-1; the rest is its greedy token (0: hard labels only). The loss then counts "
                        "that distribution's entropy: not comparable with hard-label runs")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine decays to lr * this")
    t.add_argument("--warmup", type=float, default=0.04, help="warmup: a fraction of the steps (< 1) or a step count")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--amp", choices=["auto", "bf16", "off"], default="auto", help="bf16 autocast (auto: on CUDA only)")
    t.add_argument("--feature-cache", default="0", metavar="GIB",
                   help="keep the target's features of up to GIB GiB of training sequences on the device, so that "
                        "later passes skip its pass over them; auto: the device's free memory less "
                        f"{CACHE_RESERVE_GIB} GiB for the training itself (CUDA only); 0 or off: none (default: on an "
                        "H100, a run holding 37%% of its tokens was no faster over its length, docs/PERFORMANCE.md)")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the drafter's forward and backward. Measured on an H100 with every size "
                        "dynamic (since: only the batch's, not measured yet): a step 1.23x faster once compiled "
                        "(1.25-1.47x in `dflash profile`), after about 115 s of compiling (a resumed run compiles "
                        "again) and, in one 7,000-step run, about 120 s of recompiles: for runs past about 12,000 "
                        "steps. train_info.json records the graphs compiled")
    t.add_argument("--save-dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="drafter file dtype (auto: fp32 if it fits in 40 MB, else bf16)")
    t.add_argument("--seed", type=int, default=0, help="seed of the data (samples, few-shot examples, written "
                   "problems) and, unless --train-seed, of training")
    t.add_argument("--train-seed", type=int, default=None,
                   help="seed of the batch order and the anchors (default: --seed); another value trains a sibling "
                        "on the same data, for `pdflash dflash average`")
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    t.add_argument("--stop-at", type=int, default=None, help="stop (checkpointed) at this step; --resume continues")
    t.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="stop (checkpointed) after this many seconds of this command, leaving --steps auto's plan "
                        "for --time-limit as it is: one call of a run split into calls; --resume continues")
    t.add_argument("--time-limit", type=float, default=None,
                   help="stop (checkpointed) after this many seconds of this command, counted from its start")
    t.add_argument("--snapshot-every", type=int, default=None,
                   help="also save the drafter every N steps in OUT/snapshots/step-N (a scaling curve)")
    t.add_argument("--stage", choices=["all", "data", "train"], default="all",
                   help="all: generate (until done or --gen-time-limit), then train on what finished; data: only "
                        "generate; train: only train (on the data there is). With a checkpoint, --stage all --resume "
                        "generates nothing")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_model_args(p, kv_pages=0)  # --kv-pages 0 = sized for the generation batch


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    read_prompts(args.prompts, args.prompt_field, 1)  # fail on a bad prompt file before loading the model
    started, gen = time.perf_counter(), None
    if args.gen_workers > 1 and _generates(args):  # before this process holds the device
        gen = generate_in_workers(args)
        if not _data_complete(args, gen):
            return 0
    generating = gen is None and _generates(args)
    rows = max(_max_running(args), args.batch_size) if generating else args.batch_size
    runner, tok = load_model(_model_options(args, rows))
    return train(args, runner, tok, gen, started)


def _model_options(args, rows: int) -> ModelOptions:
    """The target, with KV pages for `rows` sequences at once (the generation batch, the
    training batch, or the larger where one process does both), unless --kv-pages says."""
    # Room for prompts up to 512 tokens (few-shot prompts: up to 1280).
    ctx_tokens = (1280 if "fewshot" in _formats(args) else 512) + args.gen_max_new_tokens
    pages = args.kv_pages or rows * -(-ctx_tokens // args.page_size) + 1
    return ModelOptions(args.model, args.dtype, args.device, args.page_size, pages)


def generate_in_workers(args: argparse.Namespace) -> dict:
    """--gen-workers N: N processes, each with its own target and engine on the device, generate
    into the data folder at once, process k asking the prompts i with i % N == k. One's host
    work (scheduling, stop strings, the shards) overlaps the others' device work. The first
    failure (an exception, or a process that dies) stops them all and is raised here."""
    import multiprocessing
    import queue

    n = args.gen_workers
    print(f"generation: {n} processes, each with its own engine; process k asks the prompts i with i % {n} == k",
          flush=True)
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    results, started = ctx.Queue(), time.time()
    procs = [ctx.Process(target=_generate_part, args=(args, k, results, started), daemon=True) for k in range(n)]
    parts: dict[int, dict] = {}
    try:
        for proc in procs:
            proc.start()
        while len(parts) < n:
            try:
                k, part = results.get(timeout=5.0)
            except queue.Empty:
                dead = [(k, p.exitcode) for k, p in enumerate(procs) if k not in parts and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"generating process {dead[0][0]} exited with code {dead[0][1]}") from None
                continue
            if isinstance(part, str):
                raise RuntimeError(f"generating process {k} failed: {part.strip().splitlines()[-1]}\n{part}")
            parts[k] = part
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
    seconds = round(time.perf_counter() - start, 2)  # the processes' start and model loading included
    ordered = [parts[k] for k in range(n)]
    gen = {key: sum(part[key] for part in ordered) for key in ("reused", "generated", "skipped", "gen_tokens")}
    return gen | {"gen_seconds": seconds, "gen_tok_per_s": round(gen["gen_tokens"] / max(seconds, 1e-9), 1),
                  "stopped": "done" if all(part["stopped"] == "done" for part in ordered) else "time limit",
                  "workers": n, "parts": ordered}


def _generate_part(args: argparse.Namespace, k: int, results, started: float) -> None:
    """Process k of --gen-workers (spawned: it loads its own target); puts (k, stats), or (k, the
    traceback) if it fails. --gen-time-limit counts from the command's start (`started`, a
    time.time()), model loading included: all processes stop together."""
    import traceback

    try:
        if torch.device(args.device).type == "cpu":  # the processes share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.gen_workers))
        runner, tok = load_model(_model_options(args, _max_running(args)))
        rows, _, store, srcs = data_sources(args, runner.cfg.name, tok, Part(k, args.gen_workers))
        stats = generate(runner, tok, srcs, store, max_running=_max_running(args), chunk_size=_chunk_size(args),
                         time_limit=args.gen_time_limit, since=started, progress=False, first=held_out(args, rows))
        results.put((k, stats))
    except Exception:  # reported, not raised: the parent stops the others and raises it
        results.put((k, traceback.format_exc()))


def _max_running(args) -> int:
    return args.gen_max_running or (256 if torch.device(args.device).type == "cuda" else 32)


def _chunk_size(args) -> int:
    return args.gen_chunk_size or (GEN_CHUNK_SIZE if torch.device(args.device).type == "cuda" else CHUNK_SIZE)


def train(args: argparse.Namespace, runner: ModelRunner, tok, gen: dict | None = None,
          started: float | None = None) -> int:
    """The whole command on an already loaded target (tests pass theirs); `gen`: what
    generate_in_workers made (this process then generates nothing); `started`: the command's
    start, from which --time-limit and the times recorded count (default: now)."""
    t_start = time.perf_counter() if started is None else started
    _check_args(args)
    os.makedirs(args.out, exist_ok=True)
    data_dir = _data_dir(args)
    device = runner.device
    print(f"reproduce: {reproduce_command(args)}", flush=True)

    # ---- 1. data ------------------------------------------------------------------------
    rows, settings, store, srcs = data_sources(args, runner.cfg.name, tok)
    if gen is None:
        gen = {"generated": 0, "gen_seconds": 0.0, "stopped": f"not run (--stage {args.stage}{' --resume' * args.resume})"}
        if _generates(args):
            gen = generate(runner, tok, srcs, store, max_running=_max_running(args), chunk_size=_chunk_size(args),
                           time_limit=args.gen_time_limit, progress=not args.no_progress, first=held_out(args, rows))
            if not _data_complete(args, gen):
                return 0
    seqs = [s for s in store.sequences(srcs) if s.response_len >= 2]  # an anchor needs a token after it
    is_held = held_out(args, rows)
    held = lambda s: is_held(s.source, s.i)
    source_repeat = _repeats(args.source_repeat or "")
    # A source repeated 0 times is generated (its texts may pose another source's prompts) but not trained on.
    kept = lambda s: source_repeat.get(s.source, 1) > 0
    pooled = [s for s in _pooled(args, settings, seqs) if kept(s) and not held(s)]
    train_seqs = [s for s in seqs if kept(s) and not held(s)] + pooled
    eval_seqs = [s for s in seqs if kept(s) and held(s) and s.k == 0]
    if not train_seqs:
        raise ValueError("no training sequences (nothing finished before --gen-time-limit, every answer is shorter "
                         "than 2 tokens, or every source repeated 0 times?)")
    answered, asked = len({s.i for s in eval_seqs}), min(args.eval_prompts, len(rows))
    if answered < asked:
        print(f"note: {answered} of the {asked} held-out prompts have a finished answer (the held-out check "
              f"reads only those)", flush=True)
    stats = data_stats(train_seqs)
    train_seqs, drawn = repeated(train_seqs, source_repeat, args.greedy_repeat)
    pool_note = f", {len(pooled)} of them from --pool" if pooled else ""
    print(f"data: {data_dir}: {stats['sequences']} training sequences{pool_note}, {stats['response_tokens']:,} response "
          f"tokens ({', '.join(f'{k} {v:,}' for k, v in stats['response_tokens_by_source'].items())})", flush=True)

    # ---- 2. training --------------------------------------------------------------------
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # after generation: the data stays fp32 greedy
    cfg = drafter_config(args, runner)
    train_seed = args.seed if args.train_seed is None else args.train_seed
    order = EpochOrder(train_seqs, args.batch_size, train_seed, drawn)
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    resuming = _resuming(args)
    planned = args.steps == "auto" and not resuming
    if resuming and (args.steps == "auto" or args.replans):  # the schedule of the run it resumes
        total, first, replans = checkpoint_schedule(ckpt_path)
        if args.steps == "auto":
            args.steps, args.replans = first, format_replans(replans) or None
    elif not planned:
        total = args.steps or max(1, round(args.epochs * order.steps_per_epoch))
    torch.manual_seed(train_seed)
    drafter = Drafter(cfg).to(device)
    if args.init:
        added, reads = init_from(drafter, args.init)
        grew = (f", with {added} new layer{'s' * (added > 1)} after its own" if added else "") + \
            (f", reading also the target's layer{'s' * (len(reads) > 1)} {', '.join(map(str, reads))}" if reads else "")
        print(f"initialised from the drafter at {args.init}{grew}", flush=True)
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    cache = feature_cache(args, runner, cfg, order)
    make_trainer = functools.partial(
        Trainer, runner, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay, gamma=args.gamma, anchors=args.anchors, grad_clip=args.grad_clip, amp=amp,
        seed=train_seed, greedy_path=args.sampled_labels == "greedy-path", soft_weight=args.soft_labels,
        refine=args.refine, compile=args.compile, cache=cache)
    eval_batches = [make_batch(eval_seqs[i:i + args.batch_size], device)
                    for i in range(0, len(eval_seqs), args.batch_size)]
    plan = None
    if planned:
        total, plan = plan_steps(make_trainer(copy.deepcopy(drafter), total_steps=1), order, eval_batches,
                                 lambda: args.time_limit - (time.perf_counter() - t_start), args.save_every,
                                 args.snapshot_every, args.out)
        args.steps = total  # what the run does; the command that reproduces it says so
        print(f"--steps auto: {total} steps fit in --time-limit (a step {1e3 * plan['step_fixed_s']:.1f} ms + "
              f"{plan['step_per_token_us']:.4f} us a padded token, and {1e3 * plan['new_shape_s']:.1f} ms more the "
              f"first time a batch shape runs; timed twice on {plan['timed_steps']} of its batches)"
              + (f"; {1e3 * plan['cached_step_fixed_s']:.1f} ms + {plan['cached_step_per_token_us']:.4f} us with "
                 f"the target's features read back, and {1e3 * plan['cached_new_capture_shape_s']:.1f} ms more the "
                 f"first time a partial capture's shape runs" if "cached_step_fixed_s" in plan else ""), flush=True)
    trainer = make_trainer(drafter, total_steps=total)
    start, prev_seconds = 0, 0.0
    if resuming:
        start, prev_seconds = load_checkpoint(ckpt_path, trainer, cfg, total)
        print(f"resumed from {ckpt_path} at step {start}/{total}", flush=True)
        if cache is not None:
            print("note: the feature cache starts empty in this process: its first pass over the data captures "
                  "again, which a plan made before the resume did not count", flush=True)
    elif os.path.isfile(ckpt_path):
        print(f"note: {ckpt_path} exists; starting over (pass --resume to continue it)", flush=True)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {cfg.num_layers} layers, {n_params / 1e6:.2f}M parameters, capture {list(cfg.capture_layers)}, "
          f"block {cfg.block_size}, mask id {cfg.mask_token_id}; {total} steps of {args.batch_size} sequences x "
          f"{args.anchors} anchors ({order.steps_per_epoch} steps/epoch), amp={'bf16' if amp else 'off'}", flush=True)

    # What --time-limit leaves for steps, the last checkpoint and held-out check kept out.
    seconds_left = (lambda: args.time_limit - (time.perf_counter() - t_start) - plan["save_and_check_s"]
                    ) if plan else None
    final, evals, stop_reason, replans = loop(args, trainer, order, eval_batches, start, total, ckpt_path,
                                              prev_seconds, t_start, seconds_left)
    total = trainer.total_steps
    if replans:
        plan["replans"] = replans
    train_seconds = prev_seconds + (time.perf_counter() - t_start)

    # ---- 3. output ----------------------------------------------------------------------
    drafter_dir = os.path.join(args.out, "drafter")
    save_dtype = save_drafter(drafter, drafter_dir, args.save_dtype)
    info = {
        "command": reproduce_command(args),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "data": stats | {"folder": os.path.abspath(data_dir), "eval_sequences": len(eval_seqs),
                         "pooled_sequences": len(pooled)},
        "generation": gen,
        "drafter": asdict(cfg) | {"parameters": n_params, "saved_dtype": str(save_dtype).removeprefix("torch."),
                                  "bytes": os.path.getsize(os.path.join(drafter_dir, "model.safetensors"))},
        "steps": {"done": final.get("step", start), "total": total, "stopped": stop_reason}
                 | ({"planned": plan} if plan else {}),
        "trained_response_tokens": order.response_tokens_through(final.get("step", start)),
        "final": final,
        "eval": evals,
        **({"feature_cache": {"tokens": cache.places.used, "sequences_placed": len(cache.places.start),
                              "sequences_read_back": cache.hits, "sequences_captured": cache.misses}} if cache else {}),
        "time": {"generation_s_this_run": gen["gen_seconds"], "this_run_s": round(time.perf_counter() - t_start, 1),
                 "all_runs_s": round(train_seconds, 1)},  # all_runs_s adds the runs this one resumed
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if args.compile:  # more than one: recompiled (from the 9th on, dynamo runs new shapes eager)
        from torch._dynamo.utils import counters

        info["compiled_graphs"] = counters["stats"]["unique_graphs"]
    for path in (os.path.join(args.out, "train_info.json"), os.path.join(drafter_dir, "train_info.json")):
        with open(path, "w") as f:
            json.dump(info, f, indent=2, default=str)
    print(f"drafter saved to {drafter_dir} ({info['drafter']['bytes'] / 2**20:.1f} MiB, {info['drafter']['saved_dtype']}); "
          f"final {_fmt(final) or '(no steps run)'}{'; eval ' + _fmt(evals[-1]) if evals else ''}", flush=True)
    if stop_reason != "done":
        print(f"stopped at step {info['steps']['done']}/{total} ({stop_reason}); add --resume to continue", flush=True)
    print(f"reproduce: {reproduce_command(args)}", flush=True)
    return 0


def _data_dir(args) -> str:
    return args.data or os.path.join(args.out, "data")


def data_sources(args: argparse.Namespace, model_name: str, tok, part: Part = Part()
                 ) -> tuple[list[dict], GenSettings, DataStore, list[sources.Source]]:
    """The prompt file's rows, the data settings, the data folder (for `part`'s writes) and the
    sources of this command's data."""
    rows = read_prompts(args.prompts, args.prompt_field, args.max_seqs)
    settings = GenSettings(model=model_name, prompts=os.path.basename(args.prompts),
                           prompts_sha256=file_sha256(args.prompts), prompt_field=args.prompt_field, shots=args.shots,
                           gen_max_new_tokens=args.gen_max_new_tokens, sample_temperatures=_temperatures(args),
                           sample_top_p=args.sample_top_p, seed=args.seed)
    for folder in _pool_folders(args):  # before generation, which may take hours
        check_pool(folder, settings)
    store = DataStore(_data_dir(args), settings, part)
    items = [Item(r[args.prompt_field], r["answer"]) for r in rows] if "fewshot" in _formats(args) else None
    srcs = sources.build(tok, [str(r[args.prompt_field]) for r in rows], items, formats=_formats(args),
                         shots=args.shots, samples=args.samples_per_prompt,
                         source_samples=_source_samples(args.source_samples), self_math=args.self_math,
                         self_chat=args.self_chat, seed=args.seed, written=lambda name, i: store.written(name, i, tok))
    return rows, settings, store, srcs


def held_out(args: argparse.Namespace, rows: list[dict]) -> Callable[[str, int], bool]:
    """Whether prompt i of a source is one the held-out check reads (its greedy answer; none is
    trained on): the prompt file's last --eval-prompts, asked in either of its formats."""
    first = len(rows) - args.eval_prompts if args.eval_prompts else len(rows)
    return lambda source, i: source in ("chat", "fewshot") and i >= first  # the sources asking the file's prompt i


def _data_complete(args, gen: dict) -> bool:
    """Report a generation run; whether training may follow it."""
    workers = f" by {gen['workers']} processes" if gen.get("workers") else ""
    print(f"generation: {gen['generated']} sequences, {gen['gen_tokens']:,} tokens in {gen['gen_seconds']} s{workers} "
          f"({gen['gen_tok_per_s']:,.0f} tok/s), {gen['reused']} reused, {gen['skipped']} skipped; {gen['stopped']}",
          flush=True)
    for k, part in enumerate(gen.get("parts", ())):  # each from its engine's start, after its model loaded
        print(f"  part {k}: {part['generated']} sequences, {part['gen_tokens']:,} tokens in {part['gen_seconds']} s "
              f"({part['gen_tok_per_s']:,.0f} tok/s); {part['stopped']}", flush=True)
    if args.stage == "data":
        print("data not complete: run again to go on" if gen["stopped"] != "done" else "data done", flush=True)
        return False
    if gen["stopped"] != "done":
        print("generation stopped at --gen-time-limit: training on what finished (--stage data generates more)",
              flush=True)
    return True


def _resuming(args) -> bool:
    return args.resume and os.path.isfile(os.path.join(args.out, "checkpoint.pt"))


def _generates(args) -> bool:
    """Whether this command generates: --stage data always; --stage all unless it resumes a
    training (which goes on with the data it began on: more would change its batches)."""
    return args.stage == "data" or (args.stage == "all" and not _resuming(args))


def loop(args, trainer: Trainer, order: EpochOrder, eval_batches: list[Batch], start: int, total: int,
         ckpt_path: str, prev_seconds: float, t_start: float,
         seconds_left: Callable[[], float] | None = None) -> tuple[dict, list[dict], str, list[dict]]:
    """Train from `start` to `total` steps, re-planning where --replans says, and where
    seconds_left is given (a run that --steps auto planned) at replan_points from its own pace.
    Returns the last log line, the held-out checks, why it stopped and the re-plans it made."""
    from tqdm import tqdm

    device = trainer.device
    log_path = os.path.join(args.out, "train_log.jsonl")
    window: list[dict[str, torch.Tensor]] = []
    final: dict = {}
    evals: list[dict] = []
    stop_reason, step = "done", start
    t_log, seqs_since = time.perf_counter(), 0
    points, paced_from, replans = (replan_points(total) if seconds_left else []), None, []
    given = dict(parse_replans(args.replans))  # a schedule's re-plans, as a --steps auto run made them
    bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=args.no_progress)
    with open(log_path, "a") as log:
        while step < total:
            if args.stop_at is not None and step >= args.stop_at:
                stop_reason = "--stop-at"
                break
            if args.time_limit is not None and time.perf_counter() - t_start > args.time_limit:
                stop_reason = "--time-limit"
                break
            if args.stop_after is not None and time.perf_counter() - t_start > args.stop_after:
                stop_reason = "--stop-after"
                break
            seqs = order.batch(step)
            window.append(trainer.step(make_batch(seqs, device), step))
            seqs_since += len(seqs)
            step += 1
            bar.update(1)
            if step % args.log_every == 0 or step == total:
                final = {"step": step, "lr": trainer.lr_at(step - 1),
                         **{k: float(torch.stack([m[k] for m in window]).float().mean()) for k in window[0]}}
                final["seq_per_s"] = seqs_since / (time.perf_counter() - t_log)
                final = rounded(final)
                window, t_log, seqs_since = [], time.perf_counter(), 0
                bar.set_postfix_str(_fmt(final), refresh=False)
                log.write(json.dumps(final) + "\n")
                log.flush()
            if args.snapshot_every and step % args.snapshot_every == 0 and step < total:
                save_snapshot(os.path.join(args.out, "snapshots", f"step-{step}"), trainer, order, step, args)
            if step % args.save_every == 0 and step < total:
                save_checkpoint(ckpt_path, trainer, step, prev_seconds + time.perf_counter() - t_start)
                if eval_batches:
                    evals.append({"step": step, **trainer.evaluate(eval_batches)})
                    log.write(json.dumps({"eval": evals[-1]}) + "\n")
                    bar.write(f"eval @ {step}: {_fmt(evals[-1])}")
            if step in given:
                total = given[step]
                trainer.replan(step, total)
                bar.total = total
            if points and step == points[0]:
                points.pop(0)
                now = time.perf_counter()
                if paced_from is not None:
                    pace = (now - paced_from[1]) / (step - paced_from[0])
                    total = replanned_total(step, seconds_left(), pace)
                    trainer.replan(step, total)
                    args.replans = format_replans(trainer.replans)  # what the command (and a snapshot's) says
                    bar.total = total
                    replans.append({"step": step, "ms_per_step": round(1e3 * pace, 2), "total": total})
                    bar.write(f"--steps auto: re-planned at step {step} from the run's pace since step "
                              f"{paced_from[0]} ({1e3 * pace:.1f} ms a step with its checks): {total} steps")
                    # A run cut before its next checkpoint resumes with this plan, not the one before.
                    save_checkpoint(ckpt_path, trainer, step, prev_seconds + time.perf_counter() - t_start)
                paced_from = (step, time.perf_counter())
    bar.close()
    if window:  # steps after the last log line
        final = rounded({"step": step, "lr": trainer.lr_at(step - 1),
                          **{k: float(torch.stack([m[k] for m in window]).float().mean()) for k in window[0]}})
    if step > start or not os.path.isfile(ckpt_path):
        save_checkpoint(ckpt_path, trainer, step, prev_seconds + time.perf_counter() - t_start)
    if eval_batches:
        evals.append({"step": step, **trainer.evaluate(eval_batches)})
    final.setdefault("step", step)
    if device.type == "cuda":
        final["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return final, evals, stop_reason, replans


# ---- drafter, checkpoint, command --------------------------------------------------------

def save_snapshot(folder: str, trainer: Trainer, order: EpochOrder, step: int, args) -> None:
    """The drafter as of `step`, with what it was trained on so far (`dflash eval` reads it)."""
    save_drafter(trainer.drafter, folder, args.save_dtype)
    with open(os.path.join(folder, "train_info.json"), "w") as f:
        json.dump({"step": step, "trained_response_tokens": order.response_tokens_through(step),
                   "command": reproduce_command(args)}, f, indent=2)


def feature_cache(args, runner: ModelRunner, cfg: DrafterConfig, order: EpochOrder) -> FeatureCache | None:
    """The --feature-cache for the training sequences, or None when off: places first for the
    sequences an epoch meets most often, and among those met as often for the shortest (the
    held-out check's are captured each time). Batches are of like lengths (EpochOrder), so that
    the short ones' are read back whole and the long ones' captured whole: in a simulation of
    the 2026-12-07 H100 run's data, 3,062 of 5,145 later steps read back whole and 95 in part,
    where places in data order left 4,573 in part and none whole."""
    if _cache_off(args):
        return None
    layers, hidden = cfg.capture_layers, runner.cfg.hidden_size
    per = FeatureCache.bytes_per_token(layers, hidden, runner.dtype)
    ranked = sorted(order.per_epoch(), key=lambda seq_times: (-seq_times[1], len(seq_times[0].ids)))
    need = sum(len(s.ids) for s, _ in ranked)
    if args.feature_cache == "auto":
        if runner.device.type != "cuda":
            print("feature cache: off (--feature-cache auto sizes it on CUDA only; give GiB to have one)", flush=True)
            return None
        torch.cuda.empty_cache()  # what generation's engine left cached counts as free
        budget = torch.cuda.mem_get_info(runner.device)[0] - CACHE_RESERVE_GIB * 2**30
    else:
        budget = float(args.feature_cache) * 2**30
    places = Places([(id(s), len(s.ids)) for s, _ in ranked], max(0, int(budget // per)))
    print(f"feature cache: {places.used * per / 2**30:.1f} GiB for {places.used:,} of the data's {need:,} tokens "
          f"({places.used / max(need, 1):.0%}; {per:,} bytes a token)", flush=True)
    return FeatureCache(places, layers, hidden, runner.dtype, runner.device) if places.used else None


def init_from(drafter: Drafter, folder: str) -> tuple[int, tuple[int, ...]]:
    """The weights of the drafter in `folder` (more steps or data for a trained drafter). Its
    shape and what it reads from the target must be those this run trains, except that this
    run may be deeper or read more of the target's layers, and the loaded drafter first drafts
    exactly what it did: the layers it adds go after the loaded ones and start as the identity
    (their output projections zero); the capture layers it adds get zero columns in fc, so their
    features add nothing until training moves them. This run's refine settings (how it drafts,
    not what it holds) replace its own. Returns the layers and the capture layers added."""
    start = Drafter.load(folder)
    ours, theirs = drafter.cfg, start.cfg
    deeper = theirs.num_layers <= ours.num_layers
    wider = set(theirs.capture_layers) <= set(ours.capture_layers)
    if replace(theirs, num_layers=ours.num_layers, capture_layers=ours.capture_layers,
               **{k: getattr(ours, k) for k in DRAFTING_ONLY}) != ours or not deeper or not wider:
        diff = {k: (v, getattr(ours, k)) for k, v in asdict(theirs).items()
                if getattr(ours, k) != v and k not in DRAFTING_ONLY and not (k == "num_layers" and deeper)
                and not (k == "capture_layers" and wider)}
        raise ValueError(f"--init {folder}: that drafter differs from this run's (theirs, ours): {diff}; "
                         f"only more layers or more capture layers may be added")
    state = start.state_dict()
    if ours.capture_layers != theirs.capture_layers:  # fc's column block i reads capture layer i
        width = ours.target_hidden_size or ours.hidden_size
        loaded = state["fc.weight"]
        fc = loaded.new_zeros(loaded.shape[0], len(ours.capture_layers) * width)
        for i, layer in enumerate(theirs.capture_layers):
            j = ours.capture_layers.index(layer)
            fc[:, j * width:(j + 1) * width] = loaded[:, i * width:(i + 1) * width]
        state["fc.weight"] = fc
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    new = tuple(f"layers.{i}." for i in range(theirs.num_layers, ours.num_layers))
    if unexpected or not all(k.startswith(new) for k in missing):
        raise ValueError(f"--init {folder}: its weights do not fit this drafter (missing {missing}, "
                         f"unexpected {unexpected})")
    with torch.no_grad():
        for layer in drafter.layers[theirs.num_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return ours.num_layers - theirs.num_layers, tuple(x for x in ours.capture_layers if x not in theirs.capture_layers)


def drafter_config(args, runner: ModelRunner) -> DrafterConfig:
    target = runner.cfg
    if not 0 <= args.mask_token_id < target.vocab_size:
        raise ValueError(f"--mask-token-id {args.mask_token_id} is outside the vocabulary (0..{target.vocab_size - 1})")
    extra = {}
    if args.capture_layers:
        layers = tuple(int(x) for x in args.capture_layers.split(","))
        if any(not 0 <= x < target.num_layers for x in layers):
            raise ValueError(f"--capture-layers {layers}: the target has layers 0..{target.num_layers - 1}")
        extra["capture_layers"] = layers
    passes = args.refine_passes if args.refine_passes is not None else 2 if args.refine else 0
    return DrafterConfig.for_target(target, num_layers=args.layers, block_size=args.block_size,
                                    mask_token_id=args.mask_token_id, sliding_window=args.sliding_window,
                                    refine_passes=passes, refine_threshold=args.refine_threshold, **extra)


def reproduce_command(args: argparse.Namespace) -> str:
    """`pdflash dflash train` with every option that shapes the result spelled out."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    words = ["pdflash", "dflash", "train"]
    for action in parser._actions:
        if action.dest in RUN_CONTROL or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                words.append(action.option_strings[0])
        elif value is not None:
            if action.dest == "pool":
                value = ",".join(_near(path) for path in _pool_folders(args))
            elif action.dest in PATHS:
                value = _near(str(value))
            words += [action.option_strings[0], str(value)]
    return shlex.join(words)


def _pooled(args, settings: GenSettings, seqs: list[Sequence]) -> list[Sequence]:
    """The --pool folders' sequences that are not already in `seqs` or an earlier folder: the
    greedy answers to the prompt file's questions are the same in every run's data."""
    seen = {s.ids.tobytes() for s in seqs}
    out = []
    for folder in _pool_folders(args):
        for seq in pooled_sequences(folder):
            key = seq.ids.tobytes()
            if seq.response_len >= 2 and key not in seen:
                seen.add(key)
                out.append(seq)
    return out


def _pool_folders(args) -> list[str]:
    return [f.strip() for f in (args.pool or "").split(",") if f.strip()]


def _near(path: str) -> str:
    """The command is run from a checkout, wherever that is: absolute paths near it relative."""
    if not os.path.isabs(path):
        return path
    rel = os.path.relpath(path)
    return path if rel.startswith(os.path.join(os.pardir, os.pardir)) else rel


def repeated(seqs: list, source_repeat: dict[str, float], greedy_repeat: int) -> tuple[list, list[tuple[list, int]]]:
    """The training sequences with some weighted by repetition: a sequence of source s appears
    source_repeat[s] times an epoch (default 1), times greedy_repeat if it is a greedy answer.
    Whole repeats are in the first list; a fraction f of a repeat puts the sequence in a group
    of the second, from which an epoch draws f of the group's sequences (EpochOrder)."""
    always, parts = [], {}
    for seq in seqs:
        times = source_repeat.get(seq.source, 1) * (1 if seq.sampled else greedy_repeat)
        whole = math.floor(times + 1e-9)  # 0.7 x 3 is 2.0999...: two whole repeats and no sliver
        always += [seq] * whole
        if times - whole > 1e-9:
            parts.setdefault((seq.source, seq.sampled, round(times - whole, 9)), []).append(seq)
    # Each source's share exactly, greedy and sampled answers apart; at least one of a group.
    return always, [(group, max(1, math.floor(f * len(group) + 0.5))) for (_, _, f), group in parts.items()]


def _repeats(text: str) -> dict[str, float]:
    return _per_source(text, "--source-repeat", sources.NAMES, float,
                       "N with N >= 0 (a fraction draws that share of the source each epoch)")


def _source_samples(text: str | None) -> dict[str, int]:
    return _per_source(text, "--source-samples", tuple(x for x in sources.NAMES if not x.endswith("-q")), int,
                       "K with K >= 0")


def _per_source(text: str | None, option: str, names: tuple[str, ...], kind: type, want: str) -> dict:
    """OPTION SOURCE=V,...: V of `kind` (int or float), finite and >= 0, for the sources in `names`."""
    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, n = part.partition("=")
        try:
            v = kind(n)
        except ValueError:
            v = -1
        if name not in names or not 0 <= v < math.inf:
            raise ValueError(f"{option} {part!r}: want SOURCE={want}, SOURCE one of {', '.join(names)}")
        out[name] = v
    return out


def parse_replans(text: str | None) -> list[tuple[int, int]]:
    """--replans STEP:TOTAL,...: (step, total) pairs, steps rising, each total past its step."""
    if not text:
        return []
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or not 0 < p[0] < p[1] for p in pairs) or \
            any(a[0] >= b[0] for a, b in zip(pairs, pairs[1:])):
        raise ValueError(f"--replans {text!r}: want STEP:TOTAL pairs, steps rising, each total past its step "
                         "(e.g. 900:7000,1800:7400)")
    return pairs


def format_replans(replans: list[tuple[int, int]]) -> str:
    return ",".join(f"{step}:{total}" for step, total in replans)


def _steps(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number of steps or auto, not {text!r}") from None


def _cache_off(args) -> bool:
    return args.feature_cache == "off" or (args.feature_cache != "auto" and float(args.feature_cache) == 0)


def _formats(args) -> tuple[str, ...]:
    return tuple(f.strip() for f in args.formats.split(",") if f.strip())


def _temperatures(args) -> list[float]:
    return [float(t) for t in args.sample_temperatures.split(",") if t.strip()]


def _check_args(args) -> None:
    bad = set(_formats(args)) - {"chat", "fewshot"}
    if bad or not _formats(args):
        raise ValueError(f"--formats: choose from chat, fewshot (got {args.formats!r})")
    temps = _temperatures(args)
    if not temps or min(temps) <= 0:
        raise ValueError(f"--sample-temperatures must be positive numbers (got {args.sample_temperatures!r})")
    if min(args.self_math, args.self_chat, args.shots) < 0:
        raise ValueError("--self-math, --self-chat and --shots must be >= 0")
    if args.greedy_repeat < 1:
        raise ValueError("--greedy-repeat must be at least 1")
    _repeats(args.source_repeat or "")
    _source_samples(args.source_samples)
    for name in ("batch_size", "anchors", "block_size", "layers", "gen_max_new_tokens", "gen_chunk_size", "log_every",
                 "save_every", "gen_workers"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.block_size < 2:
        raise ValueError("--block-size must be at least 2")
    if args.steps == "auto" and args.time_limit is None and args.stage != "data":
        raise ValueError("--steps auto plans the steps that fit in --time-limit: give one")
    if args.steps is not None and args.steps != "auto" and args.steps <= 0:
        raise ValueError("--steps must be positive")
    if args.stop_after is not None and args.stop_after < 0:
        raise ValueError("--stop-after must be >= 0 seconds")
    if parse_replans(args.replans) and not isinstance(args.steps, int):
        raise ValueError("--replans re-plans a schedule of --steps N (a --steps auto run makes its own)")
    if args.samples_per_prompt < 0 or args.eval_prompts < 0:
        raise ValueError("--samples-per-prompt and --eval-prompts must be >= 0")
    if args.feature_cache not in ("auto", "off"):
        try:
            gib = float(args.feature_cache)
        except ValueError:
            gib = -1.0
        if not 0 <= gib < math.inf:
            raise ValueError(f"--feature-cache: want GiB (>= 0), auto or off, not {args.feature_cache!r}")
    if not _cache_off(args) and args.soft_labels:
        raise ValueError("--feature-cache holds no soft labels: use it with --soft-labels 0")
    if not 0.0 <= args.soft_labels <= 1.0:
        raise ValueError(f"--soft-labels must be between 0 and 1 (got {args.soft_labels})")
    if not 0.0 <= args.refine <= 1.0:
        raise ValueError(f"--refine must be between 0 and 1 (got {args.refine})")
    if args.refine and args.block_size < 3:
        raise ValueError("--refine needs --block-size 3 or more (a given start and a position after it)")
    if args.refine_passes is not None and args.refine_passes < 0:
        raise ValueError(f"--refine-passes must be >= 0 (got {args.refine_passes})")
    if not 0.0 < args.refine_threshold < 1.0:
        raise ValueError(f"--refine-threshold must be between 0 and 1, exclusive (got {args.refine_threshold})")


def _fmt(m: dict) -> str:
    keys = [("loss", "loss {:.3f}"), ("acc1", "acc1 {:.3f}"), ("accept_len", "accept_len {:.2f}"),
            ("lr", "lr {:.2e}"), ("seq_per_s", "{:.1f} seq/s")]
    return " ".join(f.format(m[k]) for k, f in keys if k in m)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdflash dflash train", description=__doc__.splitlines()[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
