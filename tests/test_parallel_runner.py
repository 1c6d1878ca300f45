"""Tensor- and pipeline-parallel runners (real worker processes, gloo) compute what one process
computes: logits, every layer's and head's KV, and the DFlash draft KV that prefill builds
from the captured hidden states (under PP only the drafter's fc partial sum crosses stages).

Relative error = largest difference / largest reference value. fp32: 1e-5 under PP (the same
ops on the same values; ~1e-6 measured, from the workers' thread count), 1e-4 with TP: an
all-reduce adds partial products in another order than one matmul, and 30 layers add it up
(4.4e-5 on SmolLM2's logits, 1.7e-5 on its KV). bf16: 5e-2, about twice bf16's own distance
from fp32 on these models (2e-2): TP all-reduces add bf16 partial products in another order
(2.5e-2 measured on the logits), and the drafter's fc is summed per stage in fp32 and rounded
once where one process rounds one matmul (1.2e-2 on the draft KV)."""
from __future__ import annotations

import pytest
import torch

from common.dflash.drafter import Drafter
from common.dflash.proposer import DFlashProposer
from common.kv.seq_cache import SeqCache
from common.parallel.driver import ParallelRunner
from common.parallel.pipeline_proposer import PipelineProposer
from common.runner.layout import ParallelConfigError
from common.runner.model_runner import ModelRunner

from tiny_models import random_model, save_random_drafter

PAGE = 8
FP32_TOL = 1e-5
# TP sums a row-parallel product's parts in another order, and on a CPU the single process's
# products of 2-64 rows (common.model.cpu_packed) err 1.6x F.linear's against fp64: the embedded
# model's TP-3 prefill logits differ by 1.2e-4 of the largest (4.4e-5 with packing off).
TP_FP32_TOL = 2e-4
BF16_TOL = 5e-2
# Stages of 16 layers: PP2 [0-7][8-15], PP4 [0-3][4-7]..., PP8 [0,1][2,3]...: 3|4 is a stage
# boundary for all three, 4, 5 and 7 share a stage, PP4's third stage and PP8's 5th-7th have none.
CAPTURE = (0, 3, 4, 5, 7, 15)


def run_prefill(runner, proposer) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Two requests prefilled in chunked steps (batched; a middle chunk whose logits nobody
    waits for; the last chunk), capturing the drafter's layers and appending draft KV as the
    engine does. (logits, KV, draft KV)."""
    prompts = [list(range(3, 23)), list(range(40, 49))]
    seqs, drafts = [SeqCache(), SeqCache()], [SeqCache(), SeqCache()]
    for s, d, p in zip(seqs, drafts, prompts):
        runner.reserve(s, len(p))
        proposer.reserve(d, len(p))
    logits = []
    steps = [([0, 1], [prompts[0][:13], prompts[1]], True), ([0], [prompts[0][13:17]], False),
             ([0], [prompts[0][17:]], True)]
    for batch, chunks, wanted in steps:
        out = runner.extend([seqs[i] for i in batch], chunks, all_logits=wanted, logits_of=None if wanted else [],
                            capture_layers=proposer.capture_layers)
        ends = torch.tensor([len(c) for c in chunks]).cumsum(0).tolist()
        proposer.append_context([drafts[i] for i in batch], out.captured,
                                [torch.arange(e - len(c), e) for c, e in zip(chunks, ends)])
        if wanted:
            logits.append(out.logits)
    pages = seqs[0].pages + seqs[1].pages
    draft_pages = drafts[0].pages + drafts[1].pages
    kv, draft_kv = runner.read_pages(pages), proposer.read_pages(draft_pages)
    for s, d in zip(seqs, drafts):
        runner.release(s)
        proposer.release(d)
    return logits, kv, draft_kv


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """Largest difference relative to the largest reference value."""
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
    return err


def check_parallel_equals_single(cfg, tensors, drafter_path: str, splits: list[tuple[int, int]],
                                 dtype: str, tol: float, tp_tol: float | None = None, device: str = "cpu",
                                 drafter_dtype: torch.dtype | None = None) -> None:
    """drafter_dtype: the drafter's (--draft-dtype), None for the target's; the draft KV is then
    compared at bf16's tolerance when the drafter runs in bf16."""
    single = ModelRunner(cfg, tensors, dtype=dtype, device=device, num_pages=16, page_size=PAGE)
    drafter = Drafter.load(drafter_path, device=device, dtype=drafter_dtype or single.dtype)
    want = run_prefill(single, DFlashProposer(drafter, single, 16))
    for tp, pp in splits:
        runner = ParallelRunner(cfg, tensors, tp=tp, pp=pp, dtype=dtype, device=device, num_pages=16, page_size=PAGE)
        try:
            proposer = (PipelineProposer(drafter_path, drafter, runner, 16) if pp > 1
                        else DFlashProposer(drafter, runner, 16))
            logits, kv, draft_kv = run_prefill(runner, proposer)
        finally:
            runner.close()
        t = tol if tp == 1 else tp_tol or tol
        for g, w in zip(logits, want[0]):
            close(g, w, t)
        close(kv, want[1], t)
        assert draft_kv.dtype == drafter.dtype
        close(draft_kv, want[2], BF16_TOL if drafter.dtype == torch.bfloat16 else t)


