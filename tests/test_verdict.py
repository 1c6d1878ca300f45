"""The verify block's verdict (common.engine.verdict): accepted drafts, the first stop within
them, the tokens committed. Worked cases against the PyTorch path; the Triton kernel against
it on random blocks (on a GPU, or on CPU tensors under Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch

from common.engine.verdict import _verdict_torch, verdict
from common.model import fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_RUNS = pytest.mark.skipif(
    not fused.HAS_TRITON or (DEVICE == "cpu" and not fused._INTERPRETED),
    reason="triton is not installed" if not fused.HAS_TRITON else
    "no GPU: needs TRITON_INTERPRET=1 set before the kernels are imported")
T = lambda rows: torch.tensor(rows, dtype=torch.long)


def test_worked_cases():
    # Block of 4: choices c0..c3, drafts d1..d3; stop ids padded with -1.
    choices = T([[5, 6, 7, 8],    # every draft right: k = 3, commit 4
                 [5, 6, 7, 8],    # d1 wrong: k = 0, commit c0 only
                 [5, 6, 7, 8],    # k = 2, but c1 = 6 stops: commit 2
                 [5, 6, 7, 8],    # k = 1; the stop c3 = 8 lies past it: commit 2
                 [5, 6, 7, 8],    # k = 3, 2 tokens left: commit 2
                 [9, 6, 7, 8]])   # c0 stops: commit 1, whatever was accepted
    drafts = T([[5, 6, 7], [1, 6, 7], [5, 6, 1], [5, 1, 7], [5, 6, 7], [9, 6, 7]])
    stops = T([[2, -1], [2, -1], [6, 2], [8, -1], [-1, -1], [9, -1]])
    left = T([10, 10, 10, 10, 2, 10])
    out = _verdict_torch(drafts, choices, stops, left)
    assert out[:, :4].tolist() == choices.tolist()
    assert out[:, 4].tolist() == [3, 0, 2, 1, 3, 3]
    assert out[:, 5].tolist() == [4, 1, 2, 2, 2, 1]


@KERNEL_RUNS
def test_kernel_matches_torch():
    g = torch.Generator().manual_seed(0)
    for B, W, rows in ((2, 1, 3), (4, 2, 8), (8, 8, 17), (16, 9, 33), (5, 3, 1)):
        for trial in range(20):
            vocab = 3 + trial % 5  # few token ids: matches, stops and ties are common
            choices = torch.randint(0, vocab, (rows, B), generator=g)
            drafts = torch.where(torch.rand(rows, B - 1, generator=g) < 0.7, choices[:, :-1],
                                 torch.randint(0, vocab, (rows, B - 1), generator=g))
            stops = torch.randint(-1, vocab + 2, (rows, W), generator=g)
            left = torch.randint(1, B + 3, (rows,), generator=g)
            want = _verdict_torch(drafts, choices, stops, left)
            # stops and left as a decode step holds them: columns of one packed int64 buffer.
            packed = torch.cat([left[:, None], torch.full((rows, 2), 7), stops], 1).to(DEVICE)
            dev = [drafts.to(DEVICE), choices.to(DEVICE), packed[:, 3:], packed[:, 0]]
            got = verdict(*dev).cpu()
            assert got.tolist() == want.tolist(), (B, W, trial)
            with fused.disabled():
                assert verdict(*dev).cpu().tolist() == want.tolist()
