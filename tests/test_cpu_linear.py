"""The CPU paths of common.model.transformer.linear for a few rows (decode, verify and draft
blocks): each equals F.linear to fp32 reduction order (bf16: to one rounding), whichever way this
CPU's choice (cpu_fp32_transposed) goes, and the choice is made once per process; products of 2
to 64 rows go through a packed copy of the weight (common.model.cpu_packed) that follows the
weight when it changes and goes with it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model import cpu_packed, transformer

needs_packing = pytest.mark.skipif(not cpu_packed.available(), reason="this torch has no oneDNN packed products")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 64, 65])
def test_few_row_products_equal_f_linear(monkeypatch, transposed, rows):
    monkeypatch.setattr(transformer, "cpu_fp32_transposed", lambda: transposed)
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(300, 96, generator=g), torch.randn(300, generator=g), torch.randn(rows, 96, generator=g)
    for bias in (None, b):
        y = transformer.linear(x, w, bias)
        assert y.shape == (rows, 300) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(transformer.linear(xb, wb).float(), F.linear(xb, wb).float(), rtol=1e-2, atol=1e-2)


def test_the_choice_is_timed_once_per_process():
    first = transformer.cpu_fp32_transposed()
    assert isinstance(first, bool) and transformer.cpu_fp32_transposed() is first
    assert transformer.cpu_fp32_transposed.cache_info().hits >= 1


def test_the_environment_pins_the_choice(monkeypatch):
    """How a worker rank takes the choice of the process that started it (WorkerSpec): untimed,
    whatever this CPU's timing says."""
    try:
        for value in (True, False):
            monkeypatch.setenv(transformer.CPU_FP32_TRANSPOSED_ENV, "1" if value else "0")
            transformer.cpu_fp32_transposed.cache_clear()
            assert transformer.cpu_fp32_transposed() is value
    finally:
        transformer.cpu_fp32_transposed.cache_clear()  # the next caller times it again


@needs_packing
def test_packed_products_equal_f_linear_and_keep_to_their_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    for rows in (2, 7, 64):
        x = torch.randn(rows, 96, generator=g)
        for bias in (None, b):
            torch.testing.assert_close(cpu_packed.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        if torch.bfloat16 in cpu_packed.DTYPES:
            xb, wb = x.bfloat16(), w.bfloat16()
            torch.testing.assert_close(cpu_packed.linear(xb, wb).float(), F.linear(xb, wb).float(), rtol=1e-2, atol=1e-2)
    strided = torch.randn(600, generator=g)[::2]
    x = torch.randn(4, 96, generator=g)
    torch.testing.assert_close(cpu_packed.linear(x, w, strided), F.linear(x, w, strided), rtol=1e-5, atol=1e-5)
    assert cpu_packed.linear(x[:, :0], torch.randn(300, 0)) is None  # oneDNN takes no empty weight
    for rows in (1, 65):  # past its rows this path stands aside
        assert cpu_packed.linear(torch.randn(rows, 96, generator=g), w) is None
    assert cpu_packed.linear(torch.randn(4, 96, generator=g).double(), w.double()) is None
    x = torch.randn(4, 96, generator=g)
    trained = w.clone().requires_grad_()
    assert cpu_packed.linear(x, trained) is None  # a product that records gradients
    with torch.no_grad():
        assert cpu_packed.linear(x, trained) is not None


@needs_packing
def test_a_weight_changed_in_place_is_packed_again():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(300, 96, generator=g), torch.randn(4, 96, generator=g)
    before = cpu_packed.linear(x, w)
    w.mul_(2)
    torch.testing.assert_close(cpu_packed.linear(x, w), 2 * before, rtol=1e-5, atol=1e-5)
    # Negative control: the copy packed before the change still gives the old product.
    stale = torch.ops.mkldnn._reorder_linear_weight(w / 2, None)
    torch.testing.assert_close(torch.ops.mkldnn._linear_pointwise(x, stale, None, "none", [], ""), before)
    # `.data =` (and Module.to) swap the storage under the same tensor, its version unchanged.
    layer = torch.nn.Linear(96, 300, bias=False)
    with torch.no_grad():
        cpu_packed.linear(x, layer.weight)
        layer.weight.data = w.clone()
        torch.testing.assert_close(cpu_packed.linear(x, layer.weight), 2 * before, rtol=1e-5, atol=1e-5)
        layer.weight.data = torch.randn(200, 96, generator=g)  # another shape
        torch.testing.assert_close(cpu_packed.linear(x, layer.weight), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_packed_copy_goes_with_its_weight():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 96, generator=g)
    held = len(cpu_packed._packs)
    w = torch.randn(300, 96, generator=g)
    cpu_packed.linear(x, w)
    assert len(cpu_packed._packs) == held + 1
    del w
    assert len(cpu_packed._packs) == held
    for seed in range(20):  # new weights, some at a freed address: each gets its own product
        w = torch.randn(300, 96, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(cpu_packed.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_packing
def test_packed_copies_keep_to_their_budget(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 96, generator=g)
    size = 300 * 96 * 4
    monkeypatch.setattr(cpu_packed, "_held", cpu_packed.budget() - size)  # room for one more weight
    monkeypatch.setattr(cpu_packed, "_told", False)
    first, second = torch.randn(300, 96, generator=g), torch.randn(300, 96, generator=g)
    assert cpu_packed.linear(x, first) is not None
    assert cpu_packed.linear(x, second) is None  # past the budget: F.linear, through transformer.linear
    torch.testing.assert_close(transformer.linear(x, second), F.linear(x, second), rtol=1e-5, atol=1e-5)
    del first  # its room returns
    third = torch.randn(300, 96, generator=g)
    assert cpu_packed.linear(x, third) is not None
    del second, third
    assert cpu_packed._held == cpu_packed.budget() - size


@pytest.mark.parametrize("value", ["lots", "-1", "1.5"])
def test_a_bad_budget_is_refused(monkeypatch, value):
    monkeypatch.setenv(cpu_packed.BUDGET_ENV, value)
    cpu_packed.budget.cache_clear()
    try:
        with pytest.raises(ValueError, match=cpu_packed.BUDGET_ENV):
            cpu_packed.budget()
    finally:
        monkeypatch.undo()
        cpu_packed.budget.cache_clear()


@needs_packing
def test_a_budget_of_zero_packs_nothing(monkeypatch):
    monkeypatch.setenv(cpu_packed.BUDGET_ENV, "0")
    cpu_packed.budget.cache_clear()
    try:
        x, w = torch.randn(4, 96), torch.randn(300, 96)
        assert cpu_packed.linear(x, w) is None
        torch.testing.assert_close(transformer.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    finally:
        monkeypatch.undo()
        cpu_packed.budget.cache_clear()
