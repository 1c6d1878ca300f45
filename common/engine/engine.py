"""Continuous batching over a ModelRunner: admit, prefill in chunks, decode, finish.

One step is either a prefill step (chunks of waiting prompts, up to `chunk_size` tokens) or a
decode step (one token for every running request, or with a proposer a speculative step of
several: common.engine.decoder). Requests join and leave between steps, each at its own
length. Pages for a request's whole budget (prompt + max_new_tokens) are reserved at
admission, so running requests never stall or get retracted.

Not thread-safe: one thread calls add/abort/step (see common.service.engine_loop for services).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from common.engine.decoder import BATCH_SIZES, Decoder
from common.engine.proposer import ContextProposer, Proposer
from common.engine.request import Request
from common.engine.sampler import sample
from common.engine.sampling import InvalidRequest
from common.engine.spec_policy import SpecConfig, SpecPolicy
from common.engine.spec_stats import SpecStats
from common.engine.step_costs import step_costs
from common.engine.warm_graphs import warm_graphs
from common.kv.checksum import room_checksums
from common.kv.page_pool import OutOfPages
from common.runner.model_runner import ModelRunner


@dataclass
class StepOutput:
    req: Request
    new_ids: list[int]
    text: str
    finished: bool
    prefill_done: bool = False  # prefill-only engines: the prompt is cached, first token sampled
    # Prefill-only engines, after a chunk that is not the prompt's last: how many prompt tokens
    # are cached now (their pages may be sent while the next chunk computes), and on CUDA the
    # point on the device's stream where that chunk's KV is written (a reader waits for it).
    cached: int = 0
    ready: torch.cuda.Event | None = None


CHUNK_SIZE = 8192  # prompt tokens per prefill step, by default


class Engine:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...], *,
                 chunk_size: int = CHUNK_SIZE, max_running: int = 256, prefill_only: bool = False,
                 proposer: ContextProposer | Proposer | None = None, spec: SpecConfig = SpecConfig(),
                 batch_sizes: tuple[int, ...] = BATCH_SIZES):
        self.runner = runner
        # With a proposer, prefill also builds the prompt's draft KV and decode is speculative.
        self.proposer = proposer
        self.eos_token_ids = eos_token_ids
        self.chunk_size = chunk_size
        self.max_running = max_running
        # Prefill-only (a P instance): after the first token the request leaves the engine
        # with its pages still held; the caller transfers them and then calls release().
        self.prefill_only = prefill_only
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}  # wall time spent in each kind of step
        self.policy: SpecPolicy | None = None
        self.decoder: Decoder | None = None
        if not prefill_only:
            self._start_decoder(spec, batch_sizes)
        if runner.prefill_graphs is not None:
            runner.prefill_graphs.warm(proposer.capture_layers if proposer is not None else ())

    def _start_decoder(self, spec: SpecConfig, batch_sizes: tuple[int, ...]) -> None:
        proposer = self.proposer
        ahead = spec.ahead if spec.ahead is not None else self.runner.use_graphs and spec.block is None
        if proposer is not None:
            self.max_block = max(proposer.block_size, spec.block or 0)
            self.policy = SpecPolicy(self.max_block, spec, confident=ahead)
        self.decoder = Decoder(self.runner, self.eos_token_ids, proposer, self.policy, batch_sizes, self.max_running,
                               ahead=ahead)
        confident = [] if self.policy is None else self.policy.confident_only
        if self.policy is not None and spec.block is None:
            # Costs of plain and speculative steps on this device: what the policy weighs.
            self.policy.costs = step_costs(self.decoder, spec, self.policy.blocks, confident)
        blocks = [] if self.policy is None else [spec.block] if spec.block else self.policy.blocks
        warm_graphs(self.decoder, blocks, confident)

    # ---- requests in and out ---------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.params.validate(req.prompt_len, self.runner.cfg.max_position)
        if self.runner.pool.pages_for(self._budget(req)) > self.runner.pool.num_pages:
            raise InvalidRequest(f"request needs {self._budget(req)} tokens of KV cache; this instance holds "
                                 f"{self.runner.pool.num_pages * self.runner.page_size}")
        self.waiting.append(req)

    def add_prefilled(self, req: Request, first_token: int) -> StepOutput:
        """Join the decode batch with a prompt whose KV is already in req.cache (sent by P).
        The hand-off convention (P's side: prefill_svc.kv_sender): the cache, KDA state
        included, has consumed every prompt token and nothing more; the first sampled token
        goes through the model once, as the input of this request's first decode step."""
        if req.cache.length != req.prompt_len or req.output_ids:
            raise RuntimeError(f"room {req.rid}: a hand-off starts from a cache of exactly the prompt "
                               f"({req.cache.length} tokens cached, {req.prompt_len} in the prompt, "
                               f"{len(req.output_ids)} already generated)")
        if self.policy is not None and req.spec is None:
            req.spec = SpecStats(self.max_block)
        req.append_token(first_token, self.eos_token_ids)
        out = self._output(req, 1)
        if req.finished:
            self.release(req)
        else:
            self.running.append(req)
        return out

    def abort(self, rid: str) -> Request | None:
        for queue in (self.waiting, self.prefilling, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.finish_reason = "abort"
                    self.release(req)
                    return req
        return None

    def release(self, req: Request) -> None:
        if req.cache.pages or req.cache.state_slot:
            self.runner.release(req.cache)
        if req.draft_cache.pages or req.draft_cache.state_slot:
            self.proposer.release(req.draft_cache)

    def describe_buffers(self) -> list:
        """Every buffer a peer may read or write for a room: target KV (+ draft KV)."""
        return self.runner.describe_buffers() + (self.proposer.describe_buffers() if self.proposer else [])

    def room_checksums(self, req: Request) -> list[int]:
        """CRC32s of the room's prompt KV (and draft KV) as the whole model holds it: every rank's
        layers and heads, whatever the split (so P's and D's sums compare across TP/PP)."""
        kv = {"kv": self.runner.read_pages(req.cache.pages)}
        if self.proposer is not None:
            kv["draft_kv"] = self.proposer.read_pages(req.draft_cache.pages)
        return room_checksums(kv, {name: list(range(t.shape[2])) for name, t in kv.items()}, req.prompt_len)

    def room_pages(self, req: Request) -> dict[str, list[int]]:
        pages = self.runner.room_indices(req.cache)
        if self.proposer is not None:
            pages["draft_kv"] = list(req.draft_cache.pages)
        return pages

    def reserve(self, req: Request) -> None:
        """Pages for the request's budget in the target (and draft) cache, or OutOfPages with
        nothing held."""
        budget = self._budget(req)
        try:
            self.runner.reserve(req.cache, budget)
            if self.proposer is not None:
                self.proposer.reserve(req.draft_cache, budget)
        except OutOfPages:
            self.release(req)
            raise

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def run(self, reqs: Iterable[Request] = (), concurrency: int | None = None) -> Iterator[list[StepOutput]]:
        """Feed `reqs` in, at most `concurrency` in the engine at a time (all at once if None), and
        step until every request (also those added before) has finished; yields each step's outputs."""
        pending = deque(reqs)
        while pending or self.has_work:
            while pending and (concurrency is None or self.num_requests < concurrency):
                self.add(pending.popleft())
            yield self.step()

    def run_all(self, reqs: Iterable[Request] = (), concurrency: int | None = None) -> None:
        """run() to the end, for callers that only want the finished requests."""
        for _ in self.run(reqs, concurrency):
            pass

    @staticmethod
    def _output(req: Request, committed: int) -> StepOutput:
        """What a step gave a request; its text first, since a stop string in it drops the
        tokens a speculative step committed after it."""
        start = len(req.output_ids) - committed
        text = req.take_text()
        return StepOutput(req, req.output_ids[start:], text, req.finished)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._admit()
        kind = "prefill" if self.prefilling else "decode" if self.running else None
        if kind is None:
            return []
        start = time.perf_counter()
        outputs = self._prefill_step() if kind == "prefill" else self._decode_step()
        self.step_seconds[kind] += time.perf_counter() - start  # each step ends reading the device
        return outputs

    def _admit(self) -> None:
        while self.waiting and len(self.prefilling) + len(self.running) < self.max_running:
            req = self.waiting[0]
            try:
                self.reserve(req)
            except OutOfPages:
                return  # first come, first served: wait until pages return
            self.prefilling.append(self.waiting.popleft())

    def _budget(self, req: Request) -> int:
        if self.prefill_only:
            return req.prompt_len
        # A verify step writes a whole block past the committed length.
        return req.budget + (self.max_block if self.policy is not None else 0)

    def _prefill_step(self) -> list[StepOutput]:
        batch, chunks, budget = [], [], self.chunk_size
        for req in self.prefilling:
            if budget == 0:
                break
            n = min(req.prefill_remaining, budget)
            start = req.cache.length
            batch.append(req)
            chunks.append(req.prompt_ids[start:start + n])
            budget -= n
        capture = self.proposer.capture_layers if self.proposer else ()
        # Logits only of prompts this step finishes: a step of middle chunks needs none, so a
        # pipeline-parallel runner starts the next chunk while later stages still run this one.
        done = [i for i, (r, c) in enumerate(zip(batch, chunks)) if r.prefill_remaining == len(c)]
        out = self.runner.extend([r.cache for r in batch], chunks, capture_layers=capture, logits_of=done)
        if self.proposer:
            ends = torch.tensor([len(c) for c in chunks]).cumsum(0).tolist()
            rows = [torch.arange(e - len(c), e) for c, e in zip(chunks, ends)]
            self.proposer.append_context([r.draft_cache for r in batch], out.captured, rows)
        outputs = self._chunk_progress([r for i, r in enumerate(batch) if i not in done]) if self.prefill_only else []
        if not done:
            return outputs
        tokens = sample(out.logits, [batch[i].params for i in done], [0] * len(done), [batch[i].seed for i in done])
        for i, tok in zip(done, tokens):
            req = batch[i]
            self.prefilling.remove(req)
            if self.prefill_only:
                req.append_token(tok, self.eos_token_ids)
                outputs.append(StepOutput(req, [tok], "", req.finished, prefill_done=True))
            else:
                outputs.append(self.add_prefilled(req, tok))
        return outputs

    def _chunk_progress(self, reqs: list[Request]) -> list[StepOutput]:
        """An output per prompt whose prefill goes on, so that P can send what is cached already."""
        if not reqs:
            return []
        ready = None
        if self.runner.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return [StepOutput(r, [], "", False, cached=r.cache.length, ready=ready) for r in reqs]

    def _decode_step(self) -> list[StepOutput]:
        # Hand-offs from P join `running` whatever its length: those past max_running wait, their
        # KV held, for a place in the batch (first come, first decoded).
        batch = self.running[:self.max_running]
        committed = self.decoder.step(batch)
        outputs = [self._output(req, len(new)) for req, new in zip(batch, committed)]
        for out in outputs:
            if out.finished:
                self.running.remove(out.req)
                self.release(out.req)
        return outputs
