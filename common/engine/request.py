"""A request's state inside an engine: small, named, changed only through methods."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.engine.sampling import SamplingParams, new_seed
from common.engine.spec_stats import SpecStats
from common.kv.seq_cache import SeqCache
from common.model.tokenizer import IncrementalDecoder


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    decoder: IncrementalDecoder | None = None  # None: no text (prefill-only engines)
    cache: SeqCache = field(default_factory=SeqCache)
    draft_cache: SeqCache = field(default_factory=SeqCache)  # DFlash draft KV (speculative engines)
    spec: SpecStats | None = None  # acceptance counters (speculative engines)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    matched_stop: str | int | None = None
    verified_pages: int = 0  # KV pages checksummed after a transfer (PD with --verify-transfer)
    transfer_bytes: int = 0  # KV bytes received from P (PD)
    transfer_transport: str = ""  # how they came: "local" (copied on one host), "mooncake" (PD)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    seed: int = -1  # sampling seed: params.seed, or a fresh one (set at creation)
    texted: int = 0  # output ids that take_text has seen

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else new_seed()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def budget(self) -> int:
        """Tokens of cache the request may ever need; reserved at admission so a running
        request never waits for pages (no retraction)."""
        return self.prompt_len + self.params.max_new_tokens

    @property
    def prefill_remaining(self) -> int:
        return self.prompt_len - self.cache.length

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token: int, eos_ids: tuple[int, ...]) -> None:
        """Commit one output token and decide whether the request stops after it."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_ids.append(token)
        p = self.params
        if (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids:
            self.finish_reason, self.matched_stop = "stop", token
        elif len(self.output_ids) >= p.max_new_tokens:
            self.finish_reason = "length"

    def append_tokens(self, tokens: list[int], eos_ids: tuple[int, ...]) -> None:
        """Commit several tokens of which only the last may end the request (a decode step has
        checked the others on the device)."""
        self.output_ids.extend(tokens[:-1])
        self.append_token(tokens[-1], eos_ids)

    def stop_ids(self, eos_ids: tuple[int, ...]) -> list[int]:
        """The token ids that end this request."""
        return [*(() if self.params.ignore_eos else eos_ids), *self.params.stop_token_ids]

    def take_text(self) -> str:
        """New output text since the last call; a stop string ends the request here."""
        if self.decoder is None:
            return ""
        delta = self.decoder.update(self.output_ids, self.finished)
        if self.decoder.matched_stop is not None and self.finish_reason != "stop":
            self.finish_reason, self.matched_stop = "stop", self.decoder.matched_stop
            self._cut_at_stop_string()
        self.texted = len(self.output_ids)
        return delta

    def _cut_at_stop_string(self) -> None:
        """Keep the output up to the token that completed the stop string. A speculative step
        commits several tokens at once; plain decoding would have stopped at that one, and the
        text (already cut at the stop string) must not differ from the ids. The ids seen by the
        last call did not hold the stop string, so the search starts after them."""
        decode, stop = self.decoder.tokenizer.decode, self.matched_stop
        for n in range(self.texted + 1, len(self.output_ids)):
            if stop in decode(self.output_ids[:n]):
                del self.output_ids[n:]
                return
