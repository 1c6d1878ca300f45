"""Decode-sized matrix products on CUDA: y = x W^T (+ b) for a few rows of x, and the MLP's
SiLU(x Wg^T) * (x Wu^T) in one kernel.

A decode step multiplies each weight by one to sixteen rows: the product is memory-bound, and at
the small model's shapes cuBLAS's kernels take ~4 us where reading the weight takes under 1 us
(issue 19). Here one Triton kernel reads a block of weight rows once and multiplies it with
every row of x, accumulating in fp32; the output is rounded once, to x's dtype. The products are
plain multiplies and sums (exact in fp32, never TF32), or tl.dot on tensor cores: "mma" for bf16
and fp16 inputs (their products are exact in fp32), "tf32x3" for fp32 (three TF32 products per
pair, a*b as aH*bH + aH*bL + aL*bH, each within about 2^-20 of a*b: over a K-term sum the same
order of error as merely reordering the fp32 sum, and within 1e-6 of cuBLAS on the H200's
shapes). With SILU_MUL a program computes output column j of gate and of up (rows j and I + j of
the fused gate/up weight) and rounds where common.model.fused.silu_mul's plain path rounds.

With a span, tl.dot blocks also cut K across programs (split-K): a column block of a small
product (N 576, K 1536) is otherwise one program's serial walk over K, and a few dozen programs
leave most of the GPU idle. Each program writes its partial product to a workspace, and the last
of a column block's programs to arrive (a counter per column block, an atomic increment) sums
all the partials in one fixed order and finishes the product: the result does not depend on
which program came last. The counters live per device, zero between products, reset by that
last program; products run in stream order on a device (as a decode step runs them), and a
split product is first run outside CUDA-graph capture, which creates them.

Which kernel runs is chosen per (rows, N, K, dtype, bias, fused SiLU): PDFLASH_GEMV=cublas keeps
cuBLAS, =triton takes the Triton kernel with its DEFAULT blocks, and =auto (the default) times
cuBLAS and each of the CANDIDATES inside a CUDA graph (timings) on first use outside CUDA-graph
capture, and keeps the fastest: in this process, and on disk for the next ones (gemv_cache).
Inside a capture, a choice kept in this process or on disk is used, else cuBLAS; a graph's
warm-up run comes first and times what it needs. So inside kept_only(), where an eager step
while serving would otherwise stop for the seconds a new shape's timing takes.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model import cuda_timing, fused, gemv_cache
from common.model.cuda_timing import us_per_op

logger = logging.getLogger(__name__)

# Products of up to this many rows are timed against cuBLAS (auto) or go through the kernel
# (triton); more go to cuBLAS. A verify block of 16 at batch 1 is 16 rows for the target and 15 for
# the drafter's LM head: in fp32 on the H200 a step with a block of 16, its products past 8 rows
# on cuBLAS, took 3.2 ms, against 1.7 for a block of 8 (docs/PERFORMANCE.md, 2026-12-04 (night)).
MAX_ROWS = 16
MODES = ("auto", "triton", "cublas")
# auto's timing: products per CUDA graph, and weight copies enough to stream this many times the
# L2 cache (a decode step reads far more than L2 holds, so no product finds its weight there).
GRAPH_PRODUCTS = 50
STREAM_L2S = 4
MAX_COPIES = 256
REPLAYS = 5


DOTS = ("", "mma", "tf32x3")
DOT_MIN = 16  # tl.dot's smallest tile side; rows are padded to it
MAX_SPLITS = 32


@dataclass(frozen=True)
class Blocks:
    """One launch shape of the Triton kernel."""
    n: int  # output columns per program
    k: int  # reduction step
    warps: int
    # How the rows of x meet a block of weights: one row at a time, each reduced over K on its
    # own (False), or all rows loaded at once as a tile and reduced together (True): one
    # exchange between threads per step instead of one per row, for more registers.
    tile: bool = False
    # tl.dot on [16, k] x [k, n] tiles (DOTS; "" is none): at 8 to 16 rows the multiplies
    # outgrow one row's; in fp32 the shapes above cost 2-3x a row's time at 16 rows.
    dot: str = ""
    # Reduction steps per program (dot only): 0 walks all of K in one program; n > 0 cuts K into
    # ranges of n * k, one program each, summed by the last to finish (split-K).
    span: int = 0

    def __post_init__(self) -> None:
        if self.dot not in DOTS or (self.dot and (self.tile or self.n < DOT_MIN or self.k < DOT_MIN)):
            raise ValueError(f"gemv blocks {self}: dot is one of {DOTS}, without tile, n and k >= {DOT_MIN}")
        if self.span < 0 or (self.span and not self.dot):
            raise ValueError(f"gemv blocks {self}: a span is a positive number of steps, for dot blocks only")

    def __str__(self) -> str:
        return f"n{self.n}/k{self.k}/w{self.warps}" + ("/tile" if self.tile else "") + \
            (f"/{self.dot}" if self.dot else "") + (f"/s{self.span}" if self.span else "")

    def split_span(self, k: int) -> int:
        """The reduction length one program takes of a reduction of length k: span steps, or more
        where k would take more than MAX_SPLITS programs (the last sums that many partials at once)."""
        steps = -(-k // self.k)
        return (max(self.span, -(-steps // MAX_SPLITS)) if self.span else steps) * self.k

    def splits(self, k: int) -> int:
        """Programs along a reduction of length k."""
        return -(-k // self.split_span(k))

    def runs(self, dtype: torch.dtype) -> bool:
        """Whether these blocks take inputs of this dtype: tf32x3 fp32 only, mma bf16 and fp16 only."""
        if self.dot == "tf32x3":
            return dtype == torch.float32
        return self.dot != "mma" or dtype in (torch.bfloat16, torch.float16)


DEFAULT = Blocks(2, 1024, 4)
# A program's loads in one step are all in flight at once: k of 1024 or 2048 reads a small
# model's whole row (K 576 or 1536) in one step, a single memory latency; small n keeps enough
# programs for the narrow outputs (576 columns: 288 programs of 2); larger n and a loop over K
# suit the 8B shapes. Each thread loads 8 to 16 consecutive weights of a row per step. Fewer warps
# reduce across fewer of them: on the H200 (fp32, the embedded shapes, in CUDA graphs) one or two
# warps took a 4-row gate/up product from 6.3 to 5.3 us and the 4-row LM head from 55 to 37 us
# (docs/PERFORMANCE.md, 2026-12-04 (later still)).
# The tile shapes are for verify blocks of several rows, where a row at a time cost ~1.3-1.6 us
# more per product than one row (docs/PERFORMANCE.md, 2026-12-04, the pooled drafter).
# The dot shapes pay where the rows are many or the weight large. On the H200 (docs/PERFORMANCE.md,
# 2026-12-04 (second evening)): tf32x3 took the fp32 LM head at 16 rows from 64 us (cuBLAS) to 32,
# as fast as one row, and a layer's small products at 16 rows from 39.6 to 36.5; mma beat cuBLAS by
# a little for bf16 from 8 rows and on the one-row LM head. tl.dot on fp32 in full precision (FMA
# units) lost everywhere, 13-135 us.
# The split (span) dot shapes are for 4 to 16 rows at the layers' shapes, where the dot shapes
# without a span took 7-17 us in fp32 whatever the rows, one program walking all of K per column
# block (36 programs for 576 columns).
CANDIDATES = (Blocks(1, 1024, 1), Blocks(1, 1024, 4), Blocks(1, 2048, 8), Blocks(2, 1024, 1), Blocks(2, 1024, 2),
              DEFAULT, Blocks(4, 1024, 2), Blocks(4, 256, 4), Blocks(4, 512, 4), Blocks(8, 256, 4),
              Blocks(1, 1024, 4, tile=True), Blocks(1, 2048, 8, tile=True), Blocks(2, 512, 4, tile=True),
              Blocks(4, 256, 4, tile=True),
              *(Blocks(n, k, 4, dot=dot) for dot in DOTS[1:] for n, k in ((16, 64), (16, 256), (32, 128), (64, 64))),
              *(Blocks(n, k, w, dot=dot, span=span) for dot in DOTS[1:]
                for n, k, w, span in ((16, 64, 4, 1), (16, 64, 2, 1), (16, 64, 4, 2), (16, 128, 4, 1), (32, 64, 4, 1))))


def _mode_from_env() -> str:
    mode = os.environ.get("PDFLASH_GEMV", "auto")
    if mode not in MODES:
        raise ValueError(f"PDFLASH_GEMV={mode!r}: expected one of {', '.join(MODES)}")
    return mode


_mode = _mode_from_env()
_chosen: dict[tuple, Blocks | None] = {}  # auto's choice per shape; None is cuBLAS
_timing = True  # whether auto may time a shape now (not inside kept_only())


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


@contextmanager
def kept_only() -> Iterator[None]:
    """Inside the block auto times nothing: a product takes a choice kept in this process or on
    disk, else cuBLAS, and none is kept for it. For eager steps while serving: the logits of a
    prefill step are one row per prompt it finishes, any number of them, and timing a row count
    that no graph's warm-up met (a few seconds of compiles and timed graphs) is the likeliest
    cause of the stalls in benchmarks' first rounds at concurrency 8 on fresh GPU machines."""
    global _timing
    before, _timing = _timing, False
    try:
        yield
    finally:
        _timing = before


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
    """Microseconds per product of cuBLAS (key None) and of each candidate, as a decode step runs
    them: inside a CUDA graph, one product after another, each reading another copy of the weight
    so that together they stream past the L2 cache. Timed alone instead, a product's fixed launch
    cost (several microseconds, and noisy) dwarfs the differences between block shapes, and the
    choice is close to chance: it picked cuBLAS at shapes where, inside graphs, the kernel is
    faster and the other way round, costing several microseconds per layer (docs/PERFORMANCE.md,
    2026-12-04 (later still))."""
    nbytes = weight.numel() * weight.element_size()
    l2 = torch.cuda.get_device_properties(x.device).L2_cache_size
    free = torch.cuda.mem_get_info(x.device)[0]
    # At most a quarter of the free memory: with less, fewer copies, and the weights partly in L2.
    copies = min(MAX_COPIES, -(-STREAM_L2S * l2 // nbytes), 1 + free // (4 * nbytes))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    n = max(GRAPH_PRODUCTS, copies)

    def products(blocks: Blocks | None) -> Callable[[], None]:
        return lambda: [run(x, weights[i % copies], bias, silu_mul, blocks) for i in range(n)]

    probe = torch.randn(x.shape, generator=torch.Generator(x.device).manual_seed(0), device=x.device).to(x.dtype)
    times = {}
    for blocks in (None, *(b for b in CANDIDATES if b.runs(x.dtype))):
        if blocks is not None:
            # Built, launched and checked against cuBLAS once first: a shape this GPU cannot build
            # or fit, or whose products are wrong here, is left out.
            try:
                err = error(probe, weight, bias, silu_mul, blocks)
            except Exception as e:  # Triton's compile, ptxas and resource errors share no base class
                logger.warning("gemv: %s cannot run %s rows x %s here (%s); left out", blocks, x.shape[0],
                               tuple(weight.shape), e)
                continue
            if not err <= tolerance(x.dtype):
                logger.warning("gemv: %s is %.1e from cuBLAS at %s rows x %s (at most %.0e); left out", blocks, err,
                               x.shape[0], tuple(weight.shape), tolerance(x.dtype))
                continue
        times[blocks] = us_per_op(products(blocks), n, replays=REPLAYS)
    return times


def tolerance(dtype: torch.dtype) -> float:
    """How far a product may be from cuBLAS's, relative to its largest output: fp32 to the order
    of the sum, 16-bit dtypes to one rounding step (2^-7)."""
    return 1e-5 if dtype == torch.float32 else 2.0 ** -7


def error(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
          blocks: Blocks) -> float:
    """max |kernel - cuBLAS| / max |cuBLAS| for one product (0 where both are all zeros)."""
    ref = run(x, weight, bias, silu_mul, None).float()
    diff = (run(x, weight, bias, silu_mul, blocks).float() - ref).abs().max()
    return (diff / ref.abs().max().clamp(min=torch.finfo(torch.float32).tiny)).item()


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
    key = (silu_mul, x.shape[0], weight.shape[0], weight.shape[1], x.dtype, bias is not None)
    if key not in _chosen:
        path, name = _kept_path(x.device.index), gemv_cache.key_name(*key)
        kept = _kept_choices(path).get(name)
        # A kept name this code no longer offers, or blocks that cannot take this dtype: timed again.
        capturing = torch.cuda.is_current_stream_capturing()
        if kept in _BY_NAME and (_BY_NAME[kept] is None or _BY_NAME[kept].runs(x.dtype)):
            blocks = _BY_NAME[kept]
            if capturing and blocks is not None and blocks.splits(weight.shape[1]) > 1 and x.device not in _counters:
                return None  # its counters cannot be made inside a capture
            _chosen[key] = blocks
        elif capturing or not _timing:  # never timed, and nothing may be timed now
            return None
        else:
            _chosen[key] = _timed_choice(x, weight, bias, silu_mul, path, name)
    return _chosen[key]


def choices() -> dict[str, str]:
    """What auto took in this process, per product (named as in the kept file): 'cublas' or the
    block shape. Benchmarks record it, so that a run says which kernels its timings are of."""
    return dict(sorted((gemv_cache.key_name(*key), blocks_name(blocks)) for key, blocks in _chosen.items()))


def _timed_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, path: str,
                  name: str) -> Blocks | None:
    try:
        times = timings(x, weight, bias, silu_mul)
    except RuntimeError as e:  # e.g. no memory left for the weight copies: cuBLAS in this process, nothing kept
        logger.warning("gemv: timing %s failed (%s); it runs on cuBLAS", name, e)
        return None
    best = min(times, key=times.__getitem__)
    gemv_cache.keep(path, name, blocks_name(best))
    return best


def blocks_name(blocks: Blocks | None) -> str:
    """How a choice is named in the kept file and in reports: 'cublas' or the block shape (_BY_NAME's inverse)."""
    return "cublas" if blocks is None else str(blocks)


_BY_NAME: dict[str, Blocks | None] = {"cublas": None} | {str(b): b for b in CANDIDATES}
_kept: dict[str, dict[str, str]] = {}  # path -> the choices read from it, once per process


@functools.cache
def _kept_path(device_index: int | None) -> str:
    """The file of this GPU and of the code that computes and times the products."""
    code = b""
    for module in (sys.modules[__name__], fused, cuda_timing):
        with open(module.__file__, "rb") as f:
            code += f.read()
    versions = f"torch{torch.__version__}-triton{triton.__version__}"
    return gemv_cache.path_for(torch.cuda.get_device_name(device_index), versions, code)


def _kept_choices(path: str) -> dict[str, str]:
    if path not in _kept:
        _kept[path] = gemv_cache.load(path)
    return _kept[path]


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
    if not blocks.runs(x.dtype) or weight.dtype != x.dtype:
        raise ValueError(f"gemv blocks {blocks}: x {x.dtype} and weight {weight.dtype} must share a dtype these "
                         f"blocks take")
    out = torch.empty(M, n, dtype=x.dtype, device=x.device)
    block_m = max(DOT_MIN, triton.next_power_of_2(M)) if blocks.dot else triton.next_power_of_2(M)
    columns, splits = triton.cdiv(n, blocks.n), blocks.splits(K)
    if splits > 1:  # partial products of the M rows, gate's and up's apart with SILU_MUL
        work = torch.empty(splits * (2 if silu_mul else 1) * M * n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device, columns)
    else:
        work = counters = out
    _gemv_kernel[(columns, splits)](
        x, weight, weight if bias is None else bias, out, work, counters, n, K, x.stride(0), weight.stride(0),
        out.stride(0), blocks.split_span(K), splits, M=M, BLOCK_M=block_m,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_N=blocks.n, BLOCK_K=blocks.k, TILE=blocks.tile,
        DOT=bool(blocks.dot), PRECISION="tf32x3" if blocks.dot == "tf32x3" else "tf32", SPLIT=splits > 1,
        SPLITS_POW2=triton.next_power_of_2(splits), num_warps=blocks.warps)
    return out


COUNTERS = 1 << 16  # column blocks a split product may have: N up to a million at 16 columns a block
_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, columns: int) -> torch.Tensor:
    """The device's arrival counters of split products, zero between products."""
    if columns > COUNTERS:
        raise ValueError(f"gemv: {columns} column blocks, more than the {COUNTERS} split counters")
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv: a split product's first run must come before CUDA-graph capture (its "
                               "counters are made then)")
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def split_counters_at_zero(device: torch.device) -> bool:
    """Whether every split product on this device left its arrival counters at zero, as the next
    one needs them (true where no split product ran)."""
    return device not in _counters or not _counters[device].any().item()


