"""The CPU paths of common.model.transformer.linear for a few rows (decode, verify and draft
blocks): each equals F.linear to fp32 reduction order (bf16: to one rounding), whichever way this
CPU's choice (cpu_fp32_transposed) goes, and the choice is made once per process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model import transformer


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
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
