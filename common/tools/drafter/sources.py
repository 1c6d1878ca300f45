"""Where the drafter's training prompts come from, and how each is posed to the target.

A source is a numbered list of prompts and how to ask them. Sources:

  chat         the prompt file's questions as a chat user turn (the chat template)
  fewshot      the same questions in the users' benchmark format: `shots` worked examples drawn
               from the same file, then "Question: ...\\nAnswer:" as plain completion (the
               target's continuation often goes on to write and answer a new question)
  self-math-q  the target writes new math word problems (instructions x topics, sampled), so
               that the drafter does not memorise the questions of one file
  self-math    ... and answers them in a chat turn
  self-chat-q  the target writes questions on general topics
  self-chat    ... and answers them

Every prompt gets a greedy answer (k = 0) and `samples` sampled ones (k >= 1, temperatures
cycling through a list, a seed per (source, prompt, k)), or as many as `source_samples` gives its
source. The "-q" sources write prompts: one draw each (k = 1 at temperature 1.0), generated
before the sources that answer them. Prompt i of a source is a pure function of (settings, i), so
a resumed or extended run asks the same.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from common.engine.sampling import SamplingParams
from common.model.tokenizer import Tokenizer
from common.tools.bench import gsm8k_data

MATH_ASKS = (
    "Write a new grade school math word problem about {topic}. Write only the problem, not the solution.",
    "Make up a short math word problem that involves {topic}. Do not solve it.",
    "Create a two-step arithmetic word problem about {topic}. Give only the question.",
    "Invent a math story problem about {topic} with a single numerical answer. State the problem only.",
)
MATH_TOPICS = (
    "apples", "a school trip", "baking cookies", "saving money", "a farm", "trains", "a birthday party",
    "painting a fence", "a bookstore", "soccer practice", "a garden", "buying groceries", "a road trip",
    "a lemonade stand", "pets", "a bakery", "a library", "building a shed", "a movie theater", "marbles",
    "a swimming pool", "hourly wages", "a pizza party", "recycling cans", "a zoo", "a bike ride",
    "a car wash fundraiser", "sewing quilts", "a chess club", "planting trees", "a concert", "fishing",
    "a toy store", "a science fair", "a bus route", "an aquarium", "knitting scarves", "a coffee shop",
    "a candy jar", "a marathon",
)
CHAT_ASKS = (
    "Write one question that someone might ask an AI assistant about {topic}. Write only the question.",
    "Ask me a question about {topic} that needs a detailed answer. Only write the question.",
    "What is a question a curious student might ask about {topic}? Reply with just the question.",
    "Write a request for help with something related to {topic}, as a user would type it.",
)
CHAT_TOPICS = (
    "cooking", "travel", "history", "programming in Python", "health and exercise", "music", "gardening",
    "personal finance", "writing an email", "learning a language", "astronomy", "photography", "pets",
    "job interviews", "climate", "movies", "geography", "cars", "sleep", "time management", "biology",
    "philosophy", "sports", "home repair", "poetry", "chemistry", "board games", "economics", "art history",
    "computers", "nutrition", "friendship", "the ocean", "ancient Rome", "electricity", "recipes for dinner",
    "studying for exams", "social media", "mountains", "writing a story",
)
NAMES = ("chat", "fewshot", "self-math-q", "self-math", "self-chat-q", "self-chat")
WRITE_MAX_NEW_TOKENS = 128  # a written problem or question
WRITE_TEMPERATURE = 1.0


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    stop: tuple[str, ...] = ()  # stop strings: few-shot completion ends at the next "Question"


@dataclass(frozen=True)
class Source:
    name: str
    count: int  # prompts 0..count-1
    samples: int  # sampled answers per prompt besides the greedy one
    prompt: Callable[[int], Prompt | None]  # None: nothing to ask (a written prompt that failed)

    @property
    def writes(self) -> bool:
        """A stage-1 source: its answers are the prompts of another source."""
        return self.name.endswith("-q")

    @property
    def keys(self) -> list[tuple[int, int]]:
        ks = [1] if self.writes else range(self.samples + 1)
        return [(i, k) for i in range(self.count) for k in ks]

    def params(self, i: int, k: int, max_new_tokens: int, temperatures: tuple[float, ...], top_p: float,
               seed: int, stop: tuple[str, ...] = ()) -> SamplingParams:
        if self.writes:
            return SamplingParams(temperature=WRITE_TEMPERATURE, top_p=top_p,
                                  max_new_tokens=min(WRITE_MAX_NEW_TOKENS, max_new_tokens), seed=seed_for(self.name, i, k, seed))
        if k == 0:
            return SamplingParams(max_new_tokens=max_new_tokens, stop=stop)
        return SamplingParams(temperature=temperatures[(k - 1) % len(temperatures)], top_p=top_p,
                              max_new_tokens=max_new_tokens, stop=stop, seed=seed_for(self.name, i, k, seed))


def seed_for(source: str, i: int, k: int, seed: int) -> int:
    """The sampling seed of (source, prompt, sample)."""
    return (seed * 1_000_003 + (NAMES.index(source) + 1) * 7_919_111 + i * 1009 + k * 104_729) % (2**31)


def chat_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}])


def fewshot_text(items: list[gsm8k_data.Item], i: int, shots: int, seed: int) -> str:
    """The users' format for item i, with `shots` other items of the file as worked examples
    (a different draw per question, so that no one preamble is learnt by heart)."""
    rng = random.Random(seed * 1_000_003 + i)
    picks: list[int] = []
    while len(picks) < min(shots, len(items) - 1):
        j = rng.randrange(len(items))
        if j != i and j not in picks:
            picks.append(j)
    return gsm8k_data.few_shot_prompt([items[j] for j in picks], items[i])


def instruction(asks: tuple[str, ...], topics: tuple[str, ...], i: int) -> str:
    """Instruction i: each instruction with each topic before any pair repeats."""
    return asks[i % len(asks)].format(topic=topics[(i // len(asks)) % len(topics)])


def build(tok: Tokenizer, questions: list[str], items: list[gsm8k_data.Item] | None, *, formats: tuple[str, ...],
          shots: int, samples: int, self_math: int, self_chat: int, seed: int,
          written: Callable[[str, int], str | None] = lambda name, i: None,
          source_samples: dict[str, int] | None = None) -> list[Source]:
    """The sources these settings ask for. items: the prompt file as worked examples (the few-shot
    format needs their answers); written(name, i): the text that stage-1 source `name` wrote
    for prompt i, or None while it is not there (or unusable); source_samples: sampled answers
    per prompt of the sources it names, instead of `samples`."""
    n = lambda name: (source_samples or {}).get(name, samples)
    sources: list[Source] = []
    if "chat" in formats:
        sources.append(Source("chat", len(questions), n("chat"), lambda i: Prompt(chat_ids(tok, questions[i]))))
    if "fewshot" in formats:
        if not items:
            raise ValueError("the few-shot format needs worked examples: a prompt file with 'question' and 'answer'")
        sources.append(Source("fewshot", len(items), n("fewshot"), lambda i: Prompt(
            tok.encode(fewshot_text(items, i, shots, seed)), tuple(gsm8k_data.STOP))))
    for name, count, asks, topics in (("self-math", self_math, MATH_ASKS, MATH_TOPICS),
                                      ("self-chat", self_chat, CHAT_ASKS, CHAT_TOPICS)):
        if count:
            sources.append(Source(f"{name}-q", count, 0,
                                  lambda i, a=asks, t=topics: Prompt(chat_ids(tok, instruction(a, t, i)))))
            sources.append(Source(name, count, n(name), lambda i, q=f"{name}-q": _answer(tok, written(q, i))))
    return sources


def _answer(tok: Tokenizer, text: str | None) -> Prompt | None:
    return None if text is None else Prompt(chat_ids(tok, text))
