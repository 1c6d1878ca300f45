"""Sampling parameters, validated once at the edge (the router, the services, the CLI); the
sampler that draws with them is common.engine.sampler. Torch-free: the router imports this."""
from __future__ import annotations

import random
from dataclasses import dataclass, field


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


def new_seed() -> int:
    """A seed for a request that gave none: its draws are then random, still position-keyed."""
    return random.getrandbits(62)
