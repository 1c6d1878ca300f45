"""Sampling parameters (validated once, at the edge) and the batched sampler."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class InvalidRequest(ValueError):
    """Bad input from a client; the message is shown to it as is (HTTP 400 / INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default=())
    stop: tuple[str, ...] = field(default=())  # stop strings
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self, prompt_len: int, max_context: int) -> None:
        if prompt_len <= 0:
            raise InvalidRequest("the prompt is empty")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidRequest(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if prompt_len >= max_context:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; the model's context is {max_context}")
        if prompt_len + self.max_new_tokens > max_context:
            raise InvalidRequest(f"prompt ({prompt_len} tokens) + max_new_tokens ({self.max_new_tokens}) "
                                 f"exceeds the model's context of {max_context} tokens")
        if not self.temperature >= 0:  # also NaN (gRPC clients can send one): it fails a whole batch
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")


def _step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    # A generator per (seed, output position): the token at position i depends only on the
    # seed and i, so a request sampled partly on P and partly on D matches one run alone.
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits [B, V] fp32; steps[i] = index of the output token being sampled for row i."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > p.top_p  # keep the smallest set reaching top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        gen = None if p.seed is None else _step_generator(p.seed, steps[i], probs.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out
