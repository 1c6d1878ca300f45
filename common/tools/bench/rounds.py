"""A benchmark run in rounds, so that `bench ab --interleave` can alternate stacks round by
round; run alone, it is all its rounds in order."""
from __future__ import annotations

from typing import Any, Protocol


class Rounds(Protocol):
    rounds: int

    def round(self, i: int) -> None: ...

    def finish(self) -> dict[str, Any]:
        """Summarise, write the files, return the summary."""


def complete(run: Rounds) -> dict[str, Any]:
    for i in range(run.rounds):
        run.round(i)
    return run.finish()
