"""Tensor-core products for a few rows of bf16 or fp16 on CUDA: y = x W^T (+ b) for x of 1 to
MAX_ROWS rows, and SiLU(x Wg^T) * (x Wu^T) for the fused gate/up weight [Wg; Wu].

At 8 to 32 rows a decode product is still bound by reading W, but multiplying each weight with
every row by plain multiplies and sums (gemv.py) runs out of arithmetic: here tl.dot does it on
the tensor cores, accumulating in fp32, and the output is rounded once, to x's dtype. fp32 inputs
are refused: their tensor-core products would be TF32, and fp32 results must stay exact to
reduction order (gemv.py keeps them on its own kernel or cuBLAS).

A program computes BLOCK_N output columns for all rows: it streams its W rows [BLOCK_N, K] once,
BLOCK_K at a time through a software pipeline (num_stages loads in flight), and multiplies them
with x^T, padded to BLOCK_M = 16, 32 or 64 rows, so W's rows are the product's M side and
Hopper's wgmma can take them (its M side is 64 per warp group; x's few rows fit its N side).
Outputs with few columns (a 4096-wide down projection, the small model's 576) give too few
programs to keep every SM reading, so Tiles.split > 1 cuts K into that many ranges: each writes
fp32 partial sums, and a second kernel adds them in a fixed order (the same bits every run),
adds the bias and rounds. With SiLU x up a program computes columns j of gate and of up (rows j
and I + j of the weight) and rounds where common.model.fused.silu_mul's plain path rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model import fused

MAX_ROWS = 64
DTYPES = (torch.bfloat16, torch.float16)
REDUCE_BLOCK = 512  # output columns per program of the split-K sum


@dataclass(frozen=True)
class Tiles:
    """One launch shape of the tensor-core kernel."""
    n: int  # output columns per program (BLOCK_N)
    k: int  # reduction step (BLOCK_K)
    split: int  # K ranges per column block (1: no second pass); fewer where K has fewer steps
    warps: int
    stages: int  # software-pipeline depth

    def __str__(self) -> str:
        return f"mma n{self.n}/k{self.k}/s{self.split}/w{self.warps}/p{self.stages}"


DEFAULT = Tiles(64, 128, 1, 4, 3)
# Shared memory per stage is (n (2n with SiLU) + BLOCK_M) * k * 2 bytes: every shape here fits a
# Hopper SM's 227 KB at 32 rows with SiLU (n64/k128/p4 needs 160 KB), DEFAULT also at 64 rows.
# On the H200 (132 SMs): n64 gives the 8B qkv 96 programs and gate/up 224, n128 the LM heads
# 384-1002; split 2-4 gives the 4096-wide o and down projections 128-256, and n32 with split 4-8
# the small model's 576-wide ones 72-144.
CANDIDATES = (DEFAULT, Tiles(64, 128, 1, 4, 4), Tiles(32, 128, 1, 4, 4), Tiles(128, 64, 1, 8, 4),
              Tiles(32, 256, 1, 4, 3), Tiles(64, 128, 2, 4, 4), Tiles(64, 128, 4, 4, 4), Tiles(32, 64, 8, 4, 4))


def mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: Tiles = DEFAULT
       ) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, bf16 or fp16, M <= MAX_ROWS."""
    return _launch(x, weight, bias, weight.shape[0], tiles, silu_mul=False)


