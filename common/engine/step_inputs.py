"""The inputs of a decode step in fixed-size buffers, so that one CUDA graph per batch size
serves every step of that size.

Per row (request), int64 columns of one packed buffer:

  LAST   its last committed token (not yet in the cache)     SEED   its sampling seed
  LEN    tokens in its target cache                          TOPK   top-k (0 = off)
  STEP   the output position of the next token               TEMP   temperature (float64 bits)
  LEFT   tokens it may still emit (>= 1)                     TOPP   top-p (float64 bits)
  STATE  its state slot (models with KDA layers; else 0)
  PEND   tokens of its cache whose draft KV is not written yet (speculative engines)
  DSLOT  its row of their pending features (speculative engines; else 0)
  STOPS  `stop_width` token ids that end it (EOS unless ignore_eos, its stop ids), padded with -1
  PAGES  its target page table, then (speculative engines) its draft page table: `width` pages
         each, padded with the scratch page; the last column is always the scratch page

Padding rows (a batch of n padded to the graph's size) decode token 0 at position 0 with a
context of 1, reading and writing only the scratch pages (and state slot 0 and pending row 0,
which no request owns): they compute garbage nobody reads and touch no page a request owns.
The host fills one pinned buffer and sends it with one asynchronous copy; nothing in a step
reads the host. Between one step and the next a row's request mostly stays, and then only the
columns that a step moves are written again (LAST, LEN, STEP, LEFT, PEND): at batch 1 on a GPU
a step's whole host time is a tenth of the step, and filling every column was half of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.engine.request import Request
from common.engine.sampler import SamplingRows, row_values

LAST, LEN, STEP, LEFT, SEED, TOPK, TEMP, TOPP, STATE, PEND, DSLOT = range(11)
STOPS = 11
PADDING = (None,)  # what a padding row's fixed columns were written from


@dataclass
class StepView:
    """Device views of the first `rows` rows of the inputs."""

    last: torch.Tensor  # [rows]
    length: torch.Tensor  # [rows]
    step: torch.Tensor  # [rows]
    left: torch.Tensor  # [rows]
    stop_ids: torch.Tensor  # [rows, stop_width]
    pages: torch.Tensor  # [rows, width]
    draft_pages: torch.Tensor | None  # [rows, width]
    state_slot: torch.Tensor  # [rows]
    pending: torch.Tensor  # [rows]
    draft_slot: torch.Tensor  # [rows]
    packed: torch.Tensor  # [rows, columns]: all of the above's source

    @property
    def sampling(self) -> SamplingRows:
        """The rows' sampling inputs, on demand: a greedy step reads none of them, and in a CUDA
        graph each conversion is a kernel every replay pays."""
        x = self.packed
        return SamplingRows(x[:, TEMP].view(torch.float64).float(), x[:, TOPP].view(torch.float64).float(),
                            x[:, TOPK], x[:, SEED], x[:, STEP])


class StepInputs:
    def __init__(self, max_rows: int, width: int, scratch_page: int, draft_scratch_page: int | None,
                 device: torch.device, stop_width: int = 8):
        self.max_rows, self.width, self.stop_width = max_rows, width, stop_width
        self.scratch_page, self.draft_scratch_page = scratch_page, draft_scratch_page
        self.pages_at = STOPS + stop_width
        self.draft_at = self.pages_at + width
        cols = self.draft_at + (width if draft_scratch_page is not None else 0)
        self.host = torch.zeros((max_rows, cols), dtype=torch.long, pin_memory=device.type == "cuda")
        self.device = torch.zeros((max_rows, cols), dtype=torch.long, device=device)
        self._h = self.host.numpy()  # shares memory; numpy writes are much cheaper than tensor ones
        # Per row, what its columns that do not move were written from: (request, its caches'
        # page lists, their lengths and slots), PADDING, or None before the row's first fill.
        self._written: list[tuple | None] = [None] * max_rows
        self._copied = torch.cuda.Event() if self.device.is_cuda else None  # the last host -> device copy

    def fill(self, reqs: list[Request], rows: int, eos_ids: tuple[int, ...]) -> None:
        """Rows 0..len(reqs)-1 from the requests, the rest up to `rows` padding; then send them."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        h = self._h
        for i in range(len(reqs), rows):
            if self._written[i] is not PADDING:
                self._pad(h[i:i + 1])
                self._written[i] = PADDING
        for i, req in enumerate(reqs):
            c, d = req.cache, req.draft_cache
            source = (req, c.pages, len(c.pages), c.state_slot, d.pages, len(d.pages), d.state_slot)
            written = self._written[i]
            if written is None or written[0] is not req or written[1:] != source[1:]:
                self._written[i] = None  # until the row is whole again
                self._write_fixed(h, i, req, eos_ids)
                self._written[i] = source
            h[i, LAST], h[i, LEN], h[i, STEP] = req.output_ids[-1], c.length, len(req.output_ids)
            h[i, LEFT] = req.params.max_new_tokens - len(req.output_ids)
            if self.draft_scratch_page is not None:
                h[i, PEND] = c.length - d.length
        self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _write_fixed(self, h: np.ndarray, i: int, req: Request, eos_ids: tuple[int, ...]) -> None:
        """Row i's columns that stay while the request does: sampling, stops, slots, pages."""
        self._pad(h[i:i + 1])
        p = req.params
        temp, top_p, top_k, seed = row_values(p, req.seed)
        h[i, SEED], h[i, TOPK] = seed, top_k
        floats = h.view(np.float64)
        floats[i, TEMP], floats[i, TOPP] = temp, top_p
        h[i, STATE] = req.cache.state_slot
        stops = req.stop_ids(eos_ids)
        h[i, STOPS:STOPS + len(stops)] = stops
        usable = self.width - 1  # page columns; the last is the scratch page's
        pages = req.cache.pages[:usable]
        h[i, self.pages_at:self.pages_at + len(pages)] = pages
        if self.draft_scratch_page is not None:
            h[i, DSLOT] = req.draft_cache.state_slot
            draft = req.draft_cache.pages[:usable]
            h[i, self.draft_at:self.draft_at + len(draft)] = draft

    def _pad(self, rows: np.ndarray) -> None:
        rows[:] = 0
        rows[:, LEFT] = 1
        rows.view(np.float64)[:, TOPP] = 1.0
        rows[:, STOPS:self.pages_at] = -1
        rows[:, self.pages_at:self.draft_at] = self.scratch_page
        if self.draft_scratch_page is not None:
            rows[:, self.draft_at:] = self.draft_scratch_page

    def view(self, rows: int, width: int | None = None) -> StepView:
        """The first `rows` rows; page tables cut to `width` columns (the last one of them
        scratch) where shapes may change from step to step (no CUDA graphs)."""
        x = self.device[:rows]
        w = self.width if width is None else width

        def table(at: int) -> torch.Tensor:
            if w == self.width:
                return x[:, at:at + w]
            # Columns past the row's pages hold its scratch page: keep w - 1, then that column.
            return torch.cat([x[:, at:at + w - 1], x[:, at + self.width - 1:at + self.width]], 1)

        return StepView(x[:, LAST], x[:, LEN], x[:, STEP], x[:, LEFT], x[:, STOPS:self.pages_at],
                        table(self.pages_at), table(self.draft_at) if self.draft_scratch_page is not None else None,
                        x[:, STATE], x[:, PEND], x[:, DSLOT], x)
