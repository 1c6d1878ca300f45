"""`pdflash dflash ...`: drafter tooling."""
from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    from common.tools.drafter import average, evaluate, profile, train

    sub = p.add_subparsers(dest="dflash_command", required=True)
    t = sub.add_parser("train", help="self-distil a DFlash drafter for a target model",
                       description="Self-distillation: the target answers prompts, then the drafter learns to predict its blocks.")
    train.add_args(t)
    t.set_defaults(_run=train.run)
    e = sub.add_parser("eval", help="a drafter's accept length on held-out sets, measured with the engine",
                       description=evaluate.__doc__.splitlines()[0])
    evaluate.add_args(e)
    e.set_defaults(_run=evaluate.run)
    f = sub.add_parser("profile", help="where a training step's time goes, on random weights of a target's shape",
                       description=profile.__doc__.splitlines()[0])
    profile.add_args(f)
    f.set_defaults(_run=profile.run)
    a = sub.add_parser("average", help="one drafter from the mean of the weights of drafters of one shape",
                       description=average.__doc__.splitlines()[0])
    average.add_args(a)
    a.set_defaults(_run=average.run)


def run(args: argparse.Namespace) -> int:  # replaced by the subcommand's run via set_defaults
    raise SystemExit("pdflash dflash: choose a subcommand (train, eval, profile, average)")
