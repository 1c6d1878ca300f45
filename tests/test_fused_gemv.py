"""The decode GEMV kernels (common.model.gemv) against F.linear and SiLU(gate) * up: fp32 to
reduction order, bf16 to one rounding, M = 1..16 rows, N and K off the block sizes; and the
logits' argmax (common.model.fused.argmax) against torch's, ties included. On a GPU, or
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 in the environment before the
kernels are defined)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from common.model import cpu_packed, fused, gemv, transformer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = pytest.mark.skipif(
    not fused.HAS_TRITON or (DEVICE == "cpu" and not fused._INTERPRETED),
    reason="triton is not installed" if not fused.HAS_TRITON else
    "no GPU: needs TRITON_INTERPRET=1 set before the kernels are imported")
# N and K off every block size; a block shape of each kind; rows 1..16.
SHAPES = [(1, 37, 45, gemv.DEFAULT), (3, 70, 300, gemv.Blocks(4, 512, 4)), (5, 24, 129, gemv.Blocks(1, 2048, 8)),
          (8, 45, 513, gemv.Blocks(8, 256, 4)), (2, 9, 7, gemv.DEFAULT), (4, 33, 256, gemv.Blocks(4, 256, 4)),
          (6, 17, 64, gemv.Blocks(1, 1024, 4)), (7, 5, 100, gemv.Blocks(8, 256, 4)),
          (4, 21, 600, gemv.Blocks(2, 1024, 1)), (3, 30, 90, gemv.Blocks(4, 1024, 2)),
          (2, 13, 1100, gemv.Blocks(1, 1024, 1)), (5, 40, 77, gemv.Blocks(2, 1024, 2)),
          (4, 35, 700, gemv.Blocks(1, 1024, 4, tile=True)), (7, 19, 2100, gemv.Blocks(1, 2048, 8, tile=True)),
          (1, 23, 90, gemv.Blocks(2, 512, 4, tile=True)), (8, 41, 520, gemv.Blocks(4, 256, 4, tile=True)),
          (3, 6, 33, gemv.Blocks(2, 512, 4, tile=True)), (16, 29, 600, gemv.Blocks(2, 1024, 1)),
          (12, 18, 130, gemv.Blocks(4, 256, 4, tile=True)), (16, 11, 1030, gemv.Blocks(1, 1024, 4, tile=True)),
          (1, 37, 45, gemv.Blocks(16, 64, 4, dot="mma")), (16, 70, 300, gemv.Blocks(32, 128, 4, dot="mma")),
          (9, 45, 513, gemv.Blocks(16, 256, 4, dot="tf32x3")), (15, 130, 600, gemv.Blocks(64, 64, 4, dot="tf32x3")),
          # split-K: 9, 3, 18 and 1 (no split) programs along K
          (8, 45, 513, gemv.Blocks(16, 64, 4, dot="tf32x3", span=1)), (16, 70, 300, gemv.Blocks(16, 64, 4, dot="mma", span=2)),
          (3, 130, 1100, gemv.Blocks(32, 64, 4, dot="tf32x3", span=1)), (5, 37, 45, gemv.Blocks(16, 64, 2, dot="mma", span=1)),
          # 33 steps of 64 in at most 32 programs: 17 programs of 2 steps
          (6, 20, 2100, gemv.Blocks(16, 64, 4, dot="tf32x3", span=1))]


def _inputs(M: int, N: int, K: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((M, K), (N, K), (N,)))
    return x.to(DEVICE, dtype), w.div(K ** 0.5).to(DEVICE, dtype), b.to(DEVICE, dtype)


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x w^T + b in float64 from the same (rounded) inputs."""
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _dtypes(blocks: gemv.Blocks) -> tuple[torch.dtype | None, torch.dtype | None]:
    """fp32 (or None) and the 16-bit dtype (or None) these blocks are checked on: bf16, except
    mma blocks under Triton's interpreter, which multiplies bf16 tiles in tl.dot as their raw
    bits and fp16 ones as numbers (on the GPU both are tensor-core products; gpu-check's gemv
    part checks bf16 there). The interpreter computes tf32x3 as plain fp32 products: its
    splitting is checked on the GPU only."""
    half = torch.float16 if blocks.dot == "mma" and DEVICE == "cpu" else torch.bfloat16
    return (torch.float32 if blocks.runs(torch.float32) else None), (half if blocks.runs(half) else None)


