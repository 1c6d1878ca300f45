"""The decode GEMV kernels (common.model.gemv) and the tensor-core kernel for a few rows
(common.model.mma) against F.linear and SiLU(gate) * up: fp32 to reduction order, bf16 and fp16
to one rounding, M = 1..8 rows (gemv) and 1..64 (mma), N and K off the block sizes. On a GPU, or
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 in the environment before the
kernels are defined). Triton 3.8's interpreter gets tl.dot wrong in bf16 (errors of 1e10) and
right in fp16: mma's kernel is checked in fp16 there, and in both on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model import fused, gemv, mma

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = pytest.mark.skipif(
    not fused.HAS_TRITON or (DEVICE == "cpu" and not fused._INTERPRETED),
    reason="triton is not installed" if not fused.HAS_TRITON else
    "no GPU: needs TRITON_INTERPRET=1 set before the kernels are imported")
# N and K off every block size; a block shape of each kind; rows 1..8.
SHAPES = [(1, 37, 45, gemv.DEFAULT), (3, 70, 300, gemv.Blocks(4, 512, 4)), (5, 24, 129, gemv.Blocks(1, 2048, 8)),
          (8, 45, 513, gemv.Blocks(8, 256, 4)), (2, 9, 7, gemv.DEFAULT), (4, 33, 256, gemv.Blocks(4, 256, 4)),
          (6, 17, 64, gemv.Blocks(1, 1024, 4)), (7, 5, 100, gemv.Blocks(8, 256, 4))]


def _inputs(M: int, N: int, K: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((M, K), (N, K), (N,)))
    return x.to(DEVICE, dtype), w.div(K ** 0.5).to(DEVICE, dtype), b.to(DEVICE, dtype)


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x w^T + b in float64 from the same (rounded) inputs."""
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _bf16_ulp(y: torch.Tensor, bits: int = 7) -> torch.Tensor:
    """One bf16 rounding step at |y| (8 significant bits; fp16: bits=10), and at least a tiny
    absolute one."""
    return torch.exp2(torch.floor(torch.log2(y.abs().clamp(min=1e-6)))) * 2.0 ** -bits


@KERNELS_RUN
@pytest.mark.parametrize("M,N,K,blocks", SHAPES)
def test_gemv_matches_linear(M, N, K, blocks):
    for bias in (False, True):
        x, w, b = _inputs(M, N, K, torch.float32)
        b = b if bias else None
        got = gemv.gemv(x, w, b, blocks)
        assert got.dtype == torch.float32 and got.shape == (M, N)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)

        x, w, b = _inputs(M, N, K, torch.bfloat16)
        b = b if bias else None
        got = gemv.gemv(x, w, b, blocks)
        assert got.dtype == torch.bfloat16
        exact = _exact(x, w, b)
        # fp32 sums rounded once: within one bf16 step of the exact product (half a step on the
        # GPU, which rounds to nearest; under Triton's interpreter, which rounds toward zero, a
        # step), plus the fp32 sum's own error, which matters only where terms cancel.
        fp32_sum_err = 1e-5 * _exact(x.abs(), w.abs())
        assert ((got.double() - exact).abs() <= _bf16_ulp(exact) + fp32_sum_err).all()


@KERNELS_RUN
@pytest.mark.parametrize("M,N,K,blocks", SHAPES)
def test_gemv_silu_mul_matches_plain_path(M, N, K, blocks):
    x, w, _ = _inputs(M, 2 * N, K, torch.float32)
    got = gemv.gemv_silu_mul(x, w, blocks)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert got.shape == (M, N)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)

    x, w, _ = _inputs(M, 2 * N, K, torch.bfloat16)
    got = gemv.gemv_silu_mul(x, w, blocks).double()
    # The plain path's roundings from the exact gate and up. Four roundings (gate, up, SiLU's
    # output, the product) each within a step of 2^-7 relative: the GPU rounds to nearest,
    # Triton's interpreter toward zero, so a bound that holds for both allows a step each.
    gate, up = _exact(x, w).chunk(2, dim=-1)
    want = (F.silu(gate.to(torch.bfloat16)).to(torch.bfloat16) * up.to(torch.bfloat16)).double()
    assert ((got - want).abs() <= 4 * 2.0 ** -7 * want.abs() + 1e-3 * want.abs().max()).all()


