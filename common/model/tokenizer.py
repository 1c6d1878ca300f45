"""Tokenizer and chat template, read from the model's own files (GGUF or Hugging Face folder)."""
from __future__ import annotations

import os

from common.model.cache import publish
from common.model.weights import ModelSource, converted_folder


class Tokenizer:
    def __init__(self, src: ModelSource, eos_token_ids: tuple[int, ...] = ()):
        self._tok = _load(src)
        # Don't trust tokenizer.eos_token alone (GGUF conversions have reported <|im_start|>):
        # the model config's EOS ids plus the chat end-of-turn marker, if the vocabulary has one.
        eos = list(eos_token_ids)
        im_end = self._tok.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self._tok.unk_token_id:
            eos.append(im_end)
        if not eos and self._tok.eos_token_id is not None:
            eos.append(self._tok.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already wrote the special tokens; don't let encode add a BOS again.
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _load(src: ModelSource):
    """transformers' tokenizer of the model. Reading one from a GGUF file takes seconds: it is
    kept as Hugging Face files beside the converted weights (common.model.cache)."""
    from transformers import AutoTokenizer

    if src.kind != "gguf":
        return AutoTokenizer.from_pretrained(src.folder)
    folder = os.path.join(converted_folder(src), "tokenizer")
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
    publish(tok.save_pretrained, folder)
    return tok


class IncrementalDecoder:
    """Turns a growing list of output ids into text deltas, and finds stop strings.

    Text that may still change is held back: an incomplete UTF-8 character (decoded as U+FFFD)
    and the last len(longest stop string) - 1 characters, which may be the start of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # final text so far (emitted)
        self.matched_stop: str | None = None

    def update(self, output_ids: list[int], finished: bool) -> str:
        """Return the new text since the last call. Sets matched_stop if a stop string appeared."""
        full = self.tokenizer.decode(output_ids)
        for s in self.stop:
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at != -1:
                self.matched_stop = s
                full, finished = full[:at], True
        if not finished:
            # Drop the incomplete character first (one U+FFFD per dangling byte), then hold back
            # real characters: counting U+FFFDs against the hold-back let a stop string's first
            # character out before the rest of it arrived.
            cut = len(full)
            while cut > len(self.text) and full[cut - 1] == "\ufffd":
                cut -= 1
            full = full[: max(cut - self._holdback, len(self.text))]
        delta = full[len(self.text):]
        self.text = full
        return delta
