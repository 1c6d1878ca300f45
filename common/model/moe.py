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
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from common.model.config import ModelConfig
from common.model.transformer import MLP, linear


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
        out = self.run_experts(x, experts, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)

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

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts held here of weight x SwiGLU_expert(x). Tokens are
        grouped by expert so that each expert's weights are read once per step, for all its
        tokens. (The group sizes are read on the host, so this step cannot be captured in a CUDA
        graph.)"""
        k, held = experts.shape[1], self.moe.held_experts
        flat = experts.flatten() - held.start  # index into this rank's experts
        if len(held) == self.moe.num_experts:
            order = flat.argsort(stable=True)
        else:  # the (token, choice) pairs routed to the held experts
            mine = ((flat >= 0) & (flat < len(held))).nonzero()[:, 0]
            order = mine[flat[mine].argsort(stable=True)]
        token = order // k
        counts = torch.bincount(flat[order], minlength=len(held)).tolist()
        xs = x[token]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = linear(xs[start:start + n], self.gate_up[e]).chunk(2, dim=-1)
                ys[start:start + n] = linear(F.silu(gate) * up, self.down[e])
                start += n
        ys = (ys.float() * weights.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

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
