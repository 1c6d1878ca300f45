"""Build a runner and tokenizer from command-line style options (shared by CLI and services)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from common.runner import ModelRunner
from common.tokenizer import Tokenizer
from common.weights import load_weights, resolve_model


@dataclass(frozen=True)
class ModelOptions:
    model: str | None = None  # None = the embedded default
    dtype: str = "fp32"
    device: str = "cpu"
    page_size: int = 64
    kv_pages: int = 512

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelOptions":
        return cls(args.model, args.dtype, args.device, args.page_size, args.kv_pages)


def add_model_args(p: argparse.ArgumentParser, kv_pages: int = 512) -> None:
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    p.add_argument("--kv-pages", type=int, default=kv_pages, help="KV pages in the pool")


def load_model(opts: ModelOptions) -> tuple[ModelRunner, Tokenizer]:
    src = resolve_model(opts.model)
    cfg, tensors = load_weights(src)
    runner = ModelRunner(cfg, tensors, dtype=opts.dtype, device=opts.device,
                         num_pages=opts.kv_pages, page_size=opts.page_size)
    return runner, Tokenizer(src, cfg.eos_token_ids)
