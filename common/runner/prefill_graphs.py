"""A fresh prompt's prefill through a CUDA graph.

Eager prefill launches every kernel from Python. On an H200 a 96-token prompt of the embedded
model took 25 ms of host time for 2.8 ms of GPU work (648 kernels): in every request's time to
the first token, and in the decode steps of every request that waits while it runs. A step that
prefills one prompt from its start (nothing cached), at most MAX_TOKENS tokens, instead replays a
graph captured for its length rounded up (padded_length: a power of two up to STEP tokens, a
multiple of STEP above, so that a model whose prefill is bound by compute, not by launches, pays
for at most STEP - 1 padding tokens past STEP; 10 graphs at the defaults). The padding
tokens come after the prompt, so causal attention keeps them out of every prompt token's result;
they write their K/V into the scratch slot, and their hidden states are never read. Models with
KDA layers keep eager prefill: their recurrent state would run on over the padding.

The same code runs eagerly where graphs are off (GraphCache), which is how the CPU tests check
that padding changes nothing.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from common.model.attention import AttnMeta, table_slots
from common.model.transformer import Transformer
from common.runner.graphs import GraphCache

logger = logging.getLogger(__name__)

MIN_TOKENS, STEP, MAX_TOKENS = 16, 64, 512


def padded_length(n: int) -> int:
    """The graph length a prompt of n tokens runs at."""
    if n <= STEP:
        return max(MIN_TOKENS, 1 << (n - 1).bit_length())
    return -(-n // STEP) * STEP


class PrefillGraphs:
    def __init__(self, model: Transformer, cache: torch.Tensor, page_size: int, scratch_slot: int,
                 max_position: int, device: torch.device, graphs: bool):
        self.model = model
        self.cache = cache
        self.page_size = page_size
        self.scratch_slot = scratch_slot
        self.graphs = GraphCache(graphs)
        self.max_tokens = min(MAX_TOKENS, padded_length(max_position))
        # Inputs of the longest graph; shorter ones use the front of each row.
        # Rows: token ids, cache slots, and (first column) the last prompt token's row.
        pinned = device.type == "cuda"
        self.host = torch.zeros((3, self.max_tokens), dtype=torch.long, pin_memory=pinned)
        self.inputs = torch.zeros((3, self.max_tokens), dtype=torch.long, device=device)
        self._copied: torch.cuda.Event | None = None  # the last host -> device copy (CUDA)
        # Padding past the model's context reads the last RoPE row: it is never attended to.
        self.positions = torch.arange(self.max_tokens, device=device).clamp(max=max_position - 1)

    def fits(self, starts: list[int], counts: list[int]) -> bool:
        """One prompt from its start, short enough."""
        return len(starts) == 1 and starts[0] == 0 and 0 < counts[0] <= self.max_tokens

    @torch.inference_mode()
    def run(self, pages: list[int], tokens: list[int], capture_layers: tuple[int, ...]
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Final-normed hidden state of the prompt's last token [1, hidden], and the captured
        layers' residual streams of its tokens [n, hidden]. Read before the next run."""
        n = len(tokens)
        T = padded_length(n)
        self._fill(pages, tokens, T)
        hidden, captured = self.graphs.run((T, capture_layers), self._step(T, capture_layers))
        return hidden, {layer: h[:n] for layer, h in captured.items()}

    @torch.inference_mode()
    def warm(self, capture_layers: tuple[int, ...]) -> None:
        """Capture every length's graph now, over padding alone (scratch slots only): a capture
        while serving would stall the requests of the step that asked for it."""
        start, before = time.perf_counter(), self.graphs.captures
        for T in sorted({padded_length(n) for n in range(1, self.max_tokens + 1)}):
            if (T, capture_layers) not in self.graphs:
                self._fill([], [], T)
                self.graphs.capture((T, capture_layers), self._step(T, capture_layers))
        if self.graphs.captures > before:
            logger.info("captured %d prefill graphs in %.1f s", self.graphs.captures - before,
                        time.perf_counter() - start)

    def _fill(self, pages: list[int], tokens: list[int], T: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has left the pinned buffer
        h = self.host.numpy()
        n = len(tokens)
        h[0, :n], h[0, n:T] = tokens, 0
        h[1, :n] = table_slots(torch.tensor([pages], dtype=torch.long), torch.arange(n)[None], self.page_size)[0]
        h[1, n:T] = self.scratch_slot
        h[2, 0] = max(n - 1, 0)
        # The whole buffer (12 KB at 512 tokens): a slice of its rows is not contiguous, and such a
        # copy goes through a temporary in pageable memory instead of straight from the pinned one.
        self.inputs.copy_(self.host, non_blocking=True)
        if self.inputs.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _step(self, T: int, capture_layers: tuple[int, ...]
              ) -> Callable[[], tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        x = self.inputs

        def step() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
            meta = AttnMeta(self.positions[:T], x[1, :T], x[2, :1], fresh_causal=True)
            return self.model(x[0, :T], self.cache, meta, capture_layers)
        return step
