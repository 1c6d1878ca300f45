"""Build a runner and tokenizer from command-line style options (shared by CLI and services)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from common.engine.spec_policy import SpecConfig
from common.model.config import ModelConfig
from common.model.tokenizer import Tokenizer
from common.model.source import resolve_model
from common.model.weights import load_weights
from common.parallel.cluster import NODE_TIMEOUT_S, STARTUP_TIMEOUT_S, Nodes, make_nodes, pin_collective_interface
from common.parallel.node_agent import NodeAgent
from common.runner.layout import ParallelConfigError, RankLayout, check_parallel
from common.runner.model_runner import ModelRunner
from common.service.memory import kv_pages_for_fraction
from common.service.spec_args import refine_setting

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
    nodes: Nodes = Nodes()  # the hosts the TP x PP ranks are spread over
    dist_timeout_s: float = STARTUP_TIMEOUT_S  # for every node (and rank) of the instance to join
    mem_fraction: float | None = None  # CUDA: size the KV pool from GPU memory instead of kv_pages
    shared_kv: bool = False  # transfer buffers in memory a P on this host can open (local transfer)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelOptions":
        # --tp / --pp / --ep and the node options exist only on the services (add_parallel_args)
        return cls(args.model, args.dtype, args.device, args.page_size, args.kv_pages, args.no_cuda_graphs,
                   getattr(args, "tp", 1), getattr(args, "pp", 1), getattr(args, "ep", 1), args.state_slots,
                   getattr(args, "nodes", Nodes()), getattr(args, "dist_timeout", STARTUP_TIMEOUT_S),
                   args.mem_fraction)


def add_model_args(p: argparse.ArgumentParser, kv_pages: int = 512) -> None:
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    p.add_argument("--kv-pages", type=int, default=kv_pages, help="KV pages in the pool")
    p.add_argument("--mem-fraction", "--mem-fraction-static", type=_fraction, default=None,
                   help="CUDA: the share of each GPU's memory for the weights and the KV pool, which gets what the "
                        "weights leave (replaces --kv-pages; SGLang's --mem-fraction-static); not on CPU")
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: decode eagerly, without CUDA graphs")
    p.add_argument("--state-slots", type=int, default=64,
                   help="models with KDA layers (kimi_linear): requests whose recurrent state and convolution "
                        "windows are held at a time, a budget apart from --kv-pages (SGLang: --max-mamba-cache-size)")


def _fraction(value: str) -> float:
    f = float(value)
    if not 0 < f < 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1)")
    return f


def add_parallel_args(p: argparse.ArgumentParser, pipeline: bool) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor parallel: processes splitting heads and MLP width")
    if pipeline:
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel: processes holding a range of layers each")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel (MoE models): the routed experts sharded over the --tp ranks; must divide "
                        "--tp and the number of experts")
    p.add_argument("--nnodes", type=int, default=1, help="hosts the instance's TP x PP ranks are spread over, evenly")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's place among them; node 0 serves the instance's gRPC, the others only run ranks")
    p.add_argument("--dist-init-addr", default=None,
                   help="node 0's HOST:PORT: torch.distributed's rendezvous on PORT, the nodes' control link on PORT+1")
    p.add_argument("--dist-timeout", type=float, default=STARTUP_TIMEOUT_S,
                   help="seconds every node and rank has to join, whichever starts first")
    p.add_argument("--node-timeout", type=float, default=NODE_TIMEOUT_S,
                   help="seconds without word from another node of the instance (heartbeats, every sixth of it) "
                        "after which it is lost and the instance re-forms")
    p.add_argument("--host-ip", "--mooncake-host", dest="host_ip", default=None,
                   help="this host's address on the compute network, which its peers reach its Mooncake segments and "
                        "collectives on (default: with --nnodes > 1 the address toward --dist-init-addr, else 127.0.0.1)")


def parse_nodes(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """args.nodes from the node options (add_parallel_args); a bad combination, of them or with
    --mem-fraction, is a usage error."""
    if args.mem_fraction is not None and not args.device.startswith("cuda"):
        p.error(f"--mem-fraction sizes the KV pool from GPU memory; on {args.device} give --kv-pages instead")
    try:
        args.nodes = make_nodes(args.nnodes, args.node_rank, args.dist_init_addr, args.host_ip, args.node_timeout)
    except (ValueError, OSError) as e:
        p.error(str(e))
    return args


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """How the engine speculates (--spec-block, --spec-ahead), and where it keeps the step costs it measures."""
    if args.spec_block is not None and args.spec_block < 2:
        raise ValueError(f"--spec-block must be at least 2 (the last token and a draft), got {args.spec_block}")
    ahead = {"auto": None, "on": True, "off": False}[args.spec_ahead]
    return SpecConfig(block=args.spec_block, cache_dir=CACHE_DIR, ahead=ahead)


def load_proposer(args: argparse.Namespace, runner: ModelRunner):
    """The DFlash proposer asked for by --spec/--draft-model, or None."""
    if args.spec == "none":
        return None
    from common.dflash.drafter import Drafter, draft_dtype, shipped_drafter_path
    from common.dflash.proposer import DFlashProposer

    path = args.draft_model or shipped_drafter_path(args.model)
    drafter = Drafter.load(path, device=runner.device, dtype=draft_dtype(args.draft_dtype, runner.dtype, runner.device))
    # How the drafter drafts, not what it holds: the weights and the draft KV are the same, so a
    # prefill instance (and a pipeline's last stage, which loads the drafter from `path`) need not agree.
    if args.draft_refine is not None:
        drafter.set_refine(refine_setting(args.draft_refine))
    if runner.layout.pp > 1:  # the draft KV is built on the last stage
        from common.parallel.pipeline_proposer import PipelineProposer

        return PipelineProposer(path, drafter, runner, runner.pool.num_pages)
    # With TP only, the drafter runs whole on rank 0 (the driver): it is a few layers, and its
    # inputs (the captured hidden states) are whole on every TP rank after the all-reduce, so
    # splitting it would add all-reduces to a cheap step.
    return DFlashProposer(drafter, runner, runner.pool.num_pages)


def kv_pages(opts: ModelOptions, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> int:
    """--kv-pages, or with --mem-fraction what a GPU's share leaves next to the weights."""
    if opts.mem_fraction is None:
        return opts.kv_pages
    if not opts.device.startswith("cuda"):
        raise ParallelConfigError(f"--mem-fraction sizes the KV pool from GPU memory; on {opts.device} give --kv-pages")
    gpu_bytes = torch.cuda.get_device_properties(torch.device(opts.device)).total_memory
    return kv_pages_for_fraction(opts.mem_fraction, gpu_bytes, cfg, tensors, RankLayout(opts.tp, opts.pp, 0, opts.ep),
                                 opts.dtype, opts.page_size, opts.state_slots)


