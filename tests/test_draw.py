"""The sampler's draw kernel (common.engine.draw) against the PyTorch path on the same rows, seeds
and positions: temperature only, top-k inside and past the kernel's head, top-p ending inside the
head and past it (flat rows, drawn over the whole vocabulary), greedy rows among them. On a GPU,
or on CPU tensors under Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from common.engine import draw
from common.engine.sampler import Mode, SamplingRows, sample_rows
from common.model import fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_RUNS = pytest.mark.skipif(
    not fused.HAS_TRITON or (DEVICE == "cpu" and not fused._INTERPRETED),
    reason="triton is not installed" if not fused.HAS_TRITON else
    "no GPU: needs TRITON_INTERPRET=1 set before the kernels are imported")
V = 1000  # past draw.HEAD, so that both the head and the whole row are walked


def rows_of(temperature: list[float], top_k: list[int], top_p: list[float], seed: int, step: int) -> SamplingRows:
    n = len(temperature)
    t = lambda v, dtype: torch.tensor(v, dtype=dtype, device=DEVICE)  # noqa: E731
    return SamplingRows(t(temperature, torch.float32), t(top_p, torch.float32), t(top_k, torch.int64),
                        t([seed * 1000 + i for i in range(n)], torch.int64), t([step] * n, torch.int64))


def both(logits: torch.Tensor, rows: SamplingRows, mode: Mode) -> tuple[list[int], list[int]]:
    kernel = sample_rows(logits, rows, mode).tolist()
    with fused.disabled():
        plain = sample_rows(logits, rows, mode).tolist()
    return kernel, plain


def logits_of(scales: list[float], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(len(scales), V, generator=g) * torch.tensor(scales)[:, None]).to(DEVICE)


@KERNEL_RUNS
def test_temperature_rows_draw_what_the_plain_path_draws():
    for step in range(6):
        logits = logits_of([3.0, 0.5, 8.0, 1.0], step)
        rows = rows_of([1.0, 0.7, 1.3, 0.0], [0] * 4, [1.0] * 4, seed=step, step=step)
        kernel, plain = both(logits, rows, Mode.TEMPERATURE)
        assert kernel == plain
        assert kernel[3] == int(logits[3].argmax())  # the greedy row


@KERNEL_RUNS
def test_top_k_and_top_p_rows_draw_what_the_plain_path_draws():
    """Sharp rows end inside the head; flat rows (scale 0.2) and a top-k of 400 do not."""
    walked = {"head": 0, "row": 0}
    for step in range(8):
        scales = [4.0, 4.0, 0.2, 0.2, 3.0, 0.2, 6.0, 2.0]
        logits = logits_of(scales, 100 + step)
        rows = rows_of([0.7, 1.0, 1.0, 0.8, 1.0, 1.2, 0.0, 1.0],
                       [0, 20, 0, 400, 400, 0, 0, 256],
                       [0.95, 1.0, 0.9, 0.95, 1.0, 0.5, 0.9, 0.8], seed=step, step=3 * step)
        kernel, plain = both(logits, rows, Mode.FULL)
        assert kernel == plain, (step, kernel, plain)
        for i in range(len(scales)):
            p = (logits[i] / rows.temperature[i].clamp(min=1e-5)).softmax(-1)
            head = p.topk(draw.HEAD).values.sum()
            k = int(rows.top_k[i])
            inside = 0 < k <= draw.HEAD or (k == 0 and head > rows.top_p[i])
            walked["head" if inside else "row"] += rows.temperature[i] > 0
    assert walked["head"] >= 16 and walked["row"] >= 16  # both ways were taken


@KERNEL_RUNS
def test_kept_tokens_are_the_most_likely():
    """A draw never leaves the kept set: 64 positions of a row where three tokens hold 0.6, 0.3
    and 0.1, and a flat row with top-k 300 (whole-row bisection)."""
    three = torch.full((1, V), -30.0)
    three[0, 3], three[0, 9], three[0, 11] = 0.0, -0.6931, -1.7918
    flat = logits_of([0.05], 7).cpu()
    logits = torch.cat([three, flat]).to(DEVICE)
    allowed = set(flat[0].topk(300).indices.tolist())
    seen: list[set[int]] = [set(), set()]
    for step in range(64):
        rows = rows_of([1.0, 1.0], [0, 300], [0.7, 1.0], seed=5, step=step)
        kernel, plain = both(logits, rows, Mode.FULL)
        assert kernel == plain
        seen[0].add(kernel[0])
        seen[1].add(kernel[1])
    assert seen[0] == {3, 9}
    assert seen[1] <= allowed and len(seen[1]) > 40


@KERNEL_RUNS
def test_each_row_reads_its_own_strided_inputs():
    """A plain decode step hands top_k, seed and step over as columns of its packed int64 inputs
    (StepView.sampling), so they are strided: each row must still read its own."""
    logits = logits_of([0.5] * 6, 11)
    differ = 0
    for step in range(32):
        want = rows_of([1.0] * 6, [5, 0, 0, 40, 0, 3], [1.0, 0.9, 0.95, 1.0, 0.5, 1.0], seed=1, step=step)
        packed = torch.stack([want.top_k, want.seed, want.step, torch.full_like(want.top_k, 2)], 1)
        strided = SamplingRows(want.temperature, want.top_p, packed[:, 0], packed[:, 1], packed[:, 2])
        assert not strided.top_k.is_contiguous()
        kernel = sample_rows(logits, strided, Mode.FULL).tolist()
        with fused.disabled():
            plain = sample_rows(logits, want, Mode.FULL).tolist()
        differ += sum(a != b for a, b in zip(kernel, plain))
    assert differ == 0


@KERNEL_RUNS
def test_small_and_masked_vocabularies():
    """A vocabulary smaller than the head, and rows whose most tokens are masked to -inf."""
    small = logits_of([2.0, 0.3], 21)[:, :100]
    masked = logits_of([0.2, 0.2], 22)
    masked[0, 300:] = float("-inf")
    masked[1, 5:] = float("-inf")
    for logits in (small, masked):
        for step in range(8):
            rows = rows_of([1.0, 0.9], [0, 50], [0.9, 0.95], seed=3, step=step)
            kernel, plain = both(logits, rows, Mode.FULL)
            assert kernel == plain
            assert all(logits[i, t] > float("-inf") for i, t in enumerate(kernel))
