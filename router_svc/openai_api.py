"""OpenAI-compatible /v1/completions and /v1/chat/completions: request parsing and response
formatting (objects, SSE chunks, usage). One choice per request (n = 1); options we don't
implement are accepted only at their "off" value, so a client never gets silently different output."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.engine.sampling import InvalidRequest
from protos import pdflash_pb2 as pb
from router_svc.frontend import ChatMessages, Job, Prompt
from router_svc.generation import Generation
from router_svc.params import Fields, is_token_list, read_sampling

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: pass temperature=0 for greedy output
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context
CHAT_ROLES = ("system", "user", "assistant")

# Field -> the values that mean "off" (none: only null is accepted).
_NEUTRAL_COMMON: dict[str, tuple] = {"n": (1,), "frequency_penalty": (0,), "presence_penalty": (0,),
                                     "logit_bias": ({},)}
_NEUTRAL_COMPLETION: dict[str, tuple] = {"echo": (False,), "best_of": (1,), "suffix": ("",), "logprobs": ()}
_NEUTRAL_CHAT: dict[str, tuple] = {"logprobs": (False,), "top_logprobs": (), "tools": ([],),
                                   "tool_choice": ("none",), "response_format": ({"type": "text"},)}


@dataclass(frozen=True)
class OpenAIRequest:
    job: Job
    chat: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices


def parse_completion(body: Any) -> OpenAIRequest:
    f = Fields(body)
    prompt = _completion_prompt(f.raw("prompt"))
    return _parse_common(f, prompt, chat=False, neutral=_NEUTRAL_COMPLETION)


def parse_chat(body: Any) -> OpenAIRequest:
    f = Fields(body)
    messages = _messages(f.raw("messages"))
    return _parse_common(f, messages, chat=True, neutral=_NEUTRAL_CHAT)


def _parse_common(f: Fields, prompt: Prompt, chat: bool, neutral: dict[str, tuple]) -> OpenAIRequest:
    f.string("model")  # any name: the router serves one model
    f.ignore("user")
    for name, allowed in (_NEUTRAL_COMMON | neutral).items():
        f.neutral(name, *allowed)
    newer, older = f.integer("max_completion_tokens", minimum=1), f.integer("max_tokens", minimum=1)
    max_tokens = newer if newer is not None else older
    default_max = COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    sampling = read_sampling(f, default_max, DEFAULT_TEMPERATURE)
    stream = f.boolean("stream")
    options = f.object("stream_options")
    include_usage = options.boolean("include_usage")
    options.done()
    f.done()
    job = Job(prompt, sampling, fill_context=chat and max_tokens is None)
    return OpenAIRequest(job, chat, stream, include_usage)


def _completion_prompt(value: Any) -> Prompt:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        return value
    if is_token_list(value):
        return tuple(value)
    if value is None:
        raise InvalidRequest("prompt is required")
    if isinstance(value, list) and all(isinstance(p, (str, list)) for p in value):
        raise InvalidRequest("batched prompts are not supported: send one prompt per request")
    raise InvalidRequest("prompt must be a string or a list of token ids")


def _messages(value: Any) -> ChatMessages:
    if value is None:
        raise InvalidRequest("messages is required")
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    messages = []
    for i, item in enumerate(value):
        m = Fields(item, f"messages[{i}]")
        role = m.string("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        content = _content(m.raw("content"), f"messages[{i}].content")
        m.ignore("name")
        m.done()
        messages.append({"role": role, "content": content})
    return ChatMessages(messages)


def _content(value: Any, where: str) -> str:
    """A string, or a list of text parts [{"type": "text", "text": ...}] (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            p = Fields(part, f"{where}[{i}]")
            if p.string("type") != "text":
                raise InvalidRequest(f"{where}[{i}]: only text parts are supported")
            parts.append(p.string("text") or "")
            p.done()
        return "".join(parts)
    raise InvalidRequest(f"{where} must be a string or a list of text parts")


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
