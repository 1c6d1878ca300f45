"""What of gpu-check's `flashinfer` part runs without a GPU: our page table described as
flashinfer's paged KV (indptr / indices / last_page_len), the part without flashinfer, and that
nothing of ours imports flashinfer unless the part runs."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from common.tools.gpu import flashinfer_check
from common.tools.gpu.flashinfer_check import csr_pages


def test_csr_pages_takes_each_rows_pages_and_drops_the_padding():
    page_table = torch.tensor([[5, 2, 9, 0], [7, 1, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]])  # 0: the scratch page
    kv_len = torch.tensor([40, 17, 16, 0])
    indptr, indices, last = csr_pages(page_table, kv_len, 16)
    assert indptr.tolist() == [0, 3, 5, 6, 6]
    assert indices.tolist() == [5, 2, 9, 7, 1, 3]
    assert last.tolist() == [8, 1, 16, 0]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}
    # every key lands in the slot our kernels use: page_table[r, j // page_size] * page_size + j % page_size
    for r, n in enumerate(kv_len.tolist()):
        pages = indices[indptr[r]:indptr[r + 1]].tolist()
        ours = [int(page_table[r, j // 16]) * 16 + j % 16 for j in range(n)]
        assert len(pages) == -(-n // 16) and (n == 0 or (len(pages) - 1) * 16 + last[r] == n)
        assert [pages[j // 16] * 16 + j % 16 for j in range(n)] == ours


def test_csr_pages_refuses_a_length_beyond_the_table():
    with pytest.raises(ValueError, match="more pages"):
        csr_pages(torch.tensor([[1, 2]]), torch.tensor([33]), 16)


def test_part_without_flashinfer_says_so_and_returns(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # what an import of a missing package does
    result = flashinfer_check.flashinfer_check()
    out = capsys.readouterr().out.strip().splitlines()
    assert result["available"] is False and "flashinfer" in result["reason"]
    assert len(out) == 1 and out[0].startswith("flashinfer: not importable")
    assert flashinfer_check.summary_lines(result) == [f"flashinfer not importable: {result['reason']}"]


def test_summary_of_rows_sums_a_layer_and_lists_failures():
    def row(op, bs, context, ours, theirs):
        return {"shape": "embedded", "op": op, "batch": bs, "context": context, "max_abs_diff": 0.0,
                "max_rel_diff": 0.0, "ok": True, "ours_us": ours, "flashinfer_us": theirs,
                "faster": "ours" if ours <= theirs else "flashinfer"}
    rows = [row("add_rmsnorm", 1, None, 2.0, 1.0), row("silu_mul", 1, None, 1.0, 2.0), row("rope_kv", 1, 256, 3.0, 4.0),
            row("attention", 1, 256, 5.0, 6.0), row("attention", 1, 2048, 50.0, 7.0),
            {"shape": "embedded", "op": "silu_mul", "batch": 8, "context": None, "error": "RuntimeError: nvcc"}]
    lines = flashinfer_check.summary_lines({"available": True, "version": "x", "rows": rows})
    # a layer: 2 norms + SiLU + RoPE/KV + attention at 256 (not 2048)
    assert any("batch 1, context 256" in s and "ours 13.0 us, flashinfer 14.0 us" in s for s in lines)
    assert any("FAILED RuntimeError: nvcc" in s for s in lines)
    assert any("attention flashinfer 1/2" in s for s in lines)


def test_our_modules_do_not_import_flashinfer():
    # A finder that records every attempt to import flashinfer, installed or not; the part's own
    # import is the control that it sees one.
    code = """
import sys
tried = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "flashinfer":
            tried.append(name)
        return None
sys.meta_path.insert(0, Watch())
import common.tools.gpu.command
from common.tools.gpu import flashinfer_check
assert not tried, tried
flashinfer_check._import()
assert tried == ["flashinfer"] or "flashinfer" in sys.modules, tried
"""
    subprocess.run([sys.executable, "-c", code], check=True)