def mm_silu_mul(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles = DEFAULT) -> torch.Tensor:
    """SiLU(x Wg^T) * (x Wu^T) -> [M, I] for weight = [Wg; Wu] [2I, K], bf16 or fp16."""
    return _launch(x, weight, None, weight.shape[0] // 2, tiles, silu_mul=True)


def block_m(rows: int) -> int:
    """x's rows padded to a tile: tl.dot needs at least 16."""
    return max(16, triton.next_power_of_2(rows))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, tiles: Tiles,
            silu_mul: bool) -> torch.Tensor:
    M, K = x.shape
    if x.dtype not in DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"mma: bf16 or fp16 only, one dtype (x {x.dtype}, weight {weight.dtype}); "
                         f"fp32 would run as TF32")
    if not 1 <= M <= MAX_ROWS or weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1 or (
            bias is not None and bias.stride(0) != 1):
        raise ValueError(f"mma: x {tuple(x.shape)} (at most {MAX_ROWS} rows) and weight {tuple(weight.shape)} "
                         f"must share K, each row contiguous")
    steps = triton.cdiv(K, tiles.k)
    per_split = triton.cdiv(steps, tiles.split)
    split = triton.cdiv(steps, per_split)  # no empty K range
    width = 2 * n if silu_mul else n  # partial sums: gate then up
    out = torch.empty(M, n, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, M, width, dtype=torch.float32, device=x.device)
    b = weight if bias is None else bias
    _mma_kernel[(triton.cdiv(n, tiles.n), split)](
        x, weight, b, out, part, M, n, K, x.stride(0), weight.stride(0), out.stride(0), per_split * tiles.k,
        BLOCK_M=block_m(M), BLOCK_N=tiles.n, BLOCK_K=tiles.k, SPLIT=split, HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, num_warps=tiles.warps, num_stages=tiles.stages)
    if split > 1:
        _split_sum_kernel[(M, triton.cdiv(n, REDUCE_BLOCK))](
            part, b, out, M, n, out.stride(0), SPLIT=split, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
            BLOCK=REDUCE_BLOCK)
    return out


if fused.HAS_TRITON:
    import triton
    import triton.language as tl

    from common.model.fused import silu_mul_rounded

    @triton.jit
    def _mma_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_x, stride_w, stride_out, k_per_split,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
        # Program (j, s): output columns [j * BLOCK_N, +BLOCK_N) over K range s, for all rows.
        # The accumulator is the output transposed, [columns, rows]: W's tile is the dot's left.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        col_ok = cols < N
        row_ok = rows < M
        k_lo = tl.program_id(1) * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        steps = tl.arange(0, BLOCK_K)
        w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_w + (k_lo + steps)[None, :]
        u_tile = w_ptr + (cols + N).to(tl.int64)[:, None] * stride_w + (k_lo + steps)[None, :]  # SILU_MUL: rows N + j
        x_tile = x_ptr + rows[:, None] * stride_x + (k_lo + steps)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k + steps < K)[None, :]
            xt = tl.trans(tl.load(x_tile, mask=row_ok[:, None] & k_ok, other=0.0))
            acc = tl.dot(tl.load(w_tile, mask=col_ok[:, None] & k_ok, other=0.0), xt, acc)
            if SILU_MUL:
                acc_up = tl.dot(tl.load(u_tile, mask=col_ok[:, None] & k_ok, other=0.0), xt, acc_up)
            w_tile += BLOCK_K
            u_tile += BLOCK_K
            x_tile += BLOCK_K
        ok = col_ok[:, None] & row_ok[None, :]
        if SPLIT > 1:  # fp32 partial sums [split, M, N] (up after gate: 2N wide) for _split_sum_kernel
            width = N
            if SILU_MUL:
                width = 2 * N
            part = part_ptr + (tl.program_id(1) * M + rows[None, :]) * width + cols[:, None]
            tl.store(part, acc, mask=ok)
            if SILU_MUL:
                tl.store(part + N, acc_up, mask=ok)
        else:
            dtype = out_ptr.dtype.element_ty
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            if SILU_MUL:
                y = silu_mul_rounded(acc, acc_up, dtype)
            else:
                y = acc.to(dtype)
            tl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], y, mask=ok)

    @triton.jit
    def _split_sum_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_out, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SILU_MUL: tl.constexpr, BLOCK: tl.constexpr):
        # Program (row, j): the SPLIT partial sums of row `row`, columns [j * BLOCK, +BLOCK), added
        # in order s = 0, 1, ... (deterministic), then the bias and the rounding of _mma_kernel.
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        width = N
        if SILU_MUL:
            width = 2 * N
        acc = tl.zeros((BLOCK,), tl.float32)
        acc_up = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(SPLIT):
            part = part_ptr + (s * M + row) * width + cols
            acc += tl.load(part, mask=ok, other=0.0)
            if SILU_MUL:
                acc_up += tl.load(part + N, mask=ok, other=0.0)
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if SILU_MUL:
            y = silu_mul_rounded(acc, acc_up, dtype)
        else:
            y = acc.to(dtype)
        tl.store(out_ptr + row * stride_out + cols, y, mask=ok)
