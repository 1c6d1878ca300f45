"""GSM8K: the data files, few-shot prompts in the users' format, and the answer parser.

Prompt (SGLang's benchmark/gsm8k format): k exemplars "Question: Q\\nAnswer: A" (A is the full
worked answer, ending "#### N"), separated by blank lines, then "Question: Q\\nAnswer:".
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

# Shipped with the package (data/gsm8k/README.md): the test questions and a few training exemplars.
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gsm8k")
DEFAULT_TEST = os.path.join(DATA_DIR, "test.jsonl")
DEFAULT_TRAIN = os.path.join(DATA_DIR, "exemplars.jsonl")
STOP = ["Question", "Assistant:", "<|separator|>"]  # the next exemplar would start here

# A number: optional sign (before or after a $), digits with optional thousands commas and
# decimals. Not preceded by a letter, digit or dot, so "3-4" gives 3 and 4, not 3 and -4.
_NUMBER = re.compile(r"(?<![\w.])([-+\u2212]?)[ \t]?\$?[ \t]?([-+\u2212]?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


@dataclass(frozen=True)
class Item:
    question: str
    answer: str  # the worked answer with "#### N"

    @property
    def label(self) -> float:
        value = parse_answer(self.answer)[0]
        if value is None:
            raise ValueError(f"no '####' answer in a dataset line: {self.answer[-100:]!r}")
        return value


def load(path: str) -> list[Item]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GSM8K file {path!r} not found (pass --dataset / --train)")
    with open(path) as f:
        return [Item(row["question"], row["answer"]) for row in map(json.loads, filter(str.strip, f))]


def example(item: Item, with_answer: bool) -> str:
    text = f"Question: {item.question}\nAnswer:"
    return text + f" {item.answer}" if with_answer else text


def few_shot_prompt(shots: list[Item], item: Item) -> str:
    return "".join(example(s, True) + "\n\n" for s in shots) + example(item, False)


def parse_number(match: re.Match) -> float:
    sign = -1.0 if "-" in (match.group(1) + match.group(2)).replace("\u2212", "-") else 1.0
    return sign * float(match.group(3).replace(",", ""))


def parse_answer(text: str) -> tuple[float | None, str | None]:
    """(value, how): the number right after the first '####' ("####"); else the last number in
    the text ("last number"); else (None, None)."""
    mark = text.find("####")
    if mark >= 0:
        m = _NUMBER.match(text[mark + 4:].lstrip(" \t"))
        if m:
            return parse_number(m), "####"
    numbers = list(_NUMBER.finditer(text))
    if numbers:
        return parse_number(numbers[-1]), "last number"
    return None, None


def is_correct(value: float | None, label: float) -> bool:
    return value is not None and math.isclose(value, label, rel_tol=0, abs_tol=1e-6)
