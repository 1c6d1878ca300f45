"""The `pdflash` command: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with add_args(parser) and run(args) -> exit code
COMMANDS = {
    "generate": ("common.tools.generate", "generate text in-process (no services)"),
    "up": ("common.tools.up", "start the local stack: prefill, decode and router"),
    "dflash": ("common.tools.drafter.cli", "DFlash drafter: train, eval, profile, average"),
    "gpu-check": ("common.tools.gpu.command", "on a GPU machine: the CUDA path checked against CPU and eager, then timed"),
}
BENCHES = {
    "engine": ("common.tools.bench.engine", "prefill/decode tok/s of our runner vs transformers"),
    "transfer": ("common.tools.bench.transfer", "Mooncake KV transfer GB/s vs plain loopback TCP"),
    "serving": ("common.tools.bench.serving", "streaming TTFT/TPOT/ITL/E2E and tok/s of a running stack, every replica warmed"),
    "gsm8k": ("common.tools.bench.gsm8k", "few-shot GSM8K: accuracy, tok/s, both accept lengths, histogram invariants"),
    "ab": ("common.tools.bench.ab", "serving or gsm8k against several stacks it starts itself, compared"),
    "dflash": ("common.tools.bench.dflash", "DFlash accept length and speedup over plain decoding, in-process"),
    "soak": ("common.tools.bench.soak", "hold a running stack under mixed load with aborts; failures by cause, latencies, RSS, pools whole at the end"),
}


def _add(sub, name: str, module: str, help_: str) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    mod = importlib.import_module(module)
    mod.add_args(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdflash", description="disaggregated LLM serving with DFlash")
    sub = parser.add_subparsers(dest="command", required=True)
    # Import only the module of the command asked for: each pulls in torch, grpc, ...
    wanted = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        if wanted in (None, name, "-h", "--help"):
            _add(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    bench = sub.add_parser("bench", help="benchmarks that print and save numbers")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_) in BENCHES.items():
        if wanted == "bench" and (len(argv) < 2 or argv[1] in (name, "-h", "--help")):
            _add(bsub, name, module, help_)
        else:
            bsub.add_parser(name, help=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args._run(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, no traceback
        print(f"pdflash {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
