"""Every greedy decode step's CUDA graph, captured before the engine serves.

A graph is captured the first time its key (batch size, block, sampling mode, catch-up width)
comes up, and capturing takes tens of milliseconds on a GPU, eagerly, with its products' kernels
timed on first use (common.model.gemv): a capture in the middle of serving stalls every request of
the batch, and one in a benchmark's timed run is counted against the step that asked for it. On
the H200 the speculating engine met such keys only while timed (batch sizes that no warm-up had
used as requests finished, the catch-up width that follows a change of block), and a grid point
ran at half the speed its graphs replay at. So at start-up, over synthetic requests, every batch
size that steps run at takes each step it may be asked for in greedy mode: a plain step (and, in
a speculating engine, a plain step that catches up a full pending buffer) and each block that
can be chosen, catching up as a step after that block does and as one after anything else does,
and with draft-ahead (steps of up to `Decoder.ahead_rows` rows) each block drafting ahead, and verifying the
drafts kept ahead; the blocks only a choice from the drafter's confidence takes
(`SpecPolicy.confident_only`) only verify drafts kept ahead, at the batch sizes that draft ahead.
Sampling modes (temperature, top-k / top-p) are still captured when first asked for.
"""
from __future__ import annotations

import logging
import time

import torch

from common.engine.decoder import DRAFT_AHEAD, FROM_AHEAD, NO_AHEAD, Decoder
from common.engine.sampler import Mode
from common.engine.step_costs import SHORT, synthetic_requests

logger = logging.getLogger(__name__)


def steps(decoder: Decoder, blocks: list[int], rows: int = 1, confident: list[int] = ()
          ) -> list[tuple[int, int, int]]:
    """(block, catch-up width, draft-ahead kind) of every greedy step of `rows` rows the decoder
    may take; block 0 is plain. `confident`: blocks only a choice from the drafter's confidence
    takes, which verify drafts kept ahead and nothing else."""
    if decoder.proposer is None:
        return [(0, 0, NO_AHEAD)]
    width = decoder.proposer.pending_width
    todo = {(0, 0, NO_AHEAD), (0, width, NO_AHEAD)}
    for b in blocks:
        if decoder.may_draft_ahead(rows, b):
            todo |= {(b, b, DRAFT_AHEAD), (b, width, DRAFT_AHEAD), (b, 0, FROM_AHEAD)}
        else:
            todo |= {(b, b, NO_AHEAD), (b, width, NO_AHEAD)}
    todo |= {(b, 0, FROM_AHEAD) for b in confident if decoder.may_draft_ahead(rows, b)}
    return sorted(todo)


def warm_graphs(decoder: Decoder, blocks: list[int], confident: list[int] = ()) -> None:
    """Capture every step of steps() at every batch size (nothing without CUDA graphs)."""
    if not decoder.graphs.enabled:
        return
    start, before = time.perf_counter(), decoder.graphs.captures
    todo = {rows: steps(decoder, blocks, rows, confident) for rows in decoder.step_sizes}
    widest = max(max(b, c) for kinds in todo.values() for b, c, _ in kinds)
    context = min(SHORT, decoder.runner.cfg.max_position // 4)
    with torch.inference_mode():
        for rows in decoder.step_sizes:
            with synthetic_requests(decoder, rows, widest, context) as reqs:
                for block, catch_up, ahead in todo[rows]:
                    if (rows, block, Mode.GREEDY, catch_up, ahead) not in decoder.graphs:
                        decoder.read(decoder.launch(reqs, block, catch_up, ahead), reqs)
    logger.info("captured %d decode graphs in %.1f s", decoder.graphs.captures - before, time.perf_counter() - start)
