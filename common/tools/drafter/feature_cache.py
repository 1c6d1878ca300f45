"""The frozen target's features of training sequences, kept on the device between passes.

A run passes over its data many times (10-17 passes in the one command), and the target says the
same about a sequence each time: its capture layers' residual stream and its greedy next tokens.
On a GPU that pass is a large part of a step (the drafter's own work depends on the anchors, not
the sequence's length), so a sequence captured once is read back afterwards.

Places are given before training, whole sequences in order of how often an epoch meets them
(`--source-repeat` makes some come twice, others every other epoch), then shortest first (a batch
is of like lengths, so it is then mostly read back whole or captured whole): each goes where it
still fits. A sequence is stored the first time it
is captured; the others are captured every time they come. `Places` is the plan alone, so that
the step planner can replay it. Sequences are keyed by object identity: the run's EpochOrder
holds them for the whole run, so a key is never reused. A batch's sequences not read back are
captured together, in rows rounded up (capture_rows) so that the shapes the target runs repeat.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from common.tools.drafter.objective import Batch, Targets, padded_length, select_rows

# The rows of a partial capture (a batch's sequences not read back) are rounded up to a multiple of
# this, at most the batch's: a batch shape's first run costs about 145 ms more than the same
# shape again on an H100, and with every count from 1 to 64 a run of 2026-12-07 most likely met
# new capture shapes in most steps of its second and third passes, which ran slower than its first.
ROW_MULTIPLE = 8


def capture_rows(rows: list[int], size: int) -> list[int]:
    """rows, some repeated, up to the next multiple of ROW_MULTIPLE (at most size): the rows a
    partial capture runs (the repeats are not read)."""
    n = min(size, -(-len(rows) // ROW_MULTIPLE) * ROW_MULTIPLE)
    return [rows[i % len(rows)] for i in range(n)]


def capture_shape(lengths: list[int], size: int) -> tuple[int, int]:
    """The (rows, padded length) that capturing sequences of these lengths out of a batch of size runs."""
    return len(capture_rows(lengths, size)), padded_length(max(lengths))


class Places:
    """Where each placed sequence (by key) goes, and which of them are stored by now."""

    def __init__(self, sizes: list[tuple[int, int]], capacity: int):
        """sizes: (key, tokens) in order of priority; each goes where it still fits."""
        self.start: dict[int, int] = {}
        self.used = 0
        for key, n in sizes:
            if key not in self.start and self.used + n <= capacity:
                self.start[key] = self.used
                self.used += n
        self.stored: set[int] = set()

    def store(self, keys) -> None:
        """These sequences were captured: those with a place are held from now on."""
        self.stored.update(key for key in keys if key in self.start)

    def copy(self) -> "Places":
        """A copy to replay stores on: its own `stored`, the same (never changed) `start`."""
        out = Places([], 0)
        out.start, out.used, out.stored = self.start, self.used, set(self.stored)
        return out


class FeatureCache:
    """Features [layers, places, H] and greedy next tokens [places] of placed sequences; layer
    by layer, so that a read gives each layer contiguous, as capture does."""

    def __init__(self, places: Places, layers: tuple[int, ...], hidden: int, dtype: torch.dtype,
                 device: torch.device):
        self.places, self.layers = places, layers
        self.feats = torch.empty(len(layers), places.used, hidden, dtype=dtype, device=device)
        self.next_token = torch.zeros(places.used, dtype=torch.long, device=device)
        self.hits = self.misses = 0  # sequences read back / captured (stored or not)

    @staticmethod
    def bytes_per_token(layers: tuple[int, ...], hidden: int, dtype: torch.dtype) -> int:
        return len(layers) * hidden * dtype.itemsize + 8

    def targets(self, batch: Batch, capture: Callable[[Batch], Targets]) -> Targets:
        """The batch's Targets (features, and greedy next tokens where it holds sampled answers),
        read back where stored, captured (and stored if placed) where not."""
        stored, start = self.places.stored, self.places.start
        missing = [r for r, key in enumerate(batch.keys) if key not in stored]
        self.hits += batch.size - len(missing)
        self.misses += len(missing)
        if len(missing) == batch.size and not any(key in start for key in batch.keys):
            return capture(batch)  # nothing to store or read back (the held-out check's batches)
        fresh = capture(select_rows(batch, capture_rows(missing, batch.size))) if missing else None
        placed = [(j, batch.keys[r], len(batch.tokens[r])) for j, r in enumerate(missing) if batch.keys[r] in start]
        if placed:  # one gather and one write a layer, not a copy per sequence and layer (320 a step of 64)
            dst = torch.cat([torch.arange(start[key], start[key] + n) for _, key, n in placed]).to(self.feats.device)
            row = torch.cat([torch.full((n,), j) for j, _, n in placed]).to(self.feats.device)
            pos = torch.cat([torch.arange(n) for _, _, n in placed]).to(self.feats.device)
            for i, layer in enumerate(self.layers):
                self.feats[i, dst] = fresh.feats[layer][row, pos]
            if fresh.next_token is not None:
                self.next_token[dst] = fresh.next_token[row, pos]
        self.places.store(batch.keys[r] for r in missing)
        return self._read(batch, missing, fresh)

    def _read(self, batch: Batch, missing: list[int], fresh: Targets | None) -> Targets:
        S, L = batch.ids.shape
        dev = self.feats.device
        held = [r for r in range(S) if batch.keys[r] in self.places.stored]  # stored just now too
        # Past a sequence's end its last token's place is read again: no block reads there.
        starts = torch.tensor([self.places.start[batch.keys[r]] for r in held], device=dev)
        last = torch.tensor([len(batch.tokens[r]) - 1 for r in held], device=dev)
        at = starts[:, None] + torch.minimum(torch.arange(L, device=dev)[None, :], last[:, None])
        if len(held) == S:
            feats, next_token = self.feats[:, at], self.next_token[at]
        else:
            feats = torch.zeros(len(self.layers), S, L, self.feats.shape[2], dtype=self.feats.dtype, device=dev)
            next_token = torch.zeros(S, L, dtype=torch.long, device=dev)
            rows = torch.tensor(held, dtype=torch.long, device=dev)
            feats[:, rows], next_token[rows] = self.feats[:, at], self.next_token[at]
            left = [(j, r) for j, r in enumerate(missing) if batch.keys[r] not in self.places.start]
            if left:  # captured now, without a place
                j, r = (torch.tensor(x, device=dev) for x in zip(*left))
                n = fresh.feats[self.layers[0]].shape[1]
                for i, layer in enumerate(self.layers):
                    feats[i, r, :n] = fresh.feats[layer][j]
                if fresh.next_token is not None:
                    next_token[r, :n] = fresh.next_token[j]
        out = Targets({layer: feats[i] for i, layer in enumerate(self.layers)})
        if bool(batch.sampled.any()):
            out.next_token = next_token
        return out