def _bf16_ulp(y: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step at |y| (8 significant bits), and at least a tiny absolute one."""
    return torch.exp2(torch.floor(torch.log2(y.abs().clamp(min=1e-6)))) * 2.0 ** -7


@KERNELS_RUN
@pytest.mark.parametrize("M,N,K,blocks", SHAPES)
def test_gemv_matches_linear(M, N, K, blocks):
    fp32, half = _dtypes(blocks)
    for bias in (False, True):
        if fp32:
            x, w, b = _inputs(M, N, K, fp32)
            b = b if bias else None
            got = gemv.gemv(x, w, b, blocks)
            assert got.dtype == fp32 and got.shape == (M, N)
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        if not half:
            continue

        x, w, b = _inputs(M, N, K, half)
        b = b if bias else None
        got = gemv.gemv(x, w, b, blocks)
        assert got.dtype == half
        exact = _exact(x, w, b)
        # fp32 sums rounded once: within one bf16 step (fp16's are finer) of the exact product (half
        # a step on the GPU, which rounds to nearest; under Triton's interpreter, which rounds
        # toward zero, a step), plus the fp32 sum's own error, which matters only where terms cancel.
        fp32_sum_err = 1e-5 * _exact(x.abs(), w.abs())
        assert ((got.double() - exact).abs() <= _bf16_ulp(exact) + fp32_sum_err).all()


@KERNELS_RUN
@pytest.mark.parametrize("M,N,K,blocks", SHAPES)
def test_gemv_silu_mul_matches_plain_path(M, N, K, blocks):
    fp32, half = _dtypes(blocks)
    if fp32:
        x, w, _ = _inputs(M, 2 * N, K, fp32)
        got = gemv.gemv_silu_mul(x, w, blocks)
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        assert got.shape == (M, N)
        torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    if not half:
        return

    x, w, _ = _inputs(M, 2 * N, K, half)
    got = gemv.gemv_silu_mul(x, w, blocks).double()
    # The plain path's roundings from the exact gate and up. Four roundings (gate, up, SiLU's
    # output, the product) each within a step of 2^-7 relative: the GPU rounds to nearest,
    # Triton's interpreter toward zero, so a bound that holds for both allows a step each.
    gate, up = _exact(x, w).chunk(2, dim=-1)
    want = (F.silu(gate.to(half)).to(half) * up.to(half)).double()  # fp16's steps are finer than bf16's
    assert ((got - want).abs() <= 4 * 2.0 ** -7 * want.abs() + 1e-3 * want.abs().max()).all()


@KERNELS_RUN
def test_argmax_matches_torch_ties_included():
    g = torch.Generator().manual_seed(0)
    for rows, V in ((1, 1), (3, 7), (2, fused.ARGMAX_CHUNK), (4, fused.ARGMAX_CHUNK + 1), (5, 3 * fused.ARGMAX_CHUNK + 77)):
        x = torch.randn(rows, V, generator=g)
        if V > 5:  # the largest value twice in a row, and (past one chunk) again in a later chunk
            x[0, 2] = x[0, 5] = x[0].max() + 1
            x[0, -1] = x[0, 2]
        if rows > 2:
            x[2] = float("-inf")  # all equal: index 0
        if rows > 3:
            x[3, :] = 0.5  # all equal and finite
        if rows > 4:
            x[4, V // 2] = x[4, -1] = float("nan")  # NaN counts as the largest: the first one
            x[1] = float("nan")
        for dtype in (torch.float32, torch.bfloat16):
            y = x.to(DEVICE, dtype)
            got = fused.argmax(y)
            assert got.dtype == torch.int64 and got.tolist() == y.argmax(-1).tolist(), (rows, V, dtype)
    # A strided view (a block's rows of logits) reads the same.
    x = torch.randn(6, 2 * fused.ARGMAX_CHUNK + 3, generator=g).to(DEVICE)
    assert fused.argmax(x[::2]).tolist() == x[::2].argmax(-1).tolist()


def test_dot_blocks_are_checked():
    """A dot shape tl.dot cannot take, and a dot on inputs it is not for (tf32x3 on bf16, mma on
    fp32), are refused."""
    for bad in (dict(dot="tf32"), dict(dot="mma", tile=True), dict(dot="mma", n=8)):
        with pytest.raises(ValueError, match="dot is one of"):
            gemv.Blocks(**{"n": 16, "k": 64, "warps": 4} | bad)
    tf32x3, mma = gemv.Blocks(16, 64, 4, dot="tf32x3"), gemv.Blocks(16, 64, 4, dot="mma")
    assert tf32x3.runs(torch.float32) and not tf32x3.runs(torch.bfloat16) and str(tf32x3) == "n16/k64/w4/tf32x3"
    assert mma.runs(torch.bfloat16) and mma.runs(torch.float16) and not mma.runs(torch.float32)
    assert gemv.DEFAULT.runs(torch.float32) and gemv.DEFAULT.runs(torch.bfloat16)
    for blocks, dtype in ((tf32x3, torch.bfloat16), (mma, torch.float32)):
        x, w, _ = _inputs(2, 16, 64, dtype)
        with pytest.raises(ValueError, match="must share a dtype these blocks take"):
            gemv.gemv(x, w, None, blocks)


def test_spans_are_checked_and_cut_k():
    """A span is for dot blocks and positive; it cuts K into ranges of span x k steps."""
    for bad in (dict(span=1), dict(span=-1, dot="mma")):
        with pytest.raises(ValueError, match="a span is a positive number of steps, for dot blocks only"):
            gemv.Blocks(**{"n": 16, "k": 64, "warps": 4} | bad)
    split = gemv.Blocks(16, 64, 4, dot="tf32x3", span=2)
    assert str(split) == "n16/k64/w4/tf32x3/s2" and gemv._BY_NAME[str(gemv.CANDIDATES[-1])] == gemv.CANDIDATES[-1]
    assert [split.splits(k) for k in (1, 128, 129, 576, 1536, 14336)] == [1, 1, 2, 5, 12, 32]
    assert split.split_span(14336) == 7 * 64 and split.split_span(576) == 128
    assert gemv.Blocks(16, 64, 4, dot="tf32x3", span=1).splits(2100) == 17
    assert gemv.Blocks(16, 64, 4, dot="tf32x3").splits(1536) == 1


@KERNELS_RUN
def test_split_products_repeat_and_leave_their_counters_at_zero():
    """The last program of a column block resets its counter: a second product (and every later
    one) sums all of its partials again, to the same bits, and the counters are zero between them.
    A counter left behind would keep the next product's last program from ever finishing it."""
    blocks = gemv.Blocks(16, 64, 4, dot="tf32x3", span=1)
    x, w, _ = _inputs(4, 100, 700, torch.float32)
    assert blocks.splits(700) == 11
    first = gemv.gemv_silu_mul(x, w, blocks)
    assert gemv.split_counters_at_zero(x.device)
    assert torch.equal(gemv.gemv_silu_mul(x, w, blocks), first)
    assert torch.equal(gemv.gemv(x, w, None, blocks), gemv.gemv(x, w, None, blocks))
    assert gemv.split_counters_at_zero(x.device)
    # auto's check before timing a shape: within the tolerance here, and 0 (not NaN) on zero weights
    assert gemv.error(x, w, None, False, blocks) <= gemv.tolerance(torch.float32)
    assert gemv.error(x, torch.zeros_like(w), None, True, blocks) == 0.0


def test_a_kept_split_choice_met_in_a_capture_without_counters_runs_on_cublas(monkeypatch):
    """Counters cannot be made inside a CUDA-graph capture: a split shape kept on disk, first met
    there, runs on cuBLAS; with the counters made (an eager run before), or where K takes one
    program, the kept shape runs."""
    from common.model import gemv_cache

    split = gemv.Blocks(16, 64, 4, dot="tf32x3", span=1)
    x = torch.zeros(8, 700)
    kept_names = [gemv_cache.key_name(False, 8, 50, k, torch.float32, False) for k in (700, 64)]
    for name, value in (("_fits", lambda *a: True), ("_kept_path", lambda index: "kept.json"),
                        ("_kept_choices", lambda path: {n: str(split) for n in kept_names}),
                        ("_counters", {}), ("_chosen", {}), ("_mode", "auto")):
        monkeypatch.setattr(gemv, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gemv._choice(x, torch.zeros(50, 700), None, False) is None
    assert gemv._choice(x[:, :64], torch.zeros(50, 64), None, False) == split  # one program along K
    gemv._counters[x.device] = torch.zeros(gemv.COUNTERS, dtype=torch.int32)
    assert gemv._choice(x, torch.zeros(50, 700), None, False) == split


def test_kept_only_times_nothing_and_keeps_nothing(monkeypatch):
    """Inside kept_only() a shape never timed runs on cuBLAS, and is neither timed nor kept (the
    next warm-up outside times it); a choice kept in this process is used."""
    timed = []
    for name, value in (("_fits", lambda *a: True), ("_kept_path", lambda index: "kept.json"),
                        ("_kept_choices", lambda path: {}), ("_chosen", {}), ("_mode", "auto"),
                        ("_timed_choice", lambda x, *a: timed.append(x.shape[0]) or gemv.DEFAULT)):
        monkeypatch.setattr(gemv, name, value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x, w = torch.zeros(3, 64), torch.zeros(50, 64)
    with gemv.kept_only():
        assert gemv._choice(x, w, None, False) is None
    assert timed == [] and gemv._chosen == {}
    assert gemv._choice(x, w, None, False) == gemv.DEFAULT and timed == [3]
    with gemv.kept_only():
        assert gemv._choice(x, w, None, False) == gemv.DEFAULT
    assert timed == [3]


def test_an_eager_prefill_times_no_product(monkeypatch, embedded_runner):
    """A prefill step of several prompts runs eagerly, its logits one row per prompt: none of
    its products may be timed while requests wait (the draft KV of its tokens alike:
    test_dflash_lossless)."""
    from common.kv.seq_cache import SeqCache

    seen = []
    choice = gemv._choice
    monkeypatch.setattr(gemv, "_choice", lambda *a, **k: seen.append(gemv._timing) or choice(*a, **k))
    # A CPU's few-row paths (packed copies; W @ x.T where this CPU times it faster, which a busy VM
    # sometimes does) would take the products: on CUDA they go through gemv.
    monkeypatch.setattr(cpu_packed, "_AVAILABLE", False)
    monkeypatch.setattr(transformer, "cpu_fp32_transposed", lambda: False)
    seqs = [SeqCache(), SeqCache()]
    try:
        for s in seqs:
            embedded_runner.reserve(s, 8)
        out = embedded_runner.extend(seqs, [[1, 2, 3], [4, 5]])
    finally:
        for s in seqs:
            embedded_runner.release(s)
    assert out.logits.shape[0] == 2 and seen and not any(seen)


def test_choices_name_each_product_and_its_kernel(monkeypatch):
    split = gemv.Blocks(16, 64, 4, dot="tf32x3", span=1)
    monkeypatch.setattr(gemv, "_chosen", {(True, 8, 3072, 576, torch.float32, False): split,
                                          (False, 1, 576, 1536, torch.bfloat16, False): None})
    assert gemv.choices() == {"linear rows=1 n=576 k=1536 bfloat16": "cublas",
                              "silu_mul rows=8 n=3072 k=576 float32": str(split)}


def test_rows_past_the_limit_are_refused():
    x, w, _ = _inputs(gemv.MAX_ROWS + 1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=f"at most {gemv.MAX_ROWS} rows"):
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


def test_auto_choices_are_kept_on_disk(tmp_path):
    """auto's choices go to a file per GPU and code, each product under its own name, and come
    back as the kernel's blocks or cuBLAS; a file that is not ours is no choice (timed again)."""
    from common.model import gemv_cache

    path = gemv_cache.path_for("NVIDIA H200", "torch2.11-triton3.6", b"kernel code")
    assert os.path.dirname(path) == gemv_cache.FOLDER and " " not in os.path.basename(path)
    assert path != gemv_cache.path_for("NVIDIA H200", "torch2.11-triton3.6", b"other kernel code")
    assert path != gemv_cache.path_for("NVIDIA H100", "torch2.11-triton3.6", b"kernel code")

    file = str(tmp_path / "sub" / "kept.json")
    assert gemv_cache.load(file) == {}
    gate_up = gemv_cache.key_name(True, 4, 3072, 576, torch.float32, False)
    o_bias = gemv_cache.key_name(False, 1, 576, 576, torch.bfloat16, True)
    assert gate_up == "silu_mul rows=4 n=3072 k=576 float32" and o_bias == "linear rows=1 n=576 k=576 bfloat16 bias"
    gemv_cache.keep(file, gate_up, str(gemv.CANDIDATES[0]))
    gemv_cache.keep(file, o_bias, "cublas")  # added to the first, not in its place
    kept = gemv_cache.load(file)
    assert kept == {gate_up: str(gemv.CANDIDATES[0]), o_bias: "cublas"}
    assert gemv._BY_NAME[kept[gate_up]] == gemv.CANDIDATES[0] and gemv._BY_NAME[kept[o_bias]] is None
    assert "n3/k999/w5" not in gemv._BY_NAME  # a choice this code does not have is timed again
    assert sorted(os.listdir(tmp_path / "sub")) == [".lock", "kept.json"]  # the lock, no half-written file
    with open(file, "w") as f:
        f.write("[1, 2")
    assert gemv_cache.load(file) == {}
