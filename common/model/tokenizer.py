"""Tokenizer and chat template, read from the model's own files (GGUF or Hugging Face folder)."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.model.cache import CACHE_ROOT, building, publish, source_key
from common.model.source import ModelSource, converted_folder


class Tokenizer:
    """Encoding and decoding run on the `tokenizers` library alone, over transformers' own save of
    the model's tokenizer (kept in common.model.cache): the same tokens as transformers gives,
    without importing transformers (2 s of CPU in every service process). The chat template is
    rendered by transformers' own renderer (ChatTemplate), loaded when first needed: the router
    (at start), `generate --chat` and the benchmarks render one; P and D never do. A tokenizer that
    transformers cannot save as tokenizer.json (a slow-only one), or whose template needs its
    choice among several, is served by transformers throughout."""

    def __init__(self, src: ModelSource, eos_token_ids: tuple[int, ...] = ()):
        self._folder, config, self._fast, self._hf = _load(src)
        self._config = config
        self._template: ChatTemplate | None = None
        # Don't trust tokenizer.eos_token alone (GGUF conversions have reported <|im_start|>):
        # the model config's EOS ids plus the chat end-of-turn marker, if the vocabulary has one.
        eos = list(eos_token_ids)
        im_end = self._token_id("<|im_end|>")
        if im_end is not None:
            eos.append(im_end)
        if not eos:
            eos_token = config.get("eos_token") if self._fast is not None else self._hf.eos_token
            if isinstance(eos_token, dict):  # an AddedToken, as some configs write it
                eos_token = eos_token.get("content")
            eos_id = self._token_id(eos_token) if isinstance(eos_token, str) else None
            if eos_id is not None:
                eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

    @property
    def folder(self) -> str:
        """Where the tokenizer files it runs are: a checkpoint with a copy of them tokenizes alike."""
        return self._folder

    def _token_id(self, token: str) -> int | None:
        if self._fast is not None:
            return self._fast.token_to_id(token)
        tid = self._hf.convert_tokens_to_ids(token)
        return tid if isinstance(tid, int) and tid != self._hf.unk_token_id else None

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text).ids
        return self._hf.encode(text)

    def load_chat_template(self) -> None:
        """Load what renders chat prompts now rather than at the first one (seconds of CPU)."""
        if self._template is None and self._fast is not None:
            self._template = ChatTemplate.read(self._folder, self._config)
        if self._template is None and self._hf is None:
            self._hf = _transformers_tokenizer(self._folder)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        self.load_chat_template()
        if self._template is not None:
            text = self._template.render(messages)
        else:
            text = self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already wrote the special tokens; don't let encode add a BOS again.
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=True)
        return self._hf.decode(ids, skip_special_tokens=True)


# The named special tokens transformers hands every chat template (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplate:
    """The model's chat template, rendered by the function transformers' apply_chat_template
    renders with, with the same inputs (messages without None values, the named special tokens,
    a generation prompt): the same text, without loading a transformers tokenizer, which imports
    torch (about 7 s of CPU where the router needs 2)."""

    source: str
    special_tokens: dict[str, str]
    renderer: Callable[..., tuple[list[str], Any]] = field(repr=False, compare=False)

    @classmethod
    def read(cls, folder: str, config: dict) -> ChatTemplate | None:
        """From transformers' save of the tokenizer; None if it has no single template. Imports
        the renderer (2 s of CPU) here, so that the router pays it at start, not in its first
        chat request."""
        path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path) as f:
                source = f.read()
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        else:
            return None
        specials = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
        from transformers.utils.chat_template_utils import render_jinja_template

        return cls(source, specials, render_jinja_template)

    def render(self, messages: list[dict]) -> str:
        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
        rendered, _ = self.renderer(conversations=[conversation], chat_template=self.source,
                                    add_generation_prompt=True, **self.special_tokens)
        return rendered[0]


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's fields."""
    return token.get("content", "") if isinstance(token, dict) else str(token)


def _load(src: ModelSource):
    """(folder, its tokenizer_config.json, the `tokenizers` tokenizer or None, the transformers
    tokenizer or None). The folder holds transformers' save_pretrained of the model's tokenizer, written by the first
    process that needs it (reading one from a GGUF file takes seconds); tokenizer.json there is
    the tokenizer transformers runs, after whatever its tokenizer class changed when loading."""
    folder = _saved_folder(src)
    with building(folder):
        if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(src.folder, **({"gguf_file": src.gguf_file} if src.kind == "gguf" else {}))
            if not publish(tok.save_pretrained, folder):
                return src.folder, {}, None, tok  # the cache cannot be written: transformers serves it
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    fast = _fast_tokenizer(folder, config)
    return folder, config, fast, None if fast else _transformers_tokenizer(folder)


