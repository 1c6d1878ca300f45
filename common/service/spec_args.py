"""The speculative-decoding flags (--spec, --draft-model, --spec-block): read by the services and
the in-process tools, and passed on by `pdflash up` to its children. Plain argparse, so that
`pdflash up`, which builds no model, does not import torch to parse and forward them."""
from __future__ import annotations

import argparse


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default="none", choices=["none", "dflash"], help="speculative decoding")
    p.add_argument("--draft-model", default=None, help="DFlash drafter folder (default: the shipped drafter for the embedded model)")
    p.add_argument("--spec-block", type=int, default=None,
                   help="speculate at every step with this block (default: choose per step, off or a block up to "
                        "the drafter's, from step costs measured on this device)")


def spec_flags(args: argparse.Namespace) -> list[str]:
    """The speculative options as command-line flags, for child processes."""
    flags = ["--spec", args.spec]
    if args.draft_model:
        flags += ["--draft-model", args.draft_model]
    if args.spec_block:
        flags += ["--spec-block", str(args.spec_block)]
    return flags
