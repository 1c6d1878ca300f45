"""The speculative-decoding flags (--spec, --draft-model, --draft-dtype, --spec-block): read by the services and
the in-process tools, and passed on by `pdflash up` to its children. Plain argparse, so that
`pdflash up`, which builds no model, does not import torch to parse and forward them."""
from __future__ import annotations

import argparse


DRAFT_DTYPES = ("auto", "fp32", "bf16")  # what common.dflash.drafter.draft_dtype takes


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default="none", choices=["none", "dflash"], help="speculative decoding")
    p.add_argument("--draft-model", default=None, help="DFlash drafter folder (default: the shipped drafter for the embedded model)")
    p.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPES,
                   help="the drafter's dtype; its precision moves the accept length, never the output (default "
                        "auto: bf16 beside an fp32 target on CUDA and on CPUs with native bf16, else the target's)")
    p.add_argument("--spec-block", type=int, default=None,
                   help="speculate at every step with this block (default: choose per step, off or a block up to "
                        "the drafter's, from step costs measured on this device)")


def spec_flags(args: argparse.Namespace) -> list[str]:
    """The speculative options as command-line flags, for child processes."""
    flags = ["--spec", args.spec]
    if args.draft_model:
        flags += ["--draft-model", args.draft_model]
    if args.draft_dtype != "auto":
        flags += ["--draft-dtype", args.draft_dtype]
    if args.spec_block:
        flags += ["--spec-block", str(args.spec_block)]
    return flags
