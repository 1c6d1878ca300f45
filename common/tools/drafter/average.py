"""`pdflash dflash average`: one drafter from the (weighted) mean of the weights of drafters of one shape.

Drafters that share their start and differ by later steps and data (two continuations of one
training run, say) may draft better averaged than either does alone: measure it with
`pdflash dflash eval` before using one."""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from common.dflash.drafter import Drafter
from common.tools.bench import report
from common.tools.drafter.data import file_sha256
from common.tools.drafter.trainer import save_drafter, weight_config_diff

INFO = "average_info.json"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafters", nargs="+", metavar="DRAFTER", help="drafter folders (config.json + model.safetensors)")
    p.add_argument("--weights", default=None,
                   help="comma-separated, one per drafter, summing to 1 (default: equal weights)")
    p.add_argument("--out", required=True, help="folder for the averaged drafter (not one of the DRAFTERs)")
    p.add_argument("--save-dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="drafter file dtype (auto: fp32 if it fits in 40 MB, else bf16), as dflash train saves")


def run(args: argparse.Namespace) -> int:
    if len(args.drafters) < 2:
        raise ValueError("dflash average needs at least two drafters")
    if os.path.realpath(args.out) in {os.path.realpath(folder) for folder in args.drafters}:
        raise ValueError(f"--out {args.out} is one of the drafters averaged: write the average elsewhere")
    weights = parse_weights(args.weights, len(args.drafters))
    # The sources' hashes before anything is written.
    sources = [{"drafter": folder, "weight": w, "model_sha256": file_sha256(os.path.join(folder, "model.safetensors"))}
               for folder, w in zip(args.drafters, weights)]
    drafter = average([Drafter.load(folder) for folder in args.drafters], weights)
    save_drafter(drafter, args.out, args.save_dtype)
    with open(os.path.join(args.out, INFO), "w") as f:
        json.dump({"sources": sources, "provenance": report.provenance(args)}, f, indent=1)
    print(f"averaged {len(sources)} drafters into {args.out} "
          f"(weights {', '.join(f'{w:g}' for w in weights)})", flush=True)
    return 0


def parse_weights(text: str | None, n: int) -> list[float]:
    """--weights as n finite, non-negative numbers summing to 1; None: equal weights."""
    if text is None:
        return [1.0 / n] * n
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--weights {text!r}: expected comma-separated numbers") from None
    if len(weights) != n or not all(math.isfinite(w) and w >= 0 for w in weights) \
            or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
        raise ValueError(f"--weights {text!r}: expected {n} weights, none negative, summing to 1")
    return weights


def average(drafters: list[Drafter], weights: list[float]) -> Drafter:
    """A drafter with the first one's config and the weighted mean of their weights, summed in fp32.
    The configs must agree except for how they draft (refine settings: the first one's are kept)."""
    first = drafters[0]
    for n, d in enumerate(drafters[1:], 2):
        diff = weight_config_diff(first.cfg, d.cfg)
        if diff:
            raise ValueError(f"drafter {n} differs from the first (first, it): {diff}; only drafters of one "
                             f"shape can be averaged")
    states = [d.state_dict() for d in drafters]
    out = Drafter(first.cfg)
    with torch.no_grad():
        out.load_state_dict({name: sum(w * s[name].float() for w, s in zip(weights, states))
                             for name in states[0]})
    return out.eval()
