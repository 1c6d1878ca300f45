"""The decode steps of an engine's running batch, through static inputs and, on a GPU, CUDA graphs.

A step is plain (one token per request) or speculative with a block of B:

  0. catch up  draft KV of the tokens committed since the last catch-up, from their pending
               features (below)
  1. draft     drafter: block [t, MASK x (B-1)] at positions n..n+B-1 -> drafts d1..d(B-1)
  2. verify    target: [t, d1..d(B-1)] at positions n..n+B-1, capturing the drafter's layers;
               c_j = the target's own choice after t, d1..dj (argmax, or a draw keyed by the
               request's seed and the output position, exactly as plain decoding draws it)
  3. accept    k = longest prefix with d_j == c_j; the candidates are c_0..c_k (c_j = d_(j+1)
               for j < k, and c_k is the bonus token). Each is the target's own choice given the
               same prefix, so the output equals plain decoding token for token.
  4. stop      commit c_0..c_(m-1), m = min(k + 1, first stop token + 1, tokens left)
  5. caches    the target KV of t, d1..dk is in place (positions n..n+k); later positions hold
               rejected tokens' K/V past the new length, overwritten by the next step before any
               query reads them. A recurrent state (KDA layers) cannot be overwritten so: verify
               leaves it as it was, and the runner advances it by the m committed tokens
               (commit_block). The captured states of all B tokens become the row's pending
               features; the first m of them count.

With draft-ahead (`ahead`), a speculative step ends by drafting the next block (6. catch up
the committed tokens' draft KV, then draft a whole block after the last of them), keeps those
drafts on the device, and hands the drafter's confidence in each to the host with the committed
tokens: the policy then chooses the next block from how sure the drafter is of the drafts it
would verify (common.engine.confidence), and the next step, if every request in it has drafts
ahead, verifies them without catching up or drafting first (1. and 0. skipped). Only steps of
up to `ahead_rows` requests draft ahead (AHEAD_ROWS).

All of it is tensor operations on the device (one CUDA graph per batch size, block, sampling
mode, catch-up width and draft-ahead kind); the host reads the committed tokens once per step
and does the bookkeeping. A plain step in a speculative engine only keeps its token's captured
states (one copy), so that it costs what a plain step without speculation costs; the draft KV of the tokens
plain steps commit is written when the request next speculates, all of them at once, or when
its pending features are full. Steps of more requests than the largest batch size run in
several steps of that size.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from common.engine.proposer import Proposer
from common.engine.request import Request
from common.engine.sampler import Mode, mode_of, sample_rows
from common.engine.spec_policy import SpecPolicy
from common.engine.step_clock import StepClock
from common.engine.step_inputs import StepInputs, StepView
from common.engine.verdict import verdict
from common.model.attention import table_slots
from common.model.static_attention import StaticAttn
from common.runner.graphs import GraphCache
from common.runner.model_runner import ModelRunner

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# A speculative step's draft-ahead kind: none; draft first and draft ahead; verify the drafts
# kept ahead, and draft ahead.
NO_AHEAD, DRAFT_AHEAD, FROM_AHEAD = 0, 1, 2
# Steps of at most this many requests draft ahead. At one row a step costs its launches more
# than its rows, and a whole block drafted ahead costs little more than the block verified; at 8
# rows on an H100 a block of 4 drafting 16 ahead cost 1.76 plain steps against 1.45 drafting 4
# first, more than choosing the block by confidence won (docs/PERFORMANCE.md, 2026-12-05 (late
# afternoon)).
AHEAD_ROWS = 1


class Decoder:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...], proposer: Proposer | None = None,
                 policy: SpecPolicy | None = None, batch_sizes: tuple[int, ...] = BATCH_SIZES,
                 max_requests: int = 0, ahead: bool = False):
        self.runner = runner
        self.ahead = ahead and proposer is not None and policy is not None
        self.ahead_rows = AHEAD_ROWS
        self.eos_token_ids = eos_token_ids
        self.proposer = proposer
        self.policy = policy
        self.sizes = sorted(batch_sizes)
        self.max_requests = max_requests
        self.capture = proposer.capture_layers if proposer is not None else ()
        if proposer is not None:  # the largest verify step it may take, before any is captured
            block = policy.max_block if policy is not None else proposer.block_size
            runner.reserve_blocks(self.sizes[-1], block)
            # A verify step's block, and as many plain steps again before a catch-up must run; a
            # row for every request the engine may run (`max_requests`), since a larger buffer
            # later means capturing every graph again while requests wait.
            proposer.reserve_pending(2 * block, max(self.sizes[-1], max_requests))
        self.graphs = GraphCache(runner.use_graphs)
        self.clock: StepClock | None = None  # set on CUDA to time each step on the device (benchmarks)
        self._make_inputs(stop_width=8)

    def _make_inputs(self, stop_width: int) -> None:
        runner, proposer = self.runner, self.proposer
        self.inputs = StepInputs(self.sizes[-1], runner.max_pages + 1, runner.scratch_page,
                                 None if proposer is None else proposer.scratch_slot // runner.page_size,
                                 runner.device, stop_width)
        self.graphs.clear()  # captured over the old inputs

    @property
    def max_rows(self) -> int:
        """The most rows one step runs: the largest batch size, or the engine's requests if fewer."""
        return min(self.sizes[-1], self.max_requests) if self.max_requests else self.sizes[-1]

    @property
    def step_sizes(self) -> list[int]:
        """The graph batch sizes steps run at: each size up to the one that max_rows pads to."""
        return [s for s in self.sizes if s < self.max_rows] + [next(s for s in self.sizes if s >= self.max_rows)]

    @torch.inference_mode()
    def step(self, reqs: list[Request]) -> list[list[int]]:
        """Advance every request by one step; returns the tokens committed for each."""
        committed = []
        if self.policy is not None:
            self.policy.new_step(reqs)
        for i in range(0, len(reqs), self.max_rows):
            chunk = reqs[i:i + self.max_rows]
            block = self.policy.choose(chunk) if self.policy is not None else 0
            ahead = self.ahead_kind(chunk, block)
            if self.ahead and not ahead:  # drafts kept ahead are of no use past a step that does not verify them
                for r in chunk:
                    if r.spec is not None:
                        r.spec.ahead = None
            catch_up = self.catch_up(chunk, block, ahead)
            if self.policy is None:
                out = self.read(self.launch(chunk, block, catch_up), chunk)
            else:
                context = sum(r.cache.length for r in chunk) / len(chunk)
                captured, start = self.graphs.captures, time.perf_counter()
                out = self.launch(chunk, block, catch_up, ahead)
                # The next step of the same batch (only when in one chunk), weighed while the device
                # runs this one; after a draft-ahead all but the drafter's confidence, which this
                # step's output brings.
                if len(reqs) <= self.max_rows:
                    if ahead:
                        self.policy.weigh_confident(chunk)
                    else:
                        self.policy.ahead(chunk)
                out = self.read(out, chunk)
                # A step's time prices its kind unless it captured a graph, or it is a speculative
                # step catching up more than a step after one of its own does: the draft KV of
                # tokens that plain steps committed, which a plain step writes when its pending
                # buffer is full, and which is part of the plain price. With draft-ahead a block's
                # price is a step's that verifies drafts kept ahead: one that drafts first as well
                # (after plain steps) is not timed.
                timed = block == 0 or (catch_up <= block and ahead != DRAFT_AHEAD)
                if self.graphs.captures == captured and timed:
                    self.policy.timed(len(chunk), block, context, time.perf_counter() - start)
                else:
                    self.policy.untimed(block)
            committed += self._commit(chunk, out, block, catch_up, ahead)
        return committed

    def ahead_kind(self, reqs: list[Request], block: int) -> int:
        """The draft-ahead kind of a step of `block` (0: plain) for these requests."""
        if not self.may_draft_ahead(self._rows(reqs), block):
            return NO_AHEAD
        return FROM_AHEAD if all(r.spec.ahead is not None for r in reqs) else DRAFT_AHEAD

    def may_draft_ahead(self, rows: int, block: int) -> bool:
        """Whether a step of `block` (0: plain) that runs `rows` rows drafts ahead."""
        return self.ahead and 0 < block <= self.proposer.block_size and rows <= self.ahead_rows

    def catch_up(self, reqs: list[Request], block: int, ahead: int = NO_AHEAD) -> int:
        """How many pending tokens per row the step writes into the draft KV first (0: none).
        A plain step keeps its token's features while every row has room for them; a
        speculative step drafts from the whole context, reading B per row where that covers
        every row's pending tokens (as after a step of B), else the whole buffer; one that
        verifies drafts kept ahead has nothing pending (the step before wrote what it committed)."""
        if self.proposer is None or ahead == FROM_AHEAD:  # the step before caught up all it committed
            return 0
        pending = max(r.cache.length - r.draft_cache.length for r in reqs)
        width = self.proposer.pending_width
        if block == 0 and pending < width:
            return 0
        if not self.graphs.enabled:  # shapes may vary: only as wide as this step needs
            return pending
        return block if pending <= block else width

    def run(self, reqs: list[Request], block: int) -> np.ndarray:
        """One step of at most max_rows requests (0 = plain); its output rows on the host:
        plain: [token]; speculative: [c_0 .. c_(B-1), k, m], then with a draft-ahead the
        drafter's log-probability of each draft of the next block (float64 bits)."""
        ahead = self.ahead_kind(reqs, block)
        return self.read(self.launch(reqs, block, self.catch_up(reqs, block, ahead), ahead), reqs)

    @staticmethod
    def read(out: torch.Tensor, reqs: list[Request]) -> np.ndarray:
        return out[:len(reqs)].cpu().numpy()  # the step's one host synchronisation

    def launch(self, reqs: list[Request], block: int, catch_up: int, ahead: int = NO_AHEAD) -> torch.Tensor:
        """Start run()'s step, first catching up `catch_up` pending tokens per row; its output
        rows on the device (padding rows after them)."""
        stops = max(len(r.stop_ids(self.eos_token_ids)) for r in reqs)
        if stops > self.inputs.stop_width:
            self._make_inputs(max(stops, 2 * self.inputs.stop_width))
        if self.proposer is not None and self.proposer.hold_slots([r.draft_cache for r in reqs]):
            self._make_inputs(self.inputs.stop_width)
        graphs = self.graphs.enabled
        rows = self._rows(reqs)
        mode = mode_of([r.params for r in reqs])
        # Without graphs shapes may vary: page tables only as wide as this step needs (a block
        # drafted ahead reaches a whole drafter block past the committed tokens).
        reach = max(block, 1) + (self.proposer.block_size if ahead else 0)
        width = None if graphs else self._width(reqs, reach)
        key = (rows, block, mode, catch_up, ahead)
        step = (lambda: self._speculative(rows, block, mode, width, catch_up, ahead)) if block else \
            (lambda: self._plain(rows, mode, width, catch_up))
        if graphs and key not in self.graphs:
            # Capturing runs the step once eagerly first: on padding rows only (scratch pages, state
            # slot 0), so that what a step advances in place (a KDA layer's state) moves once, at
            # the replay below.
            self.inputs.fill([], rows, self.eos_token_ids)
            self.graphs.capture(key, step)
        self.inputs.fill(reqs, rows, self.eos_token_ids)
        if self.clock is None:
            return self.graphs.run(key, step)
        self.clock.start()
        out = self.graphs.run(key, step)
        self.clock.stop(block)
        return out

    def _rows(self, reqs: list[Request]) -> int:
        """The rows a step of these requests runs: with CUDA graphs, the batch size it pads to."""
        return next(s for s in self.sizes if s >= len(reqs)) if self.graphs.enabled else len(reqs)

    def _width(self, reqs: list[Request], tokens: int) -> int:
        page = self.runner.page_size
        return min(max(-(-(r.cache.length + tokens) // page) for r in reqs) + 1, self.inputs.width)

    # ---- the steps (captured as CUDA graphs) ----------------------------------------------
    def _plain(self, rows: int, mode: Mode, width: int | None, catch_up: int) -> torch.Tensor:
        v = self.inputs.view(rows, width)
        self._catch_up(v, catch_up)
        positions = v.length[:, None]
        hidden, captured = self._target(v, v.last, positions)
        tokens = sample_rows(self.runner.model.logits(hidden), None if mode == Mode.GREEDY else v.sampling, mode)
        self._keep(v, captured, catch_up)
        return tokens[:, None]

    def _speculative(self, rows: int, B: int, mode: Mode, width: int | None, catch_up: int, ahead: int
                     ) -> torch.Tensor:
        v = self.inputs.view(rows, width)
        if ahead == FROM_AHEAD:
            drafts = self.proposer.ahead(v.draft_slot, B)
        else:
            self._catch_up(v, catch_up)                                                          # 0
            drafts = self.proposer.draft(v.last, v.length, v.draft_pages, B)                   # 1
        offsets = torch.arange(B, device=drafts.device)
        positions = v.length[:, None] + offsets[None, :]
        hidden, captured = self._target(v, torch.cat([v.last[:, None], drafts], 1).flatten(), positions)  # 2
        sampling = None if mode == Mode.GREEDY else v.sampling.repeat(B, offsets)
        choices = sample_rows(self.runner.model.logits(hidden), sampling, mode).view(rows, B)
        out = verdict(drafts, choices, v.stop_ids, v.left)                                       # 3, 4
        self.runner.commit_block(v.state_slot, out[:, B + 1], B)                                 # 5
        self._keep(v, captured, catch_up)
        if ahead:
            out = torch.cat([out, self._draft_ahead(v, out, B)], 1)                             # 6
        return out

    def _draft_ahead(self, v: StepView, out: torch.Tensor, B: int) -> torch.Tensor:
        """The draft KV of the step's committed tokens (its B tokens' features are pending from
        column 0: the step caught up, or had nothing pending), then the next block's drafts after
        the last of them; the drafter's confidence in each as int64 columns (float64 bits)."""
        count = out[:, B + 1]
        last = out[:, :B].gather(1, (count - 1)[:, None])[:, 0]
        self.proposer.catch_up(v.draft_slot, v.length, v.draft_pages, B)
        confidence = self.proposer.draft_ahead(last, v.length + count, v.draft_pages, v.draft_slot)
        return confidence.double().view(torch.int64)

    def _catch_up(self, v: StepView, width: int) -> None:
        if width:
            self.proposer.catch_up(v.draft_slot, v.length - v.pending, v.draft_pages, width)

    def _keep(self, v: StepView, captured: dict[int, torch.Tensor], caught_up: int) -> None:
        """The step's tokens become pending features after those still pending."""
        if self.proposer is not None:
            self.proposer.keep(captured, v.draft_slot, None if caught_up else v.pending)

    def _target(self, v: StepView, token_ids: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The target over T = positions.shape[1] new tokens per row, causal, K/V written in place."""
        runner = self.runner
        T = positions.shape[1]
        attn = StaticAttn(v.pages, v.length + T, T, causal=True, backend=runner.static_backend)
        # Positions past the RoPE table belong to tokens past the request's budget (never committed).
        rope_positions = positions.clamp(max=runner.cfg.max_position - 1).flatten()
        slots = table_slots(v.pages, positions, runner.page_size).flatten()
        state_slots = v.state_slot if runner.state_pool is not None else None
        return runner.forward_static(token_ids, rope_positions, slots, attn, self.capture, state_slots)

    # ---- host bookkeeping ---------------------------------------------------------------------
    def _commit(self, reqs: list[Request], out: np.ndarray, block: int, caught_up: int, ahead: int = NO_AHEAD
                ) -> list[list[int]]:
        committed = []
        for req, row in zip(reqs, out):
            if block:
                k, count = int(row[block]), int(row[block + 1])
                tokens = row[:count].tolist()
                req.spec.record(min(k, count), block, k)
                self.policy.observe(k, block)
                if ahead == FROM_AHEAD:
                    self.policy.observe_confident(req.spec.ahead, k, block)
            else:
                tokens = [int(row[0])]
                if req.spec is not None:
                    req.spec.plain_steps += 1
            if ahead:
                req.spec.ahead = row[block + 2:].view(np.float64).tolist()
            req.append_tokens(tokens, self.eos_token_ids)
            if caught_up:
                req.draft_cache.length = req.cache.length
            req.cache.length += len(tokens)
            if ahead:  # the step wrote the draft KV of what it committed
                req.draft_cache.length = req.cache.length
            committed.append(tokens)
        return committed