def _saved_folder(src: ModelSource) -> str:
    if src.kind == "gguf":
        return os.path.join(converted_folder(src), "tokenizer")
    files = sorted(f for f in os.listdir(src.folder) if f.startswith(("tokenizer", "special_tokens", "chat_template"))
                   or f in ("vocab.json", "merges.txt"))
    key = hashlib.sha256("|".join(source_key(os.path.join(src.folder, f)) for f in files).encode()).hexdigest()[:16]
    return os.path.join(CACHE_ROOT, "tokenizers", f"{os.path.basename(os.path.normpath(src.folder))}-{key}")


def _fast_tokenizer(folder: str, config: dict):
    """tokenizer.json as transformers runs it, or None where running it alone would differ: no
    tokenizer.json, or a cleanup transformers applies to decoded text."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path) or config.get("clean_up_tokenization_spaces"):
        return None
    from tokenizers import Tokenizer as FastTokenizer

    tok = FastTokenizer.from_file(path)
    tok.no_truncation()  # as transformers does for a call that asks for neither
    tok.no_padding()
    return tok


def _transformers_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class IncrementalDecoder:
    """Turns a growing list of output ids into text deltas, and finds stop strings.

    Text that may still change is held back: an incomplete UTF-8 character (decoded as U+FFFD)
    and the last len(longest stop string) - 1 characters, which may be the start of a stop string.

    An update decodes only the ids after the settled ones and WINDOW before them: the text of
    the settled ids is kept, so a request's text costs time in proportion to its length, not to
    its length squared (a 2,000-token answer decoded whole at every step took ~0.1 ms a step).
    """

    # Settled ids decoded again before the new ones: a decode's first token may read differently
    # (a SentencePiece word start loses its space) and a character may span several tokens.
    WINDOW = 8

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # final text so far (emitted)
        self.matched_stop: str | None = None
        self._settled = 0  # ids whose text is _base; never decoded again but for the last WINDOW
        self._base = ""
        self._head = ""  # the text of the WINDOW ids before _settled, decoded from the first of them

    def update(self, output_ids: list[int], finished: bool) -> str:
        """Return the new text since the last call. Sets matched_stop if a stop string appeared."""
        full = self._decode(output_ids)
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

    def _decode(self, ids: list[int]) -> str:
        """tokenizer.decode(ids), decoding only the ids after the settled ones and WINDOW before."""
        lo = max(0, self._settled - self.WINDOW)
        tail = self.tokenizer.decode(ids[lo:])
        # The new ids changed the text before them, or ids were taken back (cut at a stop string).
        if len(ids) < self._settled or not tail.startswith(self._head):
            self._settled, self._base, self._head = 0, "", ""
            return self.tokenizer.decode(ids)
        full = self._base + tail[len(self._head):]
        if len(ids) - self._settled >= 3 * self.WINDOW:
            self._settle(ids, full, len(ids) - self.WINDOW)
        return full

    def _settle(self, ids: list[int], full: str, upto: int) -> None:
        """Keep the text of ids[:upto] if the next updates, decoding from WINDOW ids before it,
        read what decoding everything reads. Not where a character is split at either end of
        those ids, nor where they decode to nothing (skipped special tokens: the next id would be
        a decode's first and could lose its leading space). A tokenizer with byte-fallback tokens
        decodes a run of them as one, all U+FFFD while its last character is incomplete: hence
        no settling while `full` ends in one, and the check that the window reads the rest of
        `full`."""
        lo = max(0, self._settled - self.WINDOW)
        window = self.tokenizer.decode(ids[lo:upto])
        text = self._base + window[len(self._head):]
        if not window.startswith(self._head) or text.endswith("\ufffd") or not full.startswith(text):
            return
        head = self.tokenizer.decode(ids[upto - self.WINDOW:upto])
        if not head or head[0] == "\ufffd" or full.endswith("\ufffd"):
            return
        if self.tokenizer.decode(ids[upto - self.WINDOW:]) == head + full[len(text):]:
            self._settled, self._base, self._head = upto, text, head
