"""The frozen target's features of training sequences, kept on the device between passes.

A run passes over its data many times (10-17 passes in the one command), and the target says the
same about a sequence each time: its capture layers' residual stream and its greedy next tokens.
On a GPU that pass is most of a step's per-token cost (the drafter's own work depends on the
anchors, not the sequence's length), so a sequence captured once is read back afterwards.

Sequences are admitted in the order the run first captures them, each whole, while they fit in
the budget; the others are captured every time they come. The admission is a pure function of
that order and the token counts (`Admission`), so the step planner can replay it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from common.tools.drafter.objective import Batch, Targets, select_rows


class Admission:
    """Which sequences (by key) hold a place: a sequence of n tokens is admitted the first time
    it is offered if n tokens are still free, and keeps its place."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self.start: dict[int, int] = {}

    def offer(self, key: int, n: int) -> int | None:
        """The start of the key's place, admitting it if it fits; None if it does not."""
        if key not in self.start and self.used + n <= self.capacity:
            self.start[key] = self.used
            self.used += n
        return self.start.get(key)

    def __contains__(self, key: int) -> bool:
        return key in self.start

    def copy(self) -> "Admission":
        out = Admission(self.capacity)
        out.used, out.start = self.used, dict(self.start)
        return out


class FeatureCache:
    """Features [capacity, layers x H] and greedy next tokens [capacity] of admitted sequences."""

    def __init__(self, capacity: int, layers: tuple[int, ...], hidden: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers, self.hidden = layers, hidden
        self.admission = Admission(capacity)
        self.feats = torch.empty(capacity, len(layers) * hidden, dtype=dtype, device=device)
        self.next_token = torch.zeros(capacity, dtype=torch.long, device=device)
        self.hits = self.misses = 0  # sequences read back / captured (admitted or not)

    @staticmethod
    def bytes_per_token(layers: tuple[int, ...], hidden: int, dtype: torch.dtype) -> int:
        return len(layers) * hidden * dtype.itemsize + 8

    def targets(self, batch: Batch, capture: Callable[[Batch], Targets]) -> Targets:
        """The batch's Targets (features, and greedy next tokens where it holds sampled answers),
        read back where held, captured (and admitted if they fit) where not."""
        missing = [r for r, key in enumerate(batch.keys) if key not in self.admission]
        self.hits += batch.size - len(missing)
        self.misses += len(missing)
        fresh = capture(select_rows(batch, missing)) if missing else None
        for j, r in enumerate(missing):
            n = int(batch.lengths[r])
            start = self.admission.offer(batch.keys[r], n)
            if start is not None:
                self.feats[start:start + n] = torch.cat([fresh.feats[layer][j, :n] for layer in self.layers], -1)
                if fresh.next_token is not None:
                    self.next_token[start:start + n] = fresh.next_token[j, :n]
        return self._read(batch, missing, fresh)

    def _read(self, batch: Batch, missing: list[int], fresh: Targets | None) -> Targets:
        S, L = batch.ids.shape
        dev = self.feats.device
        held = [r for r in range(S) if batch.keys[r] in self.admission]
        if held:
            # Past a sequence's end its last token's place is read again: no block reads there.
            starts = torch.tensor([self.admission.start[batch.keys[r]] for r in held], device=dev)
            last = batch.lengths[held].to(dev) - 1
            at = starts[:, None] + torch.minimum(torch.arange(L, device=dev)[None, :], last[:, None])
        if len(held) == S:
            feats, next_token = self.feats[at], self.next_token[at]
        else:
            feats = torch.zeros(S, L, self.feats.shape[1], dtype=self.feats.dtype, device=dev)
            next_token = torch.zeros(S, L, dtype=torch.long, device=dev)
            if held:
                rows = torch.tensor(held, device=dev)
                feats[rows], next_token[rows] = self.feats[at], self.next_token[at]
        left = [(j, r) for j, r in enumerate(missing) if r not in held]
        for j, r in left:  # captured now, no place for them
            n = fresh.feats[self.layers[0]].shape[1]
            feats[r, :n] = torch.cat([fresh.feats[layer][j] for layer in self.layers], -1)
            if fresh.next_token is not None:
                next_token[r, :n] = fresh.next_token[j]
        H = self.hidden
        out = Targets({layer: feats[..., i * H:(i + 1) * H] for i, layer in enumerate(self.layers)})
        if bool(batch.sampled.any()):
            out.next_token = next_token
        return out
