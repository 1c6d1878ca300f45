"""The building blocks of the typed request bodies (pydantic models): strict fields, unknown fields
rejected (a misspelt or unsupported option must not be silently ignored), JSON null read as absent
(OpenAI clients send it), and one `read` that validates a parsed body into its model. The same
models give the OpenAPI document its schemas (openapi.py), so what is published is what is checked."""
from __future__ import annotations

from typing import Annotated, Any, TypeVar, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, PlainValidator, Tag, ValidationError,
                      WithJsonSchema, WrapValidator)
from pydantic_core import PydanticCustomError

from common.engine.sampling import InvalidRequest, SamplingParams
from router_svc.explain import UNSUPPORTED, WRONG_TYPE, explain, json_type

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # the sampler reduces seeds modulo 2**63

M = TypeVar("M", bound="Body")


class Body(BaseModel):
    """A JSON object of a request: no coercion ("10" is no integer, true is no 1), no NaN or infinity."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


def read(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise InvalidRequest(explain(e, body)) from None


def rejected(message: str) -> PydanticCustomError:
    """A whole-message error from a validator (explain passes it on as is)."""
    return PydanticCustomError("invalid", message)


def expect(want: str, items: bool = True) -> WrapValidator:
    """Any error in this field reads "FIELD must be WANT, got ..." (a shape like "a string or a list
    of strings" says more than each union member's complaint). With items=False an error inside one
    item (a list of objects) is reported at that item instead."""

    def wrap(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            if not items and all(err["loc"] and isinstance(err["loc"][0], int) for err in e.errors()):
                raise
            raise PydanticCustomError(WRONG_TYPE, "must be {want}", {"want": want}) from None

    return WrapValidator(wrap)


def by_json_type(want: str, **members: Any) -> Any:
    """A field of several shapes told apart by JSON type (`string=str, array=list[Part]`): only the
    member of the value's type validates it, so an error inside a part names that part."""
    union = Union[tuple(Annotated[t, Tag(name)] for name, t in members.items())]  # noqa: UP007 (built at run time)
    return Annotated[union, Discriminator(json_type, custom_error_type=WRONG_TYPE,
                                          custom_error_message=f"must be {want}", custom_error_context={"want": want})]


def off_only(*allowed: Any) -> Any:
    """A field we don't implement, accepted only at a value that means "off" (or null), so a
    client never gets silently different output."""
    only = f" (only {' or '.join(map(repr, allowed))})" if allowed else ""

    def check(value: Any) -> Any:
        if value is not None and not any(_same_json(value, a) for a in allowed):
            raise PydanticCustomError(UNSUPPORTED, "is not supported{only}", {"only": only})
        return value

    return Annotated[Any, PlainValidator(check), WithJsonSchema({"enum": [*allowed, None]})]


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: 0 == 0.0, but true is not 1 (Python's == says it is)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


TokenIds = Annotated[list[int], expect("a list of integers")]  # the vocabulary range: the frontend's
Stop = Annotated[str | list[str], expect("a string or a list of strings")]


class SamplingFields(Body):
    """The sampling fields SGLang's `sampling_params` and OpenAI bodies share (top_k, ignore_eos and
    stop_token_ids are SGLang extensions to OpenAI); the max-token field, whose name differs, is the
    caller's. Range checks that need the prompt are SamplingParams.validate's."""
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="0 or -1: off")
    stop: Stop | None = None
    stop_token_ids: TokenIds | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    ignore_eos: bool | None = None

    def sampling(self, max_new_tokens: int, default_temperature: float) -> SamplingParams:
        return SamplingParams(
            temperature=default_temperature if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),  # SGLang spells "off" -1, we spell it 0
            max_new_tokens=max_new_tokens,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.seed,
            ignore_eos=bool(self.ignore_eos),
        )
