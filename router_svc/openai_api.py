"""OpenAI-compatible /v1/completions and /v1/chat/completions: request parsing and response
formatting (objects, SSE chunks, usage). One choice per request (n = 1); options we don't
implement are accepted only at their "off" value, so a client never gets silently different output."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from protos import pdflash_pb2 as pb
from router_svc.frontend import ChatMessages, Job, Prompt
from router_svc.generation import Generation
from router_svc.params import INT32_MAX, Body, SamplingFields, by_json_type, expect, off_only, read, rejected

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: pass temperature=0 for greedy output
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]


class StreamOptions(Body):
    include_usage: bool | None = None  # a last chunk with usage and no choices


class OpenAIBody(SamplingFields):
    model: str | None = None  # any name: the router serves one model
    user: str | None = None  # no effect on the output
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None  # the newer name; wins over max_tokens
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: off_only(1) = None
    frequency_penalty: off_only(0) = None
    presence_penalty: off_only(0) = None
    logit_bias: off_only({}) = None


def _one_prompt(prompt: str | list) -> str | tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and not isinstance(prompt[0], int):
        raise rejected("batched prompts are not supported: send one prompt per request")
    return tuple(prompt)


class CompletionBody(OpenAIBody):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]],
                      expect("a string or a list of token ids"), AfterValidator(_one_prompt)]
    echo: off_only(False) = None
    best_of: off_only(1) = None
    suffix: off_only("") = None
    logprobs: off_only() = None


class TextPart(Body):
    type: Annotated[Literal["text"], expect("'text' (only text parts are supported)")]
    text: str | None = None


class Message(Body):
    role: Annotated[Literal["system", "user", "assistant"], expect("one of system, user, assistant")]
    content: by_json_type("a string or a list of text parts", string=str, array=list[TextPart])
    name: str | None = None  # no effect on the output

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatBody(OpenAIBody):
    messages: Annotated[list[Message], Field(min_length=1),
                        expect("a non-empty list of {role, content} objects", items=False)]
    logprobs: off_only(False) = None
    top_logprobs: off_only() = None
    tools: off_only([]) = None
    tool_choice: off_only("none") = None
    response_format: off_only({"type": "text"}) = None


@dataclass(frozen=True)
class OpenAIRequest:
    job: Job
    chat: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices


def parse_completion(body: Any) -> OpenAIRequest:
    b = read(CompletionBody, body)
    return _request(b, b.prompt, chat=False)


def parse_chat(body: Any) -> OpenAIRequest:
    b = read(ChatBody, body)
    return _request(b, ChatMessages([{"role": m.role, "content": m.text()} for m in b.messages]), chat=True)


def _request(b: OpenAIBody, prompt: Prompt, chat: bool) -> OpenAIRequest:
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    sampling = b.sampling(COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, DEFAULT_TEMPERATURE)
    job = Job(prompt, sampling, fill_context=chat and max_tokens is None)
    include_usage = bool(b.stream_options and b.stream_options.include_usage)
    return OpenAIRequest(job, chat, bool(b.stream), include_usage)


# ---- responses -----------------------------------------------------------------------------

def response(req: OpenAIRequest, gen: Generation, model: str) -> dict:
    reason = _finish_reason(gen.meta)
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}}
    else:
        choice = {"index": 0, "text": gen.text}
    choice.update(logprobs=None, finish_reason=reason)
    return _envelope(req, gen, model, [choice], chunk=False) | {"usage": usage(gen)}


def stream_events(req: OpenAIRequest, gen: Generation, chunk: pb.GenerateChunk, model: str) -> list[dict]:
    reason = _finish_reason(gen.meta) if chunk.finished else None
    first = gen.chunks == 1
    events = []
    if chunk.text or reason or (req.chat and first):  # no empty deltas (text held back by D)
        choice: dict[str, Any] = {"index": 0}
        if req.chat:
            delta = {"role": "assistant"} if first else {}
            choice["delta"] = delta | ({"content": chunk.text} if chunk.text or first else {})
        else:
            choice["text"] = chunk.text
        choice.update(logprobs=None, finish_reason=reason)
        events.append(_envelope(req, gen, model, [choice], chunk=True))
    if reason and req.include_usage:
        events.append(_envelope(req, gen, model, [], chunk=True) | {"usage": usage(gen)})
    return events


def usage(gen: Generation) -> dict:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def models(model: str, created: int, max_context: int) -> dict:
    return {"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": "pdflash", "max_model_len": max_context}]}


def _envelope(req: OpenAIRequest, gen: Generation, model: str, choices: list[dict], chunk: bool) -> dict:
    if req.chat:
        kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl"
    else:
        kind, prefix = "text_completion", "cmpl"
    return {"id": f"{prefix}-{gen.room}", "object": kind, "created": gen.created, "model": model,
            "choices": choices}


def _finish_reason(meta: pb.MetaInfo | None) -> str | None:
    if meta is None:
        return None
    return "length" if meta.finish_reason == "length" else "stop"
