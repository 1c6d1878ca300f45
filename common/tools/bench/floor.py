"""The memory-bandwidth floor of a decode step.

A decode step at small batch reads every weight it uses once, so it cannot beat
    floor = bytes read per step / device memory bandwidth,
with the bandwidth measured in the same run (memory_bandwidth: a 1 GiB copy on a GPU, a 1 GiB
matrix-vector product on a CPU). The bytes: every weight, except that a MoE layer reads only
the routed experts its batch's tokens chose (ChosenExperts counts them in real steps); KDA
layers also read and write each request's recurrent state (the caller adds those bytes).
"""
from __future__ import annotations

import time
from types import TracebackType

import torch

from common.model.moe import MoE


def step_weight_bytes(model: torch.nn.Module, experts_read: float | None = None) -> int:
    """Bytes of weights one decode step reads: all of them, except an untied input embedding
    (a step reads only its batch's rows of it) and, given `experts_read` (distinct routed experts
    one step chooses, summed over the MoE layers), the routed experts nobody chose."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if experts_read is not None and moes:
        held = sum(t.numel() * t.element_size() for m in moes for t in (m.gate_up, m.down))
        one = sum(t[0].numel() * t.element_size() for t in (moes[0].gate_up, moes[0].down))
        total += round(experts_read * one) - held
    return total


class ChosenExperts:
    """Counts, while `active`, the distinct routed experts each MoE layer's forward chooses:
    per_step is their sum over the layers, averaged over the forwards (the experts a step reads).
    A forward hook routes the layer's input again (the same function of the same input, so the
    same choice). Hooks run only in eager forwards: count with CUDA graphs off."""

    def __init__(self, model: torch.nn.Module):
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.active = False
        self.distinct = 0
        self.calls = 0
        self._hooks: list = []

    def __enter__(self) -> "ChosenExperts":
        self._hooks = [m.register_forward_hook(self._count) for m in self.moes]
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        for h in self._hooks:
            h.remove()

    def _count(self, moe: MoE, args: tuple, out: torch.Tensor) -> None:
        if self.active:
            experts, _ = moe.route(args[0])
            self.distinct += experts.unique().numel()
            self.calls += 1

    @property
    def per_step(self) -> float:
        if not self.calls:
            raise RuntimeError("no MoE forward was counted")
        return self.distinct * len(self.moes) / self.calls


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