if fused.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, work_ptr, count_ptr, N, K, stride_x, stride_w, stride_out,
                     SPAN, SPLITS, M: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr,
                     DOT: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                     SPLITS_POW2: tl.constexpr):
        # One program: output columns [j, j + BLOCK_N) for all M rows, over the K range [s SPAN,
        # (s + 1) SPAN) (s = 0 and SPAN = K without SPLIT). Each block of weight rows is loaded
        # once. With DOT the rows of x, as loaded, meet it in tl.dot; without TILE each row of x is
        # multiplied with it in turn (a static loop: M <= MAX_ROWS), so the registers held do not
        # grow with M; with TILE every row is loaded at once and the [BLOCK_M, BLOCK_N, BLOCK_K]
        # products are summed over K in one reduction.
        column = tl.program_id(0)
        part = tl.program_id(1)
        cols = column * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        u_rows = w_rows + N * stride_w  # SILU_MUL: the up half, rows N + j
        rows = tl.arange(0, BLOCK_M)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        k_start = part * SPAN
        for k0 in range(k_start, k_start + SPAN, BLOCK_K):  # past K: masked
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w_ok = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0)
            if SILU_MUL:
                u = tl.load(u_rows + ks[None, :], mask=w_ok, other=0.0)
            if DOT:
                xs = tl.load(x_ptr + rows * stride_x + ks[None, :], mask=(rows < M) & k_ok[None, :], other=0.0)
                acc = tl.dot(xs, tl.trans(w), acc, input_precision=PRECISION)
                if SILU_MUL:
                    acc_up = tl.dot(xs, tl.trans(u), acc_up, input_precision=PRECISION)
            elif TILE:
                xs = tl.load(x_ptr + rows * stride_x + ks[None, :], mask=(rows < M) & k_ok[None, :],
                             other=0.0).to(tl.float32)[:, None, :]
                acc += tl.sum(w.to(tl.float32)[None, :, :] * xs, axis=2)
                if SILU_MUL:
                    acc_up += tl.sum(u.to(tl.float32)[None, :, :] * xs, axis=2)
            else:
                wf = w.to(tl.float32)
                if SILU_MUL:
                    uf = u.to(tl.float32)
                for m in tl.static_range(M):
                    xm = tl.load(x_ptr + m * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                    acc += tl.where(rows == m, tl.sum(wf * xm, axis=1)[None, :], 0.0)
                    if SILU_MUL:
                        acc_up += tl.where(rows == m, tl.sum(uf * xm, axis=1)[None, :], 0.0)
        out_ok = (rows < M) & col_ok[None, :]
        if SPLIT:
            # Partials: [SPLITS, 2 with SILU_MUL else 1, M, N]. All of this program's stores
            # come before its arrival (the barrier, then the release of the one atomic); the last
            # to arrive acquires them all and reads them past L1 (written by other SMs).
            halves: tl.constexpr = 2 if SILU_MUL else 1
            slab = M * N
            mine = work_ptr + rows * N + cols[None, :]
            first = part.to(tl.int64) * halves  # offsets in int64: SPLITS x 2 x M x N passes 2^31 at N of 2^21
            tl.store(mine + first * slab, acc, mask=out_ok)
            if SILU_MUL:
                tl.store(mine + (first + 1) * slab, acc_up, mask=out_ok)
            tl.debug_barrier()
            if tl.atomic_add(count_ptr + column, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                parts = tl.arange(0, SPLITS_POW2).to(tl.int64)[:, None, None]
                parts_ok = (parts < SPLITS) & out_ok[None, :, :]
                acc = tl.sum(tl.load(mine[None, :, :] + parts * halves * slab, mask=parts_ok, other=0.0,
                                     cache_modifier=".cg"), axis=0)
                if SILU_MUL:
                    acc_up = tl.sum(tl.load(mine[None, :, :] + (parts * halves + 1) * slab, mask=parts_ok,
                                            other=0.0, cache_modifier=".cg"), axis=0)
                tl.store(count_ptr + column, 0)
                _finish(acc, acc_up, b_ptr, out_ptr, rows, cols, col_ok, out_ok, stride_out, HAS_BIAS, SILU_MUL)
        else:
            _finish(acc, acc_up, b_ptr, out_ptr, rows, cols, col_ok, out_ok, stride_out, HAS_BIAS, SILU_MUL)

    @triton.jit
    def _finish(acc, acc_up, b_ptr, out_ptr, rows, cols, col_ok, out_ok, stride_out, HAS_BIAS: tl.constexpr,
                SILU_MUL: tl.constexpr):
        """Bias, SiLU x up, rounding and the store of a finished [BLOCK_M, BLOCK_N] product."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        if SILU_MUL:  # rounded where the plain path rounds: gate and up, SiLU's output, the product
            gate = acc.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            acc = act * acc_up.to(dtype).to(tl.float32)
        tl.store(out_ptr + rows * stride_out + cols[None, :], acc.to(dtype), mask=out_ok)
