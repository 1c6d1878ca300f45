"""`pdflash gpu-check --parts sampler`: the sampler's draw kernel (common.engine.draw) against the
PyTorch path at the embedded model's vocabulary, batch 64 and 256, T 0.7 with top-p 0.95 and with
temperature alone: equal tokens over 32 positions, and milliseconds per draw (logits in, tokens
out) for each.

Two kinds of rows, because the kernel's cost depends on where a row's kept tokens end: "peaked"
(five tokens 12 above a N(0, 2) rest, kept tokens inside the kernel's head, as a trained model's
decode steps nearly always are) and "flat" (N(0, 1): the whole-row bisection)."""
from __future__ import annotations

import torch

from common.engine.sampler import Mode, SamplingRows, sample_rows
from common.model import fused

VOCAB = 49152  # the embedded model's
POSITIONS = 32


def _logits(kind: str, batch: int, g: torch.Generator) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(batch, VOCAB, generator=g, device="cuda")
    x = torch.randn(batch, VOCAB, generator=g, device="cuda") * 2
    spikes = torch.randint(0, VOCAB, (batch, 5), generator=g, device="cuda")
    return x.scatter_add(1, spikes, torch.full((batch, 5), 12.0, device="cuda"))


def _rows(batch: int, top_p: float, step: int) -> SamplingRows:
    """The rows as a plain decode step hands them over: top_k, seed and step are columns of one
    packed int64 tensor (StepView.sampling), so strided."""
    full = lambda v, dtype: torch.full((batch,), v, dtype=dtype, device="cuda")  # noqa: E731
    packed = torch.stack([full(0, torch.int64), torch.arange(batch, device="cuda", dtype=torch.int64) + 1000,
                          full(step, torch.int64)], 1)
    return SamplingRows(full(0.7, torch.float32), full(top_p, torch.float32), packed[:, 0], packed[:, 1], packed[:, 2])


def _ms(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def sampler_check() -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for kind in ("peaked", "flat"):
        for batch in (64, 256):
            logits = _logits(kind, batch, g)
            for mode, top_p in ((Mode.FULL, 0.95), (Mode.TEMPERATURE, 1.0)):
                differ = 0
                for step in range(POSITIONS):
                    rows = _rows(batch, top_p, step)
                    kernel = sample_rows(logits, rows, mode)
                    with fused.disabled():
                        differ += int((kernel != sample_rows(logits, rows, mode)).sum())
                rows = _rows(batch, top_p, 0)
                kernel_ms = _ms(lambda: sample_rows(logits, rows, mode))
                with fused.disabled():
                    plain_ms = _ms(lambda: sample_rows(logits, rows, mode))
                row = {"rows": kind, "batch": batch, "mode": mode.name.lower(), "top_p": top_p,
                       "tokens_differing": differ, "of": batch * POSITIONS,
                       "kernel_ms": round(kernel_ms, 3), "plain_ms": round(plain_ms, 3),
                       "speedup": round(plain_ms / kernel_ms, 2)}
                print(row, flush=True)
                out.append(row)
    return out
