"""`pdflash dflash profile`: where a drafter training step's time goes, on random weights of a
target's shape (no model files): per batch shape, ms per step and sequences per second, split
into the frozen target's pass (capture), the drafter's forward with the loss, the backward and
the optimizer; on CUDA also the busiest kernels of one step. Synthetic sequences of L tokens
whose first P are the prompt (anchors fall in the rest), as `dflash train` batches them."""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from common.dflash.drafter import Drafter, DrafterConfig
from common.model.shapes import SHAPES, RandomWeights
from common.runner.model_runner import ModelRunner
from common.tools.drafter.data import Sequence
from common.tools.drafter.feature_cache import FeatureCache, Places
from common.tools.drafter.objective import Batch, make_batch
from common.tools.drafter.trainer import Trainer

DEFAULT_CASES = "32x32x450x150,64x32x450x150,128x32x450x150,32x64x450x150,32x32x1150x1000"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="embedded", choices=sorted(SHAPES), help="target shape (random weights)")
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help="comma-separated SEQSxANCHORSxLxP: sequences per step, anchors per sequence, "
                        "tokens per sequence, of which prompt")
    p.add_argument("--layers", type=int, default=4, help="draft layers")
    p.add_argument("--steps", type=int, default=6, help="timed steps per case (after 2 warm-up steps)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-kernels", action="store_true", help="skip the per-kernel table (CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile the drafter, as `dflash train --compile`")
    p.add_argument("--feature-cache", action="store_true",
                   help="time each case also with the target's features read back (`dflash train --feature-cache`)")
    p.add_argument("--read-back-shares", default="1", metavar="S[,S...]",
                   help="with --feature-cache: the shares of each batch's sequences read back, one timing each; the "
                        "rest are captured every step, as where a run's cache holds part of its data (e.g. 1,0.875)")
    p.add_argument("--out", default=os.path.join("bench-out", "dflash-profile.json"))


def run(args: argparse.Namespace) -> int:
    cases = [_case(c) for c in args.cases.split(",") if c.strip()]
    shares = _shares(args.read_back_shares)
    cfg = SHAPES[args.shape]
    cuda = torch.device(args.device).type == "cuda"
    pages = max(1 + s * -(-length // 64) for s, _, length, _ in cases)
    runner = ModelRunner(cfg, RandomWeights(), dtype="bf16" if cuda else "fp32", device=args.device,
                         num_pages=pages, page_size=64)
    # Targets too shallow for the DFlash rule's five layers (the smoke-test shape) capture them all.
    capture = {} if cfg.num_layers >= 5 else {"capture_layers": tuple(range(cfg.num_layers))}
    drafter = Drafter(DrafterConfig.for_target(cfg, num_layers=args.layers, **capture)).to(runner.device)
    trainer = Trainer(runner, drafter, lr=6e-4, total_steps=1000, amp=cuda, compile=args.compile)
    rows = []
    for seqs, anchors, length, prompt in cases:
        trainer.anchors = anchors
        batch = _batch(cfg, seqs, length, prompt, runner.device)
        row = time_case(trainer, batch, args.steps)
        timed = [("", row)]
        if args.feature_cache:  # the same batch again, (a share of) its features read back from a cache
            row["read_back"] = []
            for share in shares:
                held = max(1, round(share * seqs))  # the first rows; the rest are captured every step
                sizes = list(zip(batch.keys, batch.lengths.tolist()))[:held]
                places = Places(sizes, sum(n for _, n in sizes))
                trainer.cache = FeatureCache(places, drafter.cfg.capture_layers, cfg.hidden_size, runner.dtype,
                                             runner.device)
                row["read_back"].append({"share": held / seqs, **time_case(trainer, batch, args.steps)})
                timed.append((f" {held}/{seqs} read back", row["read_back"][-1]))
            trainer.cache = None
        rows.append({"sequences": seqs, "anchors": anchors, "length": length, "prompt": prompt, **row})
        for name, r in timed:
            print(f"{seqs:4d} seqs x {anchors:3d} anchors, L {length:5d} / P {prompt:4d}{name}: {r['step_ms']:7.1f} "
                  f"ms/step {r['seq_per_s']:6.0f} seq/s | capture {r['capture_ms']:6.1f}, drafter+loss "
                  f"{r['forward_ms']:6.1f}, backward {r['backward_ms']:6.1f}, optimizer {r['optimizer_ms']:5.1f} ms",
                  flush=True)
    result = {"shape": args.shape, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "draft_layers": args.layers, "compiled": args.compile,
              "feature_cache": args.feature_cache,
              "cases": rows}
    if cuda and not args.no_kernels:
        seqs, anchors, length, prompt = cases[0]
        trainer.anchors = anchors
        result["kernels"] = kernel_table(trainer, _batch(cfg, seqs, length, prompt, runner.device))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {args.out}")
    return 0


def time_case(trainer: Trainer, batch: Batch, steps: int) -> dict[str, float]:
    sync = trainer.synchronize
    for i in range(2):
        trainer.step(batch, i)
    sync()
    t = time.perf_counter()
    for i in range(steps):
        trainer.step(batch, i)
    sync()
    step = (time.perf_counter() - t) / steps
    marks = [time.perf_counter()]

    def mark():
        sync()
        marks.append(time.perf_counter())

    targets = trainer.capture(batch)
    mark()
    loss, _ = trainer.loss(batch, targets, torch.Generator().manual_seed(0))
    mark()
    loss.backward()
    mark()
    trainer.opt.step()
    trainer.opt.zero_grad(set_to_none=True)
    mark()
    ms = [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    return {"step_ms": 1e3 * step, "seq_per_s": batch.size / step, "capture_ms": ms[0], "forward_ms": ms[1],
            "backward_ms": ms[2], "optimizer_ms": ms[3]}


def kernel_table(trainer: Trainer, batch: Batch, top: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.step(batch, 0)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    print(f"one step: {len(kernels)} kernels, GPU busy {busy:.1f} ms")
    return {"kernels_per_step": len(kernels), "gpu_busy_ms": busy}


def _case(text: str) -> tuple[int, int, int, int]:
    try:
        seqs, anchors, length, prompt = (int(x) for x in text.strip().split("x"))
    except ValueError:
        raise ValueError(f"--cases {text!r}: want SEQSxANCHORSxLxP, e.g. 32x32x450x150") from None
    if min(seqs, anchors) < 1 or not 0 < prompt < length - 1:
        raise ValueError(f"--cases {text!r}: need SEQS, ANCHORS >= 1 and 0 < P < L - 1")
    return seqs, anchors, length, prompt


def _shares(text: str) -> list[float]:
    try:
        shares = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        shares = []
    if not shares or not all(0 < x <= 1 for x in shares):
        raise ValueError(f"--read-back-shares {text!r}: want shares in (0, 1], e.g. 1,0.875")
    return shares


def _batch(cfg, seqs: int, length: int, prompt: int, device: torch.device) -> Batch:
    """Sequences of slightly different lengths (as a length-sorted batch has), random tokens;
    every other one a sampled answer (T 0.7), whose labels need the target's greedy choices, as
    about half of `dflash train`'s data is."""
    g = np.random.default_rng(0)
    return make_batch([Sequence("chat", i, i % 2, prompt, g.integers(3, cfg.vocab_size, max(prompt + 2, length - (i % 8) * 8))
                                .astype(np.int32), temperature=0.7 * (i % 2)) for i in range(seqs)], device)
