"""`pdflash generate` as a user runs it: a subprocess of this virtual environment's console script."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PDFLASH = os.path.join(os.path.dirname(sys.executable), "pdflash")


def _pdflash(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PDFLASH, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_prints_text():
    r = _pdflash("generate", "--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_json(embedded_tokenizer):
    r = _pdflash("generate", "--prompt", "The three primary colours are", "--max-new-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"] == "length"
    assert out["text"] == embedded_tokenizer.decode(out["output_ids"])
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == len(embedded_tokenizer.encode("The three primary colours are"))


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["--prompt", "hi", "--max-new-tokens", "-5"], "max-new-tokens"),
    (["--prompt", "hi", "--model", "/no/such/model"], "unknown model path"),
    (["--prompt", "word " * 9000, "--max-new-tokens", "4"], "context"),  # 9000 tokens > 8192
])
def test_bad_arguments_give_one_error_line(args, message):
    r = _pdflash("generate", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("pdflash generate: error:") and message in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
