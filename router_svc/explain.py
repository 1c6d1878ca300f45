"""pydantic's validation errors as the one line a client reads: the field's path as it appears in
the body (`messages[0].content`), what it must be and what it got."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

BODY = "the request body"
MAX_MESSAGE = 300  # a huge value must not make a huge message
WRONG_TYPE = "wrong_type"  # ours: ctx["want"] says what the field must be
UNSUPPORTED = "unsupported"  # ours: a field accepted only at its "off" value

# pydantic error type -> what the field must be
_WANT = {"int_type": "an integer", "float_type": "a finite number", "finite_number": "a finite number",
         "bool_type": "true or false", "string_type": "a string", "list_type": "a list",
         "literal_error": "one of {expected}"}
_OBJECT = ("model_type", "model_attributes_type", "dict_type")
_BOUND = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
          "less_than": ("<", "lt")}


def explain(error: ValidationError, body: Any) -> str:
    """The first mistake in reading order; unknown fields only once nothing else is wrong, all of
    one object's together."""
    errors = error.errors(include_url=False)
    wrong = [e for e in errors if e["type"] != "extra_forbidden"]
    if not wrong:
        parent = _path(errors[0]["loc"], body)[:-1]
        names = sorted(str(e["loc"][-1]) for e in errors if _path(e["loc"], body)[:-1] == parent)
        return _cut(f"unknown or unsupported field(s) in {_name(parent)}: {', '.join(names)}")
    return _cut(_message(wrong[0], _name(_path(wrong[0]["loc"], body))))


def _message(e: dict, where: str) -> str:
    kind, value, ctx = e["type"], e["input"], e.get("ctx", {})
    if kind in _OBJECT:
        return f"{where} must be a JSON object, got {json_type(value)}"
    if kind == "missing" or value is None:  # JSON null counts as absent
        return f"{where} is required"
    if kind == "invalid":
        return e["msg"]
    if kind == UNSUPPORTED:
        return f"{where}={value!r} is not supported{ctx['only']}"
    if kind in _BOUND:
        sign, key = _BOUND[kind]
        return f"{where} must be {sign} {ctx[key]}, got {value!r}"
    want = ctx["want"] if kind == WRONG_TYPE else _WANT.get(kind, "").format(**ctx)
    if want:
        return f"{where} must be {want}, got {json_type(value)} {value!r}"
    return f"{where}: {e['msg']}"


def _path(loc: tuple, body: Any) -> list[str | int]:
    """The keys and indexes of `loc` that lead through the body; pydantic's union tags do not."""
    path, value = [], body
    for key in loc:
        if isinstance(key, str) and not isinstance(value, dict):
            continue  # a tag naming which member of a union it tried
        path.append(key)
        value = value.get(key) if isinstance(value, dict) else value[key]
    return path


def _name(path: list[str | int]) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else key
    return out or BODY


def _cut(message: str) -> str:
    return message[:MAX_MESSAGE]


def json_type(value: Any) -> str | None:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
             float: "number", type(None): "null"}
    return names.get(type(value))
