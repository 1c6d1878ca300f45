"""The request path every API shares: prompt -> token ids -> validated sampling params -> dispatch
-> chunks, with the outcome recorded in the metrics. The HTTP and gRPC layers only parse and format."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

from jinja2 import TemplateError

from common.engine.sampling import InvalidRequest, SamplingParams
from common.model.tokenizer import Tokenizer
from protos import pdflash_pb2 as pb
from router_svc.dispatch import Dispatcher, Pin
from router_svc.errors import INVALID, ApiError, invalid
from router_svc.generation import Generation
from router_svc.instances import NO_INSTANCE
from router_svc.metrics import Metrics
from router_svc.model_info import ModelInfo

log = logging.getLogger("router_svc")


@dataclass(frozen=True)
class ChatMessages:
    messages: list[dict[str, str]]  # {"role", "content"}, already checked by the OpenAI parser


Prompt = str | tuple[int, ...] | ChatMessages


@dataclass(frozen=True)
class Job:
    prompt: Prompt
    sampling: SamplingParams
    # No max-token limit was given (OpenAI chat): generate up to the end of the context.
    fill_context: bool = False


class Frontend:
    def __init__(self, model: ModelInfo, tokenizer: Tokenizer, dispatcher: Dispatcher, metrics: Metrics):
        self.model = model
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.metrics = metrics

    def start(self, endpoint: str, job: Job) -> Generation:
        """Tokenize and validate; raises InvalidRequest before anything is dispatched."""
        input_ids = self._tokenize(job.prompt)
        sampling = job.sampling
        if job.fill_context:  # at least 1, so an over-long prompt gets validate's clear message
            sampling = replace(sampling, max_new_tokens=max(1, self.model.max_context - len(input_ids)))
        sampling.validate(len(input_ids), self.model.max_context)
        self._check_vocab(sampling.stop_token_ids, "stop_token_ids")
        return Generation(endpoint, input_ids, sampling)

    def reject(self, endpoint: str, err: InvalidRequest) -> ApiError:
        """Count a request refused before dispatch and turn it into what the client sees."""
        self.metrics.request_done(endpoint, INVALID)
        return invalid(str(err))

    async def run(self, gen: Generation, pin: Pin | None = None) -> AsyncIterator[pb.GenerateChunk]:
        """Dispatch `gen` (to the instances `pin` names, if any) and yield its chunks; raises
        ApiError. Close it (aclosing) when leaving early: that aborts the room on the backends."""
        status = "cancelled"  # unless it ends otherwise: the client left mid-request
        try:
            async with aclosing(self.dispatcher.generate(gen.room, gen.input_ids, gen.sampling, pin)) as chunks:
                async for chunk in chunks:
                    gen.add(chunk)
                    yield chunk
            status = "ok"
            self.metrics.request_succeeded(gen)
        except ApiError as e:
            status = e.type
            log.info("room %s failed (%s): %s", gen.room, e.type, e.message)
            # In pd mode a failure before the first token is a failed bootstrap or KV transfer,
            # unless D refused the request outright (bad input, no free pages) or it went nowhere.
            if self.dispatcher.pd and not gen.chunks and e.type not in (INVALID, "resource_exhausted", NO_INSTANCE):
                self.metrics.transfer_failed(e.type)
            raise
        finally:
            self.metrics.request_done(gen.endpoint, status)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, ChatMessages):
            try:
                return self.tokenizer.apply_chat_template(prompt.messages)
            except TemplateError as e:  # templates raise on e.g. roles out of order
                raise InvalidRequest(f"the chat template rejected the messages: {e}") from None
        if isinstance(prompt, str):
            if not prompt:  # before encode, which may add a BOS token to an empty text
                raise InvalidRequest("the prompt is empty")
            return self.tokenizer.encode(prompt)
        self._check_vocab(prompt, "the prompt")
        return list(prompt)

    def _check_vocab(self, ids: tuple[int, ...], what: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.model.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{what} contains token id {bad}, outside the vocabulary [0, {self.model.vocab_size})")
