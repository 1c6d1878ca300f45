"""One dispatched request as the router sees it: what went out and what has come back."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from common.engine.sampling import SamplingParams
from protos import pdflash_pb2 as pb


@dataclass
class Generation:
    """One dispatched request and what has come back for it so far."""

    endpoint: str
    input_ids: list[int]
    sampling: SamplingParams
    # Unguessable (128 random bits): a room id is all a late Abort or TransferDone names.
    room: str = field(default_factory=lambda: secrets.token_hex(16))
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    chunks: int = 0
    meta: pb.MetaInfo | None = None  # from the last chunk
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    def add(self, chunk: pb.GenerateChunk) -> None:
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.chunks += 1
        self.output_ids.extend(chunk.token_ids)
        self.text += chunk.text
        if chunk.finished:
            self.meta = chunk.meta

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def prompt_tokens(self) -> int:
        return self.meta.prompt_tokens if self.meta else len(self.input_ids)

    @property
    def completion_tokens(self) -> int:
        return self.meta.completion_tokens if self.meta else len(self.output_ids)

    @property
    def cached_tokens(self) -> int:
        return self.meta.cached_tokens if self.meta else 0
