"""The memory-bandwidth floor of a decode step.

A decode step at small batch reads every weight once, so it cannot beat
    floor = weight bytes read per step / device memory bandwidth,
with the bandwidth measured in the same run (memory_bandwidth: a 1 GiB copy on a GPU, a 1 GiB
matrix-vector product on a CPU).
"""
from __future__ import annotations

import time

import torch


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: all of them, except an untied input embedding
    (a step reads only its batch's rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def memory_bandwidth(device: torch.device | str, repeats: int = 5) -> float:
    """What a decode step's weight reads can reach, in bytes/s, best of `repeats`.
    GPU: read + write traffic of a 1 GiB copy. CPU: read traffic of a 1 GiB fp32
    matrix-vector product, the access pattern of batch-1 decode; a copy there would measure
    read + write traffic, and a buffer that fits in the last-level cache (hundreds of MiB on
    server parts) would measure the cache."""
    device = torch.device(device)
    if device.type == "cuda":
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return 2 * src.numel() / best
    weights = torch.ones(1 << 18, 1 << 10, device=device)  # 1 GiB
    x = torch.ones(1 << 10, device=device)
    torch.mv(weights, x)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mv(weights, x)
        best = min(best, time.perf_counter() - t0)
    return weights.numel() * weights.element_size() / best
