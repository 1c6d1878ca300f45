"""Our Tokenizer (the `tokenizers` library over transformers' saved tokenizer) gives what
transformers gives for the same model: ids, text, chat prompts and EOS ids."""
from __future__ import annotations

import os
import random
import shutil

import pytest

from common.model.tokenizer import Tokenizer, _saved_folder
from common.model.source import ModelSource

TEXTS = ["The capital of France is", "  leading spaces and\ttabs\nand lines\n\n", "émigré naïve 東京 🚀 ∑x²",
         "<|im_start|>user\nspecial tokens in text<|im_end|>", "", "a" * 300, "1234567890 + 0.5 = ?"]
CHATS = [[{"role": "user", "content": "What is 2+3?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."},
          {"role": "assistant", "content": "The Rhine."}, {"role": "user", "content": "Another?"}],
         # OpenAI clients send None for fields they leave out: transformers drops them, so do we
         [{"role": "user", "content": "Hi", "name": None}, {"role": "assistant", "content": "Hello.", "tool_calls": None},
          {"role": "user", "content": "<|im_start|>assistant\nin the text<|im_end|>"}]]


@pytest.fixture(scope="module")
def gguf_reference(embedded_source):
    """transformers' own reading of the embedded GGUF file's tokenizer: about 3 s of CPU, so read
    once for the folder below and the comparison."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_source.folder, gguf_file=embedded_source.gguf_file)


@pytest.fixture(scope="module")
def sources(embedded_source, gguf_reference, tmp_path_factory) -> list[ModelSource]:
    """The embedded GGUF file, and a Hugging Face folder holding its tokenizer's files."""
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    gguf_reference.save_pretrained(folder)
    shutil.copy(folder / "tokenizer.json", folder / "tokenizer.json.bak")  # a file the key must not mind
    return [embedded_source, ModelSource("hf", str(folder), None)]


def test_same_as_transformers(sources, gguf_reference):
    from transformers import AutoTokenizer

    for src in sources:
        ours = Tokenizer(src, (7,))
        assert ours._fast is not None and ours._hf is None  # the fast path, transformers not loaded
        theirs = gguf_reference if src.gguf_file else AutoTokenizer.from_pretrained(src.folder)
        for text in TEXTS:
            assert ours.encode(text) == theirs.encode(text), text
        rng = random.Random(0)
        specials = theirs.all_special_ids
        for n in (1, 2, 5, 40):
            for _ in range(20):  # byte-level pieces, half characters and special tokens among them
                ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(theirs)) for _ in range(n)]
                assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids
        for chat in CHATS:
            text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            assert ours.apply_chat_template(chat) == theirs.encode(text, add_special_tokens=False)
        assert ours._template is not None and ours._hf is None  # rendered without a transformers tokenizer
        assert ours.eos_token_ids == (7, theirs.convert_tokens_to_ids("<|im_end|>"))
        assert Tokenizer(src).eos_token_ids == (theirs.convert_tokens_to_ids("<|im_end|>"),)


def test_a_tokenizer_changed_in_its_folder_is_saved_again(sources):
    """The saved copy of a folder's tokenizer is keyed on its files (path, size, time): an edited
    tokenizer is read anew, not served from the copy of the old one."""
    folder = sources[1].folder
    before = _saved_folder(sources[1])
    stat = os.stat(f"{folder}/tokenizer.json")
    os.utime(f"{folder}/tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert _saved_folder(sources[1]) != before
    assert Tokenizer(sources[1]).encode("hello world") == Tokenizer(sources[0]).encode("hello world")
