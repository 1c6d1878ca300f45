"""Steps 3 and 4 of a speculative decode step (common.engine.decoder) for a block of B: how
many drafts the target accepted, where a stop token ends the block, and how many tokens each
row commits. On CUDA one Triton kernel does what a dozen small PyTorch kernels do, a few
microseconds each on a step that is latency-bound at small batch."""
from __future__ import annotations

import torch

from common.model import fused


def verdict(drafts: torch.Tensor, choices: torch.Tensor, stop_ids: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """drafts [rows, B-1] (d1..d(B-1)), choices [rows, B] (the target's c_0..c_(B-1)), stop_ids
    [rows, W] (padded with -1), left [rows] (tokens each row may still emit) -> int64 [rows, B+2]:
    the choices, then k (the longest prefix with d_(j+1) == c_j), then m = min(k + 1, the first
    stop among c_0..c_k + 1, left), the tokens to commit."""
    if not fused.active(choices):
        return _verdict_torch(drafts, choices, stop_ids, left)
    rows, B = choices.shape
    out = torch.empty(rows, B + 2, dtype=torch.int64, device=choices.device)
    drafts, choices = drafts.contiguous(), choices.contiguous()
    # stop_ids and left are columns of the step's packed inputs: read in place, by their strides.
    if stop_ids.stride(1) != 1:
        stop_ids = stop_ids.contiguous()
    W = stop_ids.shape[1]
    _verdict_kernel[(rows,)](drafts, choices, stop_ids, left, out, B, W, stop_ids.stride(0), left.stride(0),
                             BLOCK_B=triton.next_power_of_2(B), BLOCK_W=triton.next_power_of_2(max(1, W)))
    return out


def _verdict_torch(drafts: torch.Tensor, choices: torch.Tensor, stop_ids: torch.Tensor, left: torch.Tensor
                   ) -> torch.Tensor:
    B = choices.shape[1]
    accepted = (drafts == choices[:, :-1]).long().cumprod(1).sum(1)
    # A stop past c_k cannot bring m below k + 1: the first stop anywhere in the block will do.
    stops = (choices[:, :, None] == stop_ids[:, None, :]).any(-1)
    first_stop = torch.where(stops.any(1), stops.long().argmax(1), B)
    count = torch.minimum(torch.minimum(accepted + 1, first_stop + 1), left)
    return torch.cat([choices, accepted[:, None], count[:, None]], 1)


if fused.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _verdict_kernel(drafts_ptr, choices_ptr, stops_ptr, left_ptr, out_ptr, B, W, stride_stops, stride_left,
                        BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, BLOCK_B)
        c = tl.load(choices_ptr + row * B + j, mask=j < B, other=-2)
        d = tl.load(drafts_ptr + row * (B - 1) + j, mask=j < B - 1, other=-3)
        # k: the first draft position that misses (B - 1 when none does).
        accepted = tl.min(tl.where((j < B - 1) & (d != c), j, B - 1), 0)
        s = tl.arange(0, BLOCK_W)
        stop_ids = tl.load(stops_ptr + row * stride_stops + s, mask=s < W, other=-1)
        is_stop = tl.max((c[:, None] == stop_ids[None, :]).to(tl.int32), 1) > 0
        first_stop = tl.min(tl.where(is_stop & (j < B), j, B), 0)
        count = tl.minimum(tl.minimum(accepted + 1, first_stop + 1), tl.load(left_ptr + row * stride_left))
        tl.store(out_ptr + row * (B + 2) + j, c, mask=j < B)
        tl.store(out_ptr + row * (B + 2) + B, accepted.to(tl.int64))
        tl.store(out_ptr + row * (B + 2) + B + 1, count.to(tl.int64))
