"""Typed reads of a JSON request body. Every mistake becomes an InvalidRequest that names the field,
and fields nobody read are rejected: a misspelt or unsupported option must not be silently ignored."""
from __future__ import annotations

import math
from typing import Any

from common.engine.sampling import InvalidRequest, SamplingParams

BODY = "the request body"
INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # the sampler reduces seeds modulo 2**63


class Fields:
    def __init__(self, obj: Any, where: str = BODY):
        if not isinstance(obj, dict):
            raise InvalidRequest(f"{where} must be a JSON object, got {_json_type(obj)}")
        self._obj = obj
        self._where = where
        self._read: set[str] = set()

    def _get(self, name: str) -> Any:
        self._read.add(name)
        return self._obj.get(name)  # JSON null counts as absent, as OpenAI clients send it

    def _name(self, name: str) -> str:
        return name if self._where == BODY else f"{self._where}.{name}"

    def _wrong(self, name: str, want: str, value: Any) -> InvalidRequest:
        return InvalidRequest(f"{self._name(name)} must be {want}, got {_json_type(value)} {value!r}"[:300])

    def integer(self, name: str, default: int | None = None, minimum: int = -INT32_MAX,
                maximum: int = INT32_MAX) -> int | None:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._wrong(name, "an integer", value)
        if not minimum <= value <= maximum:
            raise InvalidRequest(f"{self._name(name)} must be in [{minimum}, {maximum}], got {value}")
        return value

    def number(self, name: str, default: float) -> float:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise self._wrong(name, "a finite number", value)
        return float(value)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._wrong(name, "true or false", value)
        return value

    def raw(self, name: str) -> Any:
        """The value as sent, for fields with several accepted shapes (prompts)."""
        return self._get(name)

    def strings(self, name: str) -> tuple[str, ...]:
        """A string or a list of strings (OpenAI's and SGLang's `stop`)."""
        value = self._get(name)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self._wrong(name, "a string or a list of strings", value)
        return tuple(items)

    def string(self, name: str) -> str | None:
        value = self._get(name)
        if value is not None and not isinstance(value, str):
            raise self._wrong(name, "a string", value)
        return value

    def token_ids(self, name: str) -> tuple[int, ...] | None:
        """A list of token ids; their vocabulary range is checked by the frontend, which knows it."""
        value = self._get(name)
        if value is not None and not is_token_list(value):
            raise self._wrong(name, "a list of integers", value)
        return value if value is None else tuple(value)

    def object(self, name: str) -> Fields:
        value = self._get(name)
        return Fields({} if value is None else value, self._name(name))

    def neutral(self, name: str, *allowed: Any) -> None:
        """Accept a field we don't implement only at a value that means "off"."""
        value = self._get(name)
        if value is not None and value not in allowed:
            only = f" (only {' or '.join(map(repr, allowed))})" if allowed else ""
            raise InvalidRequest(f"{self._name(name)}={value!r} is not supported{only}"[:300])

    def ignore(self, *names: str) -> None:
        """Fields with no effect on the output (e.g. OpenAI's `user`)."""
        self._read.update(names)

    def done(self) -> None:
        unknown = sorted(k for k in self._obj if k not in self._read)
        if unknown:
            raise InvalidRequest(f"unknown or unsupported field(s) in {self._where}: {', '.join(unknown)}"[:300])


def is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def read_sampling(f: Fields, max_new_tokens: int, default_temperature: float) -> SamplingParams:
    """The sampling fields SGLang's `sampling_params` and OpenAI bodies share (top_k, ignore_eos
    and stop_token_ids are SGLang extensions to OpenAI); the caller reads the max-token field,
    whose name differs. Range checks that need the prompt are SamplingParams.validate's."""
    top_k = f.integer("top_k", 0, minimum=-1)
    return SamplingParams(
        temperature=f.number("temperature", default_temperature),
        top_p=f.number("top_p", 1.0),
        top_k=max(top_k or 0, 0),  # SGLang spells "off" -1, we spell it 0
        max_new_tokens=max_new_tokens,
        stop=f.strings("stop"),
        stop_token_ids=f.token_ids("stop_token_ids") or (),
        seed=f.integer("seed", None, minimum=0, maximum=SEED_MAX),
        ignore_eos=f.boolean("ignore_eos"),
    )


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