@KERNELS_RUN
def test_rows_past_the_limit_are_refused():
    x, w, _ = _inputs(gemv.MAX_ROWS + 1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv.gemv(x, w)
    with pytest.raises(ValueError, match="must share K"):
        gemv.gemv(x[:2, :8], w)


@KERNELS_RUN
def test_negative_control_a_wrong_weight_row_is_caught():
    """The comparison above can fail: one weight row the kernel reads wrongly shows up."""
    x, w, _ = _inputs(3, 20, 70, torch.float32)
    bad = w.clone()
    bad[13, 69] += 1.0
    with pytest.raises(AssertionError):
        torch.testing.assert_close(gemv.gemv(x, bad), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_mode_other_than_auto_triton_cublas_is_refused(monkeypatch):
    monkeypatch.setenv("PDFLASH_GEMV", "fast")
    with pytest.raises(ValueError, match="PDFLASH_GEMV='fast': expected one of auto, triton, cublas"):
        gemv._mode_from_env()
    with pytest.raises(ValueError, match="expected one of"):
        with gemv.forced("cuda"):
            pass


# mma: M off the 16/32/64-row tiles, N and K off the blocks, split-K of 2 to 8 (clamped to K's
# steps: 9 steps in 8 ranges run as 5 of 2), one row, and K shorter than one step.
MMA_SHAPES = [(1, 37, 45, mma.DEFAULT), (3, 70, 300, mma.Tiles(32, 64, 1, 4, 3)),
              (16, 64, 256, mma.Tiles(64, 128, 1, 4, 4)), (17, 45, 129, mma.Tiles(32, 64, 4, 4, 3)),
              (33, 20, 200, mma.Tiles(32, 64, 2, 4, 3)), (8, 130, 520, mma.Tiles(128, 64, 8, 8, 4)),
              (5, 9, 7, mma.Tiles(32, 64, 8, 4, 4)), (64, 33, 96, mma.Tiles(32, 32, 2, 4, 3))]
# bf16 only where tl.dot computes it (see the module docstring).
MMA_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
MANTISSA = {torch.float16: 10, torch.bfloat16: 7}


def _assert_rounded_once(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """fp32 sums rounded once to x's dtype: within one rounding step of the exact product (the
    interpreter may round toward zero) plus the fp32 sum's own error where terms cancel."""
    exact = _exact(x, w, b)
    fp32_sum_err = 1e-5 * (_exact(x.abs(), w.abs(), None if b is None else b.abs()))
    assert ((got.double() - exact).abs() <= _bf16_ulp(exact, MANTISSA[x.dtype]) + fp32_sum_err).all()


def _assert_silu_mul_rounded(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The plain path's four roundings (gate, up, SiLU's output, the product) from the exact gate
    and up, a step each."""
    gate, up = _exact(x, w).chunk(2, dim=-1)
    step = 2.0 ** -MANTISSA[x.dtype]
    want = (F.silu(gate.to(x.dtype)).to(x.dtype) * up.to(x.dtype)).double()
    assert ((got.double() - want).abs() <= 4 * step * want.abs() + 1e-3 * want.abs().max()).all()


@KERNELS_RUN
@pytest.mark.parametrize("dtype", MMA_DTYPES)
@pytest.mark.parametrize("M,N,K,tiles", MMA_SHAPES)
def test_mma_matches_linear(M, N, K, tiles, dtype):
    x, w, b = _inputs(M, N, K, dtype)
    for bias in (None, b):
        got = mma.mm(x, w, bias, tiles)
        assert got.dtype == dtype and got.shape == (M, N)
        _assert_rounded_once(got, x, w, bias)


@KERNELS_RUN
@pytest.mark.parametrize("dtype", MMA_DTYPES)
@pytest.mark.parametrize("M,N,K,tiles", MMA_SHAPES)
def test_mma_silu_mul_matches_plain_path(M, N, K, tiles, dtype):
    x, w, _ = _inputs(M, 2 * N, K, dtype)
    got = mma.mm_silu_mul(x, w, tiles)
    assert got.dtype == dtype and got.shape == (M, N)
    _assert_silu_mul_rounded(got, x, w)


@KERNELS_RUN
@pytest.mark.parametrize("tiles", mma.CANDIDATES, ids=str)
def test_every_mma_candidate_computes_the_product(tiles):
    """Each launch shape `auto` may keep, with and without split-K's second pass, N and K off
    every block."""
    x, w, b = _inputs(11, 150, 300, torch.float16)
    _assert_rounded_once(mma.mm(x, w, b, tiles), x, w, b)
    x, w, _ = _inputs(11, 2 * 150, 300, torch.float16)
    _assert_silu_mul_rounded(mma.mm_silu_mul(x, w, tiles), x, w)


@KERNELS_RUN
def test_mma_split_k_is_deterministic():
    x, w, b = _inputs(9, 40, 700, torch.float16)
    tiles = mma.Tiles(32, 64, 4, 4, 3)
    assert torch.equal(mma.mm(x, w, b, tiles), mma.mm(x, w, b, tiles))


@KERNELS_RUN
def test_mma_negative_control_a_wrong_weight_in_the_masked_edge_is_caught():
    """The bound above can fail: one weight in the last, partly masked, K step of the last,
    partly masked, column block shows up, through the split-K path."""
    x, w, b = _inputs(17, 45, 129, torch.float16)
    bad = w.clone()
    bad[44, 128] += 1.0
    with pytest.raises(AssertionError):
        _assert_rounded_once(mma.mm(x, bad, b, mma.Tiles(32, 64, 4, 4, 3)), x, w, b)


@KERNELS_RUN
def test_mma_refuses_fp32_and_too_many_rows():
    x, w, _ = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="fp32 would run as TF32"):
        mma.mm(x, w)
    with pytest.raises(ValueError, match="fp32 would run as TF32"):
        gemv.run(x, w, None, True, mma.DEFAULT)
    x, w, _ = _inputs(mma.MAX_ROWS + 1, 8, 16, torch.float16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        mma.mm(x, w)


@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 16, 32, 33, 64, 65])
def test_fp32_never_reaches_the_tensor_core_kernel(M):
    """Neither route to mma (PDFLASH_GEMV=triton's choice, auto's candidates) takes fp32 rows;
    16-bit rows take it from 2 rows on (the control: the routes do lead there)."""
    x32 = torch.zeros(M, 4)
    assert not isinstance(gemv._triton_default(x32), mma.Tiles)
    assert not any(isinstance(c, mma.Tiles) for c in gemv.candidates(x32))
    for dtype in mma.DTYPES:
        x = x32.to(dtype)
        assert (gemv._triton_default(x) == mma.DEFAULT) == (2 <= M <= mma.MAX_ROWS)
        assert (gemv.candidates(x) == mma.CANDIDATES) == (2 <= M <= gemv.AUTO_MMA_ROWS)
    assert gemv.candidates(x32) == (gemv.CANDIDATES if M == 1 else ())
    assert gemv._triton_default(x32) == (gemv.DEFAULT if M <= gemv.MAX_ROWS else None)
