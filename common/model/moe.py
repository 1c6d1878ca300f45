"""DeepSeek-V3 mixture of experts: routed SwiGLU experts chosen per token, plus shared experts
that every token passes through.

Routing ("noaux_tc"): scores = sigmoid(router(x)) in fp32. The choice uses scores + a learnt
correction bias (which balances the load without an auxiliary loss): experts form `num_groups`
groups, a group is rated by the sum of its two best biased scores, only the best `topk_groups`
groups stay eligible, and the top `experts_per_token` eligible experts are chosen. Their weights
are the unbiased scores, renormalised to sum to 1 if norm_topk_prob, times routed_scaling_factor.

Under expert parallelism a rank holds only `moe.held_experts`: it still routes every token over
all experts (the router is whole), computes the pairs routed to its own experts, and returns
that partial sum; the TP all-reduce after the layer adds the other ranks' experts (as SGLang's
all-reduce EP does).

The experts run one of two ways, equal in exact arithmetic; neither reads the host nor has a
shape that depends on the routing, so a CUDA graph captures either:
  grouped  (token, choice) pairs sorted by expert on the device, each expert's rows one group of
           torch._grouped_mm (wherever grouped_mm_supported says it runs: the CPU, bf16 on CUDA)
  dense    every held expert over every token, each product kept only where the token chose
           that expert (where grouped_mm does not run: fp32 on CUDA, odd widths)
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from common.model.config import ModelConfig
from common.model.transformer import MLP

# About the bytes of activations (counted in fp32) of one slice of run_dense's tokens: a long
# prompt runs in several slices rather than in memory that grows with its length.
DENSE_SLICE_BYTES = 256 << 20


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.moe = m
        self.router = nn.Linear(cfg.hidden_size, m.num_experts, bias=False)
        self.register_buffer("correction_bias", torch.zeros(m.num_experts))
        # The held experts in two tensors ([expert, out, in]), gate and up fused as in the dense MLP.
        held = len(m.held_experts)
        self.gate_up = nn.Parameter(torch.empty(held, 2 * m.intermediate_size, cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(held, cfg.hidden_size, m.intermediate_size))
        self.shared_experts = None
        if m.shared_intermediate_size:
            self.shared_experts = MLP(replace(cfg, intermediate_size=m.shared_intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        run = self.run_grouped if self.grouped_ok(x.device, x.dtype) else self.run_dense
        out = run(x, experts, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def grouped_ok(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether run_grouped can run here: torch._grouped_mm works for this device and dtype,
        and every row it reads or writes (hidden and expert widths) is a multiple of 16 bytes."""
        row_bytes = [n * dtype.itemsize for n in (self.down.shape[1], self.down.shape[2])]
        return all(b % 16 == 0 for b in row_bytes) and grouped_mm_supported(device.type, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts [T, k] and their weights [T, k] (fp32)."""
        m, T = self.moe, x.shape[0]
        scores = F.linear(x.float(), self.router.weight.float()).sigmoid()
        choice = scores + self.correction_bias.float()
        if m.topk_groups < m.num_groups:
            per_group = m.num_experts // m.num_groups
            group_score = choice.view(T, m.num_groups, per_group).topk(2, -1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(m.topk_groups, -1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per_group, 1), float("-inf"))
        experts = choice.topk(m.experts_per_token, -1).indices
        weights = scores.gather(1, experts)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * m.routed_scaling_factor

    def run_grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts held here of weight x SwiGLU_expert(x), through
        two grouped matmuls, every shape fixed by x's: all T*k pairs take part. Pairs routed to
        another rank's experts go to a last, dummy group that no matmul covers (grouped_mm leaves
        its rows unwritten) and are zeroed before the sum."""
        k, held = experts.shape[1], self.moe.held_experts
        E = len(held)
        flat = experts.flatten() - held.start  # index into this rank's experts
        mine = (flat >= 0) & (flat < E)
        group = torch.where(mine, flat, E)
        order = group.argsort(stable=True)
        token = order // k
        # Group ends by a one-hot sum (torch.bincount reads its size on the host on CUDA).
        counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device).scatter_add_(
            0, group, torch.ones_like(group, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)[:E]
        gate, up = torch._grouped_mm(x[token], self.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        ys = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)
        ys = ys.float().mul_(weights.flatten()[order, None]).masked_fill_(~mine[order, None], 0)
        # Each product back to its (token, choice) row (order is a permutation), and a token's k
        # products summed in fp32, rounded once, as run_dense sums. Not index_add_ into x: on
        # CUDA it adds in x's dtype by atomics, in whatever order they land, so in bf16 every
        # partial sum rounds and two runs of one step (a CUDA graph's replay and an eager call)
        # differ (a small random model turns one such rounding into logits several percent apart).
        pairs = torch.empty_like(ys).index_copy_(0, order, ys)
        return pairs.view(x.shape[0], k, -1).sum(1).to(x.dtype)

    def run_dense(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """run_grouped's sum with plain batched matmuls: every held expert over every token, each
        (token, expert) product weighted where the token chose that expert and dropped where it
        did not (selected away, not multiplied by 0: an unchosen product that overflows must not
        turn the sum into NaN).

        Why this and not a gather of each pair's expert weights (then bmm over T*k) or a Triton
        grouped GEMM: it is exact (each chosen product is the same matmul row), it runs on any
        device in any dtype, and its memory does not grow with the weights times the pairs (a
        gather at T*k = 512 pairs copies 512 experts). It reads every held expert once, which is
        what a decode batch of more than a few tokens reads anyway; it computes E / k times the
        products needed, which decode steps (bound by weight reads) hardly feel and prefill
        does. It serves where grouped_mm does not run, fp32 on CUDA above all: a dtype for
        checking, not for serving. Tokens go in slices so that activations stay near
        DENSE_SLICE_BYTES whatever the prompt's length."""
        held, (T, H) = self.moe.held_experts, x.shape
        E, I = len(held), self.down.shape[2]
        local = experts - held.start  # index into this rank's experts
        mine = (local >= 0) & (local < E)
        column = torch.where(mine, local, E)  # pairs of other ranks' experts go to a dropped last column
        chosen = torch.zeros(T, E + 1, dtype=torch.bool, device=x.device).scatter_(1, column, mine)[:, :E].T
        w = torch.zeros(T, E + 1, dtype=torch.float32, device=x.device).scatter_(1, column, weights)[:, :E].T
        out = torch.empty_like(x)
        rows = max(1, DENSE_SLICE_BYTES // (E * (3 * I + 2 * H) * 4))
        for s in range(0, T, rows):
            gate, up = torch.matmul(x[s:s + rows], self.gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, t, I]
            ys = torch.matmul(F.silu(gate) * up, self.down.transpose(1, 2))  # [E, t, H]
            keep = chosen[:, s:s + rows, None]
            out[s:s + rows] = torch.where(keep, ys.float() * w[:, s:s + rows, None], 0).sum(0).to(x.dtype)
        return out

    def hf_weights(self, tensors: dict[str, torch.Tensor], src: str) -> dict[str, torch.Tensor]:
        """This module's parameters (names relative to it) from Hugging Face tensors under `src`
        ("model.layers.{i}.mlp.", experts stored one by one as in the released checkpoints); of
        the routed experts only the held ones are read."""
        e = [f"{src}experts.{j}." for j in self.moe.held_experts]
        own = {"router.weight": tensors[src + "gate.weight"],
               "correction_bias": tensors[src + "gate.e_score_correction_bias"],
               "gate_up": torch.stack([torch.cat([tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"]])
                                       for p in e]),
               "down": torch.stack([tensors[p + "down_proj.weight"] for p in e])}
        if self.shared_experts is not None:
            own |= {f"shared_experts.{k}": t for k, t in MLP.hf_weights(tensors, src + "shared_experts.").items()}
        return own


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs, and is right, on this kind of device in this dtype: tried
    once on a tiny problem (2-D activations against 3-D weights with group ends, as run_grouped
    calls it; torch < 2.8 has no such op, and CUDA builds support only some dtypes)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cuda" and dtype != torch.bfloat16:
        # CUDA's grouped GEMM kernels are bf16; other dtypes take a fallback that reads the group
        # ends on the host, which runs but cannot be captured in a CUDA graph (seen on an H200).
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g).to(device_type, dtype)
    w = torch.randn(2, 32, 16, generator=g).to(device_type, dtype)
    ends = torch.tensor([2, 5], dtype=torch.int32, device=device_type)
    try:
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)[:5].float()
    except (RuntimeError, NotImplementedError):
        return False
    want = torch.cat([x[:2] @ w[0].T, x[2:5] @ w[1].T]).float()
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
