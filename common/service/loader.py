"""Build a runner and tokenizer from command-line style options (shared by CLI and services)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from common.engine.spec_policy import SpecConfig
from common.model.tokenizer import Tokenizer
from common.model.weights import load_weights, resolve_model
from common.runner.layout import check_parallel
from common.runner.model_runner import ModelRunner

# Measurements kept between runs (the step costs the speculation policy weighs).
CACHE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdflash")


@dataclass(frozen=True)
class ModelOptions:
    model: str | None = None  # None = the embedded default
    dtype: str = "fp32"
    device: str = "cpu"
    page_size: int = 64
    kv_pages: int = 512
    enforce_eager: bool = False  # CUDA: decode without CUDA graphs
    tp: int = 1  # tensor-parallel ranks (processes) per pipeline stage
    pp: int = 1  # pipeline stages (prefill instances only)
    ep: int = 1  # expert parallel: the routed experts sharded over each TP group's ranks
    state_slots: int = 64  # models with KDA layers: requests whose recurrent state fits at a time
    shared_kv: bool = False  # transfer buffers in memory a P on this host can open (local transfer)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelOptions":
        # --tp / --pp / --ep exist only on the services (add_parallel_args)
        return cls(args.model, args.dtype, args.device, args.page_size, args.kv_pages, args.no_cuda_graphs,
                   getattr(args, "tp", 1), getattr(args, "pp", 1), getattr(args, "ep", 1), args.state_slots)


def add_model_args(p: argparse.ArgumentParser, kv_pages: int = 512) -> None:
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    p.add_argument("--kv-pages", type=int, default=kv_pages, help="KV pages in the pool")
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: decode eagerly, without CUDA graphs")
    p.add_argument("--state-slots", type=int, default=64,
                   help="models with KDA layers (kimi_linear): requests whose recurrent state and convolution "
                        "windows are held at a time, a budget apart from --kv-pages (SGLang: --max-mamba-cache-size)")


def add_parallel_args(p: argparse.ArgumentParser, pipeline: bool) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor parallel: processes splitting heads and MLP width")
    if pipeline:
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel: processes holding a range of layers each")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel (MoE models): the routed experts sharded over the --tp ranks; must divide "
                        "--tp and the number of experts")


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


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """How the engine speculates (--spec-block), and where it keeps the step costs it measures."""
    if args.spec_block is not None and args.spec_block < 2:
        raise ValueError(f"--spec-block must be at least 2 (the last token and a draft), got {args.spec_block}")
    return SpecConfig(block=args.spec_block, cache_dir=CACHE_DIR)


def load_proposer(args: argparse.Namespace, runner: ModelRunner):
    """The DFlash proposer asked for by --spec/--draft-model, or None."""
    if args.spec == "none":
        return None
    from common.dflash.drafter import Drafter, shipped_drafter_path
    from common.dflash.proposer import DFlashProposer

    path = args.draft_model or shipped_drafter_path(args.model)
    drafter = Drafter.load(path, device=runner.device, dtype=runner.dtype)
    if runner.layout.pp > 1:  # the draft KV is built on the last stage
        from common.parallel.pipeline_proposer import PipelineProposer

        return PipelineProposer(path, drafter, runner, runner.pool.num_pages)
    # With TP only, the drafter runs whole on rank 0 (the driver): it is a few layers, and its
    # inputs (the captured hidden states) are whole on every TP rank after the all-reduce, so
    # splitting it would add all-reduces to a cheap step.
    return DFlashProposer(drafter, runner, runner.pool.num_pages)


def load_model(opts: ModelOptions) -> tuple[ModelRunner, Tokenizer]:
    src = resolve_model(opts.model)
    cfg, tensors = load_weights(src)
    check_parallel(cfg, opts.tp, opts.pp, opts.ep)  # e.g. --ep without the --tp ranks to shard over
    if opts.tp * opts.pp > 1:
        from common.parallel.driver import ParallelRunner

        runner = ParallelRunner(cfg, tensors, tp=opts.tp, pp=opts.pp, ep=opts.ep, dtype=opts.dtype,
                                device=opts.device, num_pages=opts.kv_pages, page_size=opts.page_size,
                                state_slots=opts.state_slots, shared_kv=opts.shared_kv)
    else:
        runner = ModelRunner(cfg, tensors, dtype=opts.dtype, device=opts.device, num_pages=opts.kv_pages,
                             page_size=opts.page_size, enforce_eager=opts.enforce_eager, state_slots=opts.state_slots,
                             shared_kv=opts.shared_kv)
    return runner, Tokenizer(src, cfg.eos_token_ids)
