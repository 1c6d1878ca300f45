"""What a decode step costs on the GPU: CUDA events around each step's launch (its graph
replay), read after the fact, so timing adds no host synchronisation. The wall time of a step
also holds the host's work around it (inputs, bookkeeping, text) while the device idles;
benchmarks set the two side by side."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockTime:
    steps: int = 0
    seconds: float = 0.0

    def add(self, steps: int, seconds: float) -> None:
        self.steps += steps
        self.seconds += seconds

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps if self.steps else 0.0


class StepClock:
    def __init__(self) -> None:
        self._open: torch.cuda.Event | None = None
        self._marks: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        self._open = torch.cuda.Event(enable_timing=True)
        self._open.record()

    def stop(self, block: int) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._marks.append((block, self._open, end))
        self._open = None

    def take(self) -> dict[int, BlockTime]:
        """Device time per block (0 = plain steps) since the last take, and start afresh."""
        if self._marks:
            self._marks[-1][2].synchronize()
        out: dict[int, BlockTime] = {}
        for block, start, end in self._marks:
            out.setdefault(block, BlockTime()).add(1, start.elapsed_time(end) / 1e3)
        self._marks = []
        return dict(sorted(out.items()))
