"""--mem-fraction: the KV pool sized from GPU memory, as SGLang's --mem-fraction-static.

The weights, the KDA state slots and the KV pool of a rank together take `fraction` of its GPU's
memory; the pool gets what the rest leaves. Every rank of an instance holds the same number of
pages, so the fullest rank (the one whose weights leave the least room) decides. The figure is
computed from the model's shapes and the split, not measured after loading: every node of a
multi-node instance gets the same number without asking the others (the nodes check that they
agree when they join), and what other processes hold on the GPU is not subtracted. The DFlash
drafter and its draft KV (a few layers), on a decoding instance of an fp32 model its bf16 copy of
the LM head (--draft-dtype), and the activations come out of the remaining 1 - fraction, as in
SGLang.
"""
from __future__ import annotations

import torch

from common.model.config import ModelConfig
from common.runner.layout import ParallelConfigError, RankLayout
from common.runner.model_runner import DTYPES
from common.runner.shard import shard_tensors

GIB = 1 << 30


def kv_pages_for_fraction(fraction: float, gpu_bytes: int, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                          layout: RankLayout, dtype: str, page_size: int, state_slots: int) -> int:
    """KV pages per rank when every rank of `layout` has `gpu_bytes` of memory; a
    ParallelConfigError (one line at start-up) if the weights leave no room."""
    item = DTYPES[dtype].itemsize
    shapes = {name: torch.empty(t.shape, device="meta") for name, t in tensors.items()}  # sliced for free
    budget = int(fraction * gpu_bytes)
    pages = []
    for rank in range(layout.world):
        lay = layout.with_rank(rank)
        local = lay.local_config(cfg)
        fixed = sum(t.numel() for t in shard_tensors(shapes, cfg, lay).values()) * item
        if local.kda is not None:  # the recurrent state (fp32) and convolution windows of every slot
            k = local.kda
            fixed += len(k.layers) * (state_slots + 1) * (k.num_heads * k.head_dim ** 2 * 4
                                                         + 3 * k.proj_size * (k.conv_size - 1) * item)
        page = len(local.kv_layers) * cfg.kv_planes * page_size * local.num_kv_heads * cfg.cache_head_dim * item
        if fixed >= budget:
            raise ParallelConfigError(f"--mem-fraction {fraction}: {fraction} x {gpu_bytes / GIB:.1f} GiB leaves no room for "
                             f"KV pages next to rank {rank}'s weights ({fixed / GIB:.1f} GiB); raise it or split the "
                             "model over more GPUs")
        if page:  # a rank without attention layers holds no pages
            pages.append((budget - fixed) // page - 1)  # less the scratch page (ModelRunner)
    if min(pages) < 1:
        raise ParallelConfigError(f"--mem-fraction {fraction}: no room for a KV page of {page_size} tokens next to the weights")
    return min(pages)