def start_node(opts: ModelOptions) -> NodeAgent:
    """A node other than node 0 of a multi-node instance: this host's ranks, joined to node 0."""
    cfg, tensors = load_weights(resolve_model(opts.model))
    pages = kv_pages(opts, cfg, tensors)
    pin_collective_interface(opts.nodes)  # before any rank process starts: they inherit it
    return NodeAgent(cfg, tensors, tp=opts.tp, pp=opts.pp, ep=opts.ep, dtype=opts.dtype, device=opts.device,
                     num_pages=pages, page_size=opts.page_size, state_slots=opts.state_slots,
                     nodes=opts.nodes, startup_timeout_s=opts.dist_timeout_s, shared_kv=opts.shared_kv)


def load_model(opts: ModelOptions) -> tuple[ModelRunner, Tokenizer]:
    src = resolve_model(opts.model)
    cfg, tensors = load_weights(src)
    check_parallel(cfg, opts.tp, opts.pp, opts.ep)  # e.g. --ep without the --tp ranks to shard over
    pages = kv_pages(opts, cfg, tensors)
    tokenizer = Tokenizer(src, cfg.eos_token_ids)  # first: a failure here leaves no rank processes behind
    if opts.tp * opts.pp > 1:
        from common.parallel.driver import ParallelRunner

        pin_collective_interface(opts.nodes)  # before any rank process starts: they inherit it
        runner = ParallelRunner(cfg, tensors, tp=opts.tp, pp=opts.pp, ep=opts.ep, dtype=opts.dtype,
                                device=opts.device, num_pages=pages, page_size=opts.page_size,
                                state_slots=opts.state_slots, nodes=opts.nodes, startup_timeout_s=opts.dist_timeout_s,
                                shared_kv=opts.shared_kv)
    else:
        runner = ModelRunner(cfg, tensors, dtype=opts.dtype, device=opts.device, num_pages=pages,
                             page_size=opts.page_size, enforce_eager=opts.enforce_eager, state_slots=opts.state_slots,
                             shared_kv=opts.shared_kv)
    return runner, tokenizer
