"""Cross-entropy of logit rows against a few weighted tokens each, without an fp32 log-softmax.

The drafter's loss (common.tools.drafter.objective.block_loss) scores about 30,000 rows of bf16
logits over a 49,152-token vocabulary per step. F.log_softmax(logits.float()) writes and reads
those rows in fp32 forward and backward (about 6 GB of memory traffic, 15 of a 91 ms step on an
H100). Here a Triton kernel reads the bf16 rows once for each row's logsumexp and argmax, and
another writes the gradient in the logits' dtype straight from them: softmax(x) * g * sum(w),
the label tokens' terms then written over the few columns they touch.

The plain path (the same math on an fp32 copy, through autograd) runs where the kernels cannot:
on the CPU (unless under Triton's interpreter), without Triton, or inside fused.disabled().
"""
from __future__ import annotations

import torch

from common.model import fused

FORWARD_BLOCK = 4096  # logits one step of the forward kernel's loop over a row reads
BACKWARD_BLOCK = 2048  # logits one program of the backward kernel writes


def token_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V], ids [R, T] long, weights [R, T] fp32 -> (ce [R] fp32, argmax [R] long):
    ce[r] = sum_t w[r, t] * -log_softmax(x[r])[ids[r, t]]
          = (sum_t w[r, t]) * logsumexp(x[r]) - sum_t w[r, t] * x[r, ids[r, t]], in fp32,
    and the first index of each row's largest logit (as torch.argmax). Differentiable with
    respect to logits only; their gradient comes in the logits' dtype, rounded once. A token may
    appear more than once in a row: its weights add up. A NaN logit makes its row's ce NaN (the
    kernel's argmax of that row then need not be torch's, which picks the NaN)."""
    if not fused.runs_on(logits):
        x = logits.float()
        ce = weights.sum(-1) * torch.logsumexp(x, -1) - (weights * x.gather(1, ids)).sum(-1)
        return ce, logits.argmax(-1)
    return _TokenCrossEntropy.apply(logits, ids, weights.float())


class _TokenCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.contiguous()  # the kernels take the row stride to be V
        R, V = logits.shape
        lse = torch.empty(R, dtype=torch.float32, device=logits.device)
        top = torch.empty(R, dtype=torch.int64, device=logits.device)
        if R:
            _forward_kernel[(R,)](logits, lse, top, V=V, BLOCK=min(FORWARD_BLOCK, triton.next_power_of_2(V)),
                                  num_warps=8)
        picked = logits.gather(1, ids).float()
        ce = weights.sum(-1) * lse - (weights * picked).sum(-1)
        ctx.save_for_backward(logits, ids, weights, lse, picked)
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, _grad_top: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, ids, weights, lse, picked = ctx.saved_tensors
        R, V = logits.shape
        # grad[r, v] = g[r] * (W[r] * softmax(x[r])[v] - the weight of row r's tokens equal to v),
        # W[r] = sum_t w[r, t]. The kernel writes the first term everywhere; the label columns are
        # then written again, both terms from fp32, rather than the second term added to the
        # rounded first: for a confident label (softmax near 1) they nearly cancel, and a sum of
        # two roundings would lose the difference. A repeated token gets its weights summed, and
        # each copy writes the same value.
        g = grad_ce.float()
        scale = g * weights.sum(-1)
        grad = torch.empty_like(logits)
        if R:
            block = min(BACKWARD_BLOCK, triton.next_power_of_2(V))
            _backward_kernel[(R, triton.cdiv(V, block))](logits, lse, scale, grad, V=V, BLOCK=block)
        same_token_weight = torch.where(ids[:, :, None] == ids[:, None, :], weights[:, None, :], 0.0).sum(-1)
        label = torch.exp(picked - lse[:, None]) * scale[:, None] - g[:, None] * same_token_weight
        grad.scatter_(1, ids, label.to(grad.dtype))
        return grad, None, None


if fused.HAS_TRITON:
    import triton
    import triton.language as tl

    # V and the row stride (V: rows are contiguous) are compile-time constants: the vocabulary
    # is fixed, and the interpreter can pass scalar arguments as arrays, which loop bounds reject.
    @triton.jit
    def _forward_kernel(x_ptr, lse_ptr, top_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row: an online logsumexp (running max m, sum of exp(x - m)) and the
        # first index of the largest value, one block of the row at a time.
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * V  # R * V can pass 2**31
        cols = tl.arange(0, BLOCK)
        m = float("-inf")
        total = 0.0
        best = 0
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            block_max = tl.max(x, 0)
            first = tl.min(tl.where(x == block_max, start + cols, V), 0)
            best = tl.where(block_max > m, first, best)  # ties keep the earlier block's index
            new_m = tl.maximum(m, block_max)
            # While every logit so far is -inf, exp(-inf - -inf) would be NaN: their terms are 0.
            alive = new_m > float("-inf")
            rescale = tl.where(alive, tl.exp(m - new_m), 1.0)
            total = total * rescale + tl.sum(tl.where(alive, tl.exp(x - new_m), 0.0), 0)
            m = new_m
        tl.store(lse_ptr + row, m + tl.log(total))
        tl.store(top_ptr + row, best.to(tl.int64))

    @triton.jit
    def _backward_kernel(x_ptr, lse_ptr, scale_ptr, grad_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
        # softmax(x[r]) * scale[r] over one block of row r, rounded once to the logits' dtype.
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        offset = row.to(tl.int64) * V
        x = tl.load(x_ptr + offset + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.exp(x - tl.load(lse_ptr + row)) * tl.load(scale_ptr + row)
        tl.store(grad_ptr + offset + cols, g.to(grad_ptr.dtype.element_ty), mask=ok)
