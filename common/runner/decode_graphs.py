"""Decode steps through static buffers, captured once per batch size as CUDA graphs.

A decode step adds one token to each of n requests. Its inputs go into fixed buffers sized
for a capture batch size bs >= n (the smallest that fits):

  per row   token id, position, cache slot to write, context length, page table padded to
            max_pages with the scratch page
  padding   rows n..bs-1: token 0 at position 0, writing and reading only the scratch slot
            (context length 1), so they compute garbage that nobody reads and touch no page
            a request owns

The host fills one pinned buffer and sends it with one asynchronous copy; the step then runs
without a host synchronisation until the caller reads the sampled tokens. With `capture`
(CUDA), each size's step is a torch.cuda.CUDAGraph replayed over these buffers; without it
(tests, gpu_check's profile) the same static path runs eagerly. `--no-cuda-graphs` does not
use this class at all: the runner then decodes through extend().
"""
from __future__ import annotations

import numpy as np
import torch

from common.kv.seq_cache import SeqCache
from common.model.attention import AttnMeta, cache_slot
from common.model.static_attention import StaticDecode, default_backend

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Columns of the packed input buffer: 4 scalars, then the page table.
_ID, _POS, _SLOT, _LEN, _PAGES = range(5)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, batch_sizes: tuple[int, ...] = BATCH_SIZES, *,
                 capture: bool = True, backend: str | None = None):
        self.runner = runner
        self.sizes = sorted(batch_sizes)
        self.capture = capture
        self.backend = backend or default_backend(runner.device)
        page_size = runner.page_size
        # Enough pages for the longest context the pool or the model allows.
        max_tokens = min(runner.cfg.max_position, runner.pool.num_pages * page_size)
        self.max_pages = -(-max_tokens // page_size)
        self.scratch_page = runner.scratch_slot // page_size
        shape = (self.sizes[-1], _PAGES + self.max_pages)
        self.host = torch.zeros(shape, dtype=torch.long, pin_memory=runner.device.type == "cuda")
        self.inputs = torch.zeros(shape, dtype=torch.long, device=runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # graph outputs, one per size
        self.copied: torch.cuda.Event | None = None  # the last input copy (CUDA)

    def fits(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, seqs: list[SeqCache], tokens: list[int]) -> torch.Tensor:
        """Logits [n, vocab] fp32 of one new token per request; seq lengths are not advanced
        (the runner does that). With graphs the logits are the graph's output buffer: read
        them before the next step."""
        n = len(seqs)
        bs = next(s for s in self.sizes if s >= n)
        if self.capture and not self.graphs:
            self._capture_all()
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        self._fill(seqs, tokens, bs)
        self.inputs[:bs].copy_(self.host[:bs], non_blocking=True)
        if self.inputs.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        if self.capture:
            self.graphs[bs].replay()
            return self.logits[bs][:n]
        return self._step(bs)[:n]

    def _fill(self, seqs: list[SeqCache], tokens: list[int], bs: int) -> None:
        page_size = self.runner.page_size
        h = self.host.numpy()  # shares memory; numpy writes are much cheaper than tensor ones
        self._pad(h[:bs])
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            pos = seq.length
            used = pos // page_size + 1
            h[i, _ID], h[i, _POS], h[i, _LEN] = tok, pos, pos + 1
            h[i, _SLOT] = cache_slot(seq.pages, pos, page_size)
            h[i, _PAGES:_PAGES + used] = seq.pages[:used]

    def _pad(self, rows: np.ndarray) -> None:
        """Make `rows` (a numpy view of the host buffer) padding: token 0 at position 0, context
        length 1, writing and reading only the scratch slot."""
        rows[:] = 0
        rows[:, _SLOT] = self.runner.scratch_slot
        rows[:, _LEN] = 1
        rows[:, _PAGES:] = self.scratch_page

    def _step(self, bs: int) -> torch.Tensor:
        """The decode forward over the first bs rows of the static inputs (what is captured)."""
        x = self.inputs[:bs]
        meta = AttnMeta(positions=x[:, _POS], write_slots=x[:, _SLOT], logit_rows=None,
                        static_decode=StaticDecode(x[:, _PAGES:], x[:, _LEN], self.backend))
        model = self.runner.model
        hidden, _ = model(x[:, _ID], self.runner.kv, meta)
        return model.logits(hidden)

    def _capture_all(self) -> None:
        """Capture every size, largest first, in one memory pool (a smaller graph reuses the
        larger one's activations). Inputs are all padding meanwhile: capture writes only the
        scratch page."""
        self._pad(self.host.numpy())
        self.inputs.copy_(self.host)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            # Warm up on a side stream (cuBLAS handles, Triton compilation), as capture requires.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for bs in self.sizes:
                    self._step(bs)
            torch.cuda.current_stream().wait_stream(side)
            # Filled in locally and published together: a capture that fails half way must not
            # leave some sizes without a graph while `self.graphs` looks captured.
            graphs: dict[int, torch.cuda.CUDAGraph] = {}
            logits: dict[int, torch.Tensor] = {}
            for bs in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                # thread_local: service threads (KV transfers, checksums) may use CUDA meanwhile
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits[bs] = self._step(bs)
                graphs[bs] = graph
            self.logits, self.graphs = logits, graphs
        torch.cuda.synchronize()
