"""SGLang's native `POST /generate`: request parsing and response formatting.

Request: {"text": str | "input_ids": [int], "sampling_params": {temperature, top_p, top_k,
max_new_tokens, stop, stop_token_ids, seed, ignore_eos}, "stream": bool}.
Response: {"text", "output_ids", "meta_info"}; when streaming, every SSE event carries the text and
output_ids so far (cumulative, as SGLang does) and meta_info, whose finish_reason is null until the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from common.engine.sampling import SamplingParams
from protos import pdflash_pb2 as pb
from router_svc.frontend import Generation, Job
from router_svc.params import INT32_MAX, Body, SamplingFields, TokenIds, read, rejected


class SglangSampling(SamplingFields):
    max_new_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description=f"default {SamplingParams.max_new_tokens}")


class GenerateBody(Body):
    """Exactly one of text and input_ids."""
    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: SglangSampling | None = None
    stream: bool | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise rejected("give exactly one of text (a string) or input_ids (a list of token ids)")
        return self


@dataclass(frozen=True)
class GenerateRequest:
    job: Job
    stream: bool


def parse(body: Any) -> GenerateRequest:
    b = read(GenerateBody, body)
    sp = b.sampling_params or SglangSampling()
    max_new_tokens = SamplingParams.max_new_tokens if sp.max_new_tokens is None else sp.max_new_tokens
    sampling = sp.sampling(max_new_tokens, default_temperature=SamplingParams.temperature)
    prompt = b.text if b.text is not None else tuple(b.input_ids)
    return GenerateRequest(Job(prompt, sampling), bool(b.stream))


def response(gen: Generation) -> dict:
    return {"text": gen.text, "output_ids": gen.output_ids, "meta_info": meta_info(gen)}


def stream_events(gen: Generation, chunk: pb.GenerateChunk) -> list[dict]:
    return [response(gen)]


def meta_info(gen: Generation) -> dict:
    info: dict[str, Any] = {
        "id": gen.room,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "finish_reason": _finish_reason(gen.meta),
        "e2e_latency": gen.elapsed,
    }
    m = gen.meta
    if m is not None:
        info.update(transfer_bytes=m.transfer_bytes, verified_pages=m.verified_pages,
                    transfer_transport=m.transfer_transport)
    if m is not None and (m.spec_verify_ct or m.spec_plain_steps):
        verify = m.spec_verify_ct
        info.update(
            spec_verify_ct=verify,
            spec_accepted_drafts=m.spec_accepted_drafts,
            spec_proposed_drafts=m.spec_proposed_drafts,
            spec_accept_histogram=list(m.spec_accept_histogram),
            spec_block_histogram=list(m.spec_block_histogram),
            spec_plain_steps=m.spec_plain_steps,
            # Two definitions (docs/BENCHMARKS.md): the usual interface value, biased by the
            # first token and a truncated last step, and the weighted one from the histogram.
            spec_accept_length=gen.completion_tokens / verify if verify else 0.0,
            spec_accept_length_weighted=1 + m.spec_accepted_drafts / verify if verify else 0.0,
        )
    return info


def _finish_reason(meta: pb.MetaInfo | None) -> dict | None:
    # SGLang's shape: {"type": "length", "length": n} or {"type": "stop", "matched": what stopped it}.
    if meta is None:
        return None
    if meta.finish_reason == "length":
        return {"type": "length", "length": meta.completion_tokens}
    return {"type": meta.finish_reason or "stop", "matched": meta.matched_stop or None}
