"""The speculative-decoding flags (--spec, --draft-model, --draft-dtype, --draft-refine, --spec-block, --spec-ahead):
read by the services and the in-process tools, and passed on by `pdflash up` to its children. Plain argparse, so that
`pdflash up`, which builds no model, does not import torch to parse and forward them."""
from __future__ import annotations

import argparse


DRAFT_DTYPES = ("auto", "fp32", "bf16")  # what common.dflash.drafter.draft_dtype takes


def refine_setting(text: str) -> dict:
    """PASSES[@THRESHOLD] as the drafter config's refine fields: passes >= 0, a threshold strictly
    between 0 and 1 (absent: the drafter's own threshold)."""
    passes, at, threshold = text.strip().partition("@")
    try:
        out = {"refine_passes": int(passes)} | ({"refine_threshold": float(threshold)} if at else {})
    except ValueError:
        raise ValueError(f"refine setting {text!r}: expected PASSES[@THRESHOLD], e.g. 0 or 2@0.5") from None
    if out["refine_passes"] < 0 or not 0.0 < out.get("refine_threshold", 0.5) < 1.0:
        raise ValueError(f"refine setting {text!r}: PASSES must be at least 0 and THRESHOLD between 0 and 1 (exclusive)")
    return out


def _refine_arg(text: str) -> str:
    try:
        refine_setting(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default="none", choices=["none", "dflash"], help="speculative decoding")
    p.add_argument("--draft-model", default=None, help="DFlash drafter folder (default: the shipped drafter for the embedded model)")
    p.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPES,
                   help="the drafter's dtype; its precision moves the accept length, never the output (default "
                        "auto: bf16 beside an fp32 target on CUDA and on CPUs with native bf16, else the target's)")
    p.add_argument("--draft-refine", type=_refine_arg, default=None, metavar="PASSES[@THRESHOLD]",
                   help="refine passes after the first draft, and the probability from which a draft is kept "
                        "(default: the drafter's own, saved by dflash train --refine; 0 turns them off)")
    p.add_argument("--spec-block", type=int, default=None,
                   help="speculate at every step with this block (default: choose per step, off or a block up to "
                        "the drafter's, from step costs measured on this device)")
    p.add_argument("--spec-ahead", default="auto", choices=["auto", "on", "off"],
                   help="draft each next block at the end of a speculative step of one request and choose its "
                        "length from the drafter's confidence in it (default auto: on where decode steps replay CUDA "
                        "graphs and the block is chosen per step)")


def spec_flags(args: argparse.Namespace) -> list[str]:
    """The speculative options as command-line flags, for child processes."""
    flags = ["--spec", args.spec]
    if args.draft_model:
        flags += ["--draft-model", args.draft_model]
    if args.draft_dtype != "auto":
        flags += ["--draft-dtype", args.draft_dtype]
    if args.draft_refine is not None:
        flags += ["--draft-refine", args.draft_refine]
    if args.spec_block:
        flags += ["--spec-block", str(args.spec_block)]
    if args.spec_ahead != "auto":
        flags += ["--spec-ahead", args.spec_ahead]
    return flags
