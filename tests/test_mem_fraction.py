"""--mem-fraction: the KV pages it gives fill the fraction of a GPU's memory, with the weights, as
closely as a page allows, checked against what real runners of every rank allocate; on CPU it is
a usage error."""
from __future__ import annotations

import pytest
import torch

from common.runner.layout import ParallelConfigError, RankLayout
from common.runner.model_runner import ModelRunner
from common.service.memory import kv_pages_for_fraction

GPU_BYTES = 2 << 30  # a made-up GPU: the sizing is arithmetic, the runners below are real (CPU)
FRACTION = 0.4
PAGE_SIZE = 16


def allocated(runner: ModelRunner) -> int:
    """Bytes of the runner's weights and KV pool."""
    tensors = [*runner.model.parameters(), *runner.model.buffers(), runner.kv]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values() if t.device.type != "meta")


@pytest.mark.parametrize("tp, pp", [(3, 1), (1, 2)])
def test_pages_fill_the_fraction_on_every_rank(embedded_weights, tp: int, pp: int) -> None:
    cfg, tensors = embedded_weights
    layout = RankLayout(tp, pp, 0, 1)
    pages = kv_pages_for_fraction(FRACTION, GPU_BYTES, cfg, tensors, layout, "fp32", PAGE_SIZE, 64)
    budget = FRACTION * GPU_BYTES
    slack = []
    for rank in range(layout.world) if pp > 1 else [0]:  # TP ranks of the embedded model are alike
        runner = ModelRunner(cfg, tensors, num_pages=pages, page_size=PAGE_SIZE, layout=layout.with_rank(rank))
        used = allocated(runner)
        page = runner.kv[:, :, 0].numel() * runner.kv.element_size()
        assert used <= budget, f"rank {rank}: {used} bytes allocated, over {budget}"
        slack.append((budget - used) / page)
        del runner
    # The fullest rank is left less than two pages (the scratch page and rounding down).
    assert min(slack) < 2, slack


def test_weights_that_do_not_fit_are_refused(embedded_weights) -> None:
    cfg, tensors = embedded_weights
    with pytest.raises(ParallelConfigError, match="leaves no room for KV pages next to rank 0's weights"):
        kv_pages_for_fraction(0.1, 1 << 30, cfg, tensors, RankLayout(1, 1, 0, 1), "fp32", PAGE_SIZE, 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
@pytest.mark.parametrize("service", ["prefill_svc", "decode_svc"])
def test_on_cpu_it_is_a_usage_error(service: str, capsys) -> None:
    parse_args = __import__(f"{service}.__main__", fromlist=["parse_args"]).parse_args
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--port", "1", "--device", "cpu", "--mem-fraction", "0.85"])
    assert exit_.value.code == 2
    assert "--mem-fraction sizes the KV pool from GPU memory; on cpu give --kv-pages" in capsys.readouterr().err
