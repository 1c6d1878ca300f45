"""Decode-sized matrix products on CUDA: y = x W^T (+ b) for a few rows of x, and the MLP's
SiLU(x Wg^T) * (x Wu^T) in one kernel.

A decode step multiplies each weight by one to eight rows: the product is memory-bound, and at
the small model's shapes cuBLAS's kernels take ~4 us where reading the weight takes under 1 us
(issue 19). Here one Triton kernel reads a block of weight rows once and multiplies it with
every row of x, accumulating in fp32 with plain multiplies and sums (no tl.dot: fp32 inputs get
exact fp32 products, never TF32); the output is rounded once, to x's dtype. With SILU_MUL a
program computes output column j of gate and of up (rows j and I + j of the fused gate/up
weight) and rounds where common.model.fused.silu_mul's plain path rounds.

Which kernel runs is chosen per (rows, N, K, dtype, bias, fused SiLU): PDFLASH_GEMV=cublas keeps
cuBLAS, =triton takes the Triton kernel with its DEFAULT blocks, and =auto (the default) times
cuBLAS (not in fp32: KERNEL_ONLY) and each of the CANDIDATES once, on first use outside CUDA-graph
capture, and keeps the fastest. Inside a capture the kept choice is used: a graph's warm-up run
comes first and fills it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model import fused

MAX_ROWS = 8  # decode batches and verify blocks up to this many rows; more go to cuBLAS
# What `auto` times against cuBLAS, by dtype: in bf16 one row. On the H200 the kernel beat cuBLAS
# at one row (an embedded layer's products 10.2 against 18.4 us in bf16) and lost at eight in bf16
# (23.7 against 18.0), where the per-shape timing still picked it once and a batch-8 step got 16%
# slower. In fp32 cuBLAS has no tensor-core kernel to offer (exact fp32, no TF32): its products of
# 4-16 rows took 4-14 us at the embedded shape, which makes a verify block of 4 cost twice a
# one-row step, so there auto takes the kernel at every row count it takes.
# PDFLASH_GEMV=triton uses it up to MAX_ROWS.
AUTO_ROWS = {torch.float32: MAX_ROWS}
# Where auto does not time cuBLAS at all. In fp32 on the H200, inside CUDA graphs, the kernel's
# best blocks beat cuBLAS at every embedded product of 1, 4 and 8 rows (by 0.9-12.1 us; the
# 4-row o product 3.5 against 10.0 us), except the 8-row LM head (59.2 against 52.1 us). The timing
# alone is noisy at these sizes (5.5-40 us per product), so letting cuBLAS compete lets a chance
# win of it cost several microseconds per layer (docs/PERFORMANCE.md, 2026-12-04 (later still)).
KERNEL_ONLY = (torch.float32,)
MODES = ("auto", "triton", "cublas")


@dataclass(frozen=True)
class Blocks:
    """One launch shape of the Triton kernel."""
    n: int  # output columns per program
    k: int  # reduction step
    warps: int

    def __str__(self) -> str:
        return f"n{self.n}/k{self.k}/w{self.warps}"


DEFAULT = Blocks(2, 1024, 4)
# A program's loads in one step are all in flight at once: k of 1024 or 2048 reads a small
# model's whole row (K 576 or 1536) in one step, a single memory latency; small n keeps enough
# programs for the narrow outputs (576 columns: 288 programs of 2); larger n and a loop over K
# suit the 8B shapes. Each thread loads 8 to 16 consecutive weights of a row per step. Fewer warps
# reduce across fewer of them: on the H200 (fp32, the embedded shapes, in CUDA graphs) one or two
# warps took a 4-row gate/up product from 6.3 to 5.3 us and the 4-row LM head from 55 to 37 us
# (docs/PERFORMANCE.md, 2026-12-04 (later still)).
CANDIDATES = (Blocks(1, 1024, 1), Blocks(1, 1024, 4), Blocks(1, 2048, 8), Blocks(2, 1024, 1), Blocks(2, 1024, 2),
              DEFAULT, Blocks(4, 1024, 2), Blocks(4, 256, 4), Blocks(4, 512, 4), Blocks(8, 256, 4))


def _mode_from_env() -> str:
    mode = os.environ.get("PDFLASH_GEMV", "auto")
    if mode not in MODES:
        raise ValueError(f"PDFLASH_GEMV={mode!r}: expected one of {', '.join(MODES)}")
    return mode


_mode = _mode_from_env()
_chosen: dict[tuple, Blocks | None] = {}  # auto's choice per shape; None is cuBLAS


@contextmanager
def forced(mode: str) -> Iterator[None]:
    """Every product inside the block goes through `mode` (the GPU check compares them)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"gemv mode {mode!r}: expected one of {', '.join(MODES)}")
    before, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = before


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the Triton GEMV where it is chosen."""
    return run(x, weight, bias, False, _choice(x, weight, bias, silu_mul=False))


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fused.silu_mul(F.linear(x, weight)) for the fused gate/up weight [2I, K], through the
    Triton kernel where it is chosen."""
    return run(x, weight, None, True, _choice(x, weight, None, silu_mul=True))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         blocks: Blocks = DEFAULT) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, for M <= MAX_ROWS."""
    return _launch(x, weight, bias, weight.shape[0], blocks, silu_mul=False)


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, blocks: Blocks = DEFAULT) -> torch.Tensor:
    """SiLU(x Wg^T) * (x Wu^T) -> [M, I] for weight = [Wg; Wu] [2I, K] and x [M <= MAX_ROWS, K]."""
    return _launch(x, weight, None, weight.shape[0] // 2, blocks, silu_mul=True)


def timings(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool
            ) -> dict[Blocks | None, float]:
    """Median GPU time in ms of cuBLAS (key None, except in KERNEL_ONLY dtypes) and of each
    candidate, each run after the L2 cache is flushed (as a decode step finds the weights: the
    step reads far more than L2)."""
    from triton.testing import do_bench

    contenders = CANDIDATES if x.dtype in KERNEL_ONLY else (None, *CANDIDATES)
    return {b: do_bench(lambda b=b: run(x, weight, bias, silu_mul, b), warmup=2, rep=10, return_mode="median")
            for b in contenders}


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
        blocks: Blocks | None) -> torch.Tensor:
    """One product, with or without SiLU x up: through cuBLAS (blocks None) or the Triton kernel."""
    if blocks is not None:
        return gemv_silu_mul(x, weight, blocks) if silu_mul else gemv(x, weight, bias, blocks)
    y = F.linear(x, weight, bias)
    return fused.silu_mul(y) if silu_mul else y


def _choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> Blocks | None:
    """The blocks of the Triton kernel that computes this product, or None for cuBLAS."""
    if _mode == "cublas" or not _fits(x, weight, bias):
        return None
    if _mode == "triton":
        return DEFAULT
    if x.shape[0] > AUTO_ROWS.get(x.dtype, 1):
        return None
    key = (silu_mul, x.shape[0], weight.shape[0], weight.shape[1], x.dtype, bias is not None)
    if key not in _chosen:
        if torch.cuda.is_current_stream_capturing():  # never timed (no warm-up ran): nothing can be timed now
            return None
        times = timings(x, weight, bias, silu_mul)
        _chosen[key] = min(times, key=times.__getitem__)
    return _chosen[key]


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Decode rows on CUDA, one dtype, rows contiguous, and no autograd (fused.active)."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1 and (bias is None or bias.stride(0) == 1)
            and fused.active(*(t for t in (x, weight, bias) if t is not None)))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, blocks: Blocks,
            silu_mul: bool) -> torch.Tensor:
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS or weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} (at most {MAX_ROWS} rows) and weight {tuple(weight.shape)} "
                         f"must share K, each row contiguous")
    out = torch.empty(M, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, blocks.n),)](
        x, weight, weight if bias is None else bias, out, n, K, x.stride(0), weight.stride(0), out.stride(0),
        M=M, BLOCK_M=triton.next_power_of_2(M), HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        BLOCK_N=blocks.n, BLOCK_K=blocks.k, num_warps=blocks.warps)
    return out


if fused.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_x, stride_w, stride_out, M: tl.constexpr,
                     BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # One program: output columns [j, j + BLOCK_N) for all M rows. Each block of weight rows is
        # loaded once and each row of x is multiplied with it in turn (a static loop: M <= 8), so
        # the registers held do not grow with M.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        u_rows = w_rows + N * stride_w  # SILU_MUL: the up half, rows N + j
        rows = tl.arange(0, BLOCK_M)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w_ok = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
            if SILU_MUL:
                u = tl.load(u_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
            for m in tl.static_range(M):
                xm = tl.load(x_ptr + m * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                acc += tl.where(rows == m, tl.sum(w * xm, axis=1)[None, :], 0.0)
                if SILU_MUL:
                    acc_up += tl.where(rows == m, tl.sum(u * xm, axis=1)[None, :], 0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        if SILU_MUL:  # rounded where the plain path rounds: gate and up, SiLU's output, the product
            gate = acc.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            acc = act * acc_up.to(dtype).to(tl.float32)
        tl.store(out_ptr + rows * stride_out + cols[None, :], acc.to(dtype), mask=(rows < M) & col_ok[None, :])
