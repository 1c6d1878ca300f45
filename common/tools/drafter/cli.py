"""`pdflash dflash ...`: drafter tooling."""
from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    from common.dflash import train

    sub = p.add_subparsers(dest="dflash_command", required=True)
    t = sub.add_parser("train", help="self-distil a DFlash drafter for a target model",
                       description="Self-distillation: the target answers prompts, then the drafter learns to predict its blocks.")
    train.add_args(t)
    t.set_defaults(_run=train.run)


def run(args: argparse.Namespace) -> int:  # replaced by the subcommand's run via set_defaults
    raise SystemExit("pdflash dflash: choose a subcommand (train)")