@pytest.fixture(scope="module")
def random16():
    return random_model(num_layers=16, hidden=64, heads=4, kv_heads=2, mlp=128)


def test_random_model_pp_and_tp_fp32(random16, tmp_path) -> None:
    cfg, tensors = random16
    drafter = save_random_drafter(cfg, CAPTURE, str(tmp_path / "drafter"))
    # PP 2/4/8; TP 2 (one KV head per rank), TP 4 (each KV head on two ranks); PP x TP.
    check_parallel_equals_single(cfg, tensors, drafter, [(1, 2), (1, 4), (1, 8), (2, 1), (4, 1), (2, 2)],
                                 "fp32", FP32_TOL, TP_FP32_TOL)


def test_random_model_pp_and_tp_fp32_with_a_bf16_drafter(random16, tmp_path) -> None:
    """--draft-dtype bf16 beside an fp32 target: every stage loads the drafter in the driver's
    dtype (LoadDrafter), and the last stage's draft KV is bf16."""
    cfg, tensors = random16
    drafter = save_random_drafter(cfg, CAPTURE, str(tmp_path / "drafter"))
    check_parallel_equals_single(cfg, tensors, drafter, [(1, 4), (2, 2)], "fp32", FP32_TOL, TP_FP32_TOL,
                                 drafter_dtype=torch.bfloat16)


def test_random_model_pp_bf16(random16, tmp_path) -> None:
    cfg, tensors = random16
    drafter = save_random_drafter(cfg, CAPTURE, str(tmp_path / "drafter"))
    check_parallel_equals_single(cfg, tensors, drafter, [(1, 4), (2, 2)], "bf16", BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_random_model_pp_and_tp_on_two_gpus(random16, tmp_path) -> None:
    """NCCL between one process per GPU."""
    cfg, tensors = random16
    drafter = save_random_drafter(cfg, CAPTURE, str(tmp_path / "drafter"))
    check_parallel_equals_single(cfg, tensors, drafter, [(1, 2), (2, 1)], "fp32", FP32_TOL, TP_FP32_TOL, device="cuda")
    check_parallel_equals_single(cfg, tensors, drafter, [(1, 2), (2, 1)], "bf16", BF16_TOL, device="cuda")


def test_embedded_model_pp_and_tp(embedded_weights) -> None:
    """SmolLM2-135M (30 layers, 9 heads, 3 KV heads) with the shipped drafter (captures
    1, 8, 14, 20, 27): PP 2 (14|15 boundary), 3 (two in stage 0, 20 opens stage 2), 5, TP 3."""
    from common.dflash.drafter import SHIPPED

    cfg, tensors = embedded_weights
    check_parallel_equals_single(cfg, tensors, SHIPPED, [(1, 2), (1, 3), (1, 5), (3, 1)], "fp32", FP32_TOL, TP_FP32_TOL)


def test_unsplittable_tp_refused_before_any_process(embedded_weights) -> None:
    cfg, tensors = embedded_weights
    with pytest.raises(ParallelConfigError, match="9 attention heads do not split over TP 2"):
        ParallelRunner(cfg, tensors, tp=2)


DRIVER = """
import os
import sys
sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]  # this checkout's packages, not an installed one's
from tiny_models import random_model
from common.parallel.driver import ParallelRunner
from common.kv.seq_cache import SeqCache

if __name__ == "__main__":
    cfg, tensors = random_model(num_layers=4)
    runner = ParallelRunner(cfg, tensors, pp=2, num_pages=4, page_size=8)
    runner.on_lost = lambda why, grace_s: print(f"out of service ({{grace_s}} s): {{why}}", flush=True)
    print(runner.worker_pids[0], flush=True)
    while True:  # steps keep coming, as in a busy service
        seq = SeqCache()
        runner.reserve(seq, 8)
        runner.extend([seq], [list(range(8))])
        runner.release(seq)
"""


def test_dead_worker_stops_the_driver_with_an_error(tmp_path) -> None:
    """A killed worker rank must not leave the service hanging in a collective: the driver takes
    the instance out of service at once naming the rank (the service then fails its requests in
    flight with that), and exits non-zero (so `pdflash up` restarts the instance)."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "worker pdflash-rank1 exited with code -9" in proc.stderr.read()
    assert proc.stdout.read() == "out of service (0.0 s): worker pdflash-rank1 exited with code -9; the model is incomplete\n"
