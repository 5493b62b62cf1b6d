"""The JSON boundary of the engine's routes: a request body is UTF-8 JSON labelled as JSON, an object at most
`MAX_DEPTH` deep with finite numbers and 64-bit integers, and every field its route declares is of the declared
kind. Anything else is a `RequestError` naming the field (or the body), which the server answers with a 4xx."""
from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from typing import Any, Mapping

from aiohttp import web

from glue.embedded_engine.request_schema import RequestError

MAX_DEPTH = 32  # SGLang's bodies nest 3 deep (batched input_ids, shapes); deep nesting is only ever an attack
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what every integer field ends up in (torch, ports, seeds)
KIND_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
              dict: "a JSON object"}


def _bounded_repr() -> reprlib.Repr:
    bounded = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
    bounded.maxlevel, bounded.maxstring, bounded.maxother, bounded.maxlist, bounded.maxdict = 3, 60, 60, 6, 6
    return bounded


_preview = _bounded_repr().repr


@dataclass(frozen=True)
class Field:
    """One JSON field a route reads: the JSON kinds it accepts (`str`, `int`, `float`, `bool`, `list`, `dict`) and
    whether it must be present. null means "the default" for an optional field, as in SGLang's request structs."""

    kinds: tuple[type, ...]
    required: bool = False


def field(*kinds: type, required: bool = False) -> Field:
    return Field(kinds, required)


def describe(value: Any) -> str:
    """A short repr of a client's value for an error message (bounded, whatever the client sent)."""
    return _preview(value)


def is_kind(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # JSON true/false are not numbers
        return bool in kinds
    if isinstance(value, int):
        return int in kinds or float in kinds
    return any(isinstance(value, k) for k in kinds if k not in (bool, int))


def _parse_int(text: str) -> int:
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"integer {describe(value)} does not fit in 64 bits")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:60]} does not fit in a 64-bit float")
    return value


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _check_depth(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError("body", f"nests deeper than {MAX_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))


def decode_json(raw: bytes) -> Any:
    """Parse a request body; RequestError("body", ...) saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError("body", f"is not UTF-8 ({e}); send JSON encoded as UTF-8") from None
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant)
    except RecursionError:
        raise RequestError("body", f"nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise RequestError("body", f"is not valid JSON ({e})") from None
    if isinstance(value, (list, dict)):
        _check_depth(value)
    return value


def check_fields(body: dict[str, Any], fields: Mapping[str, Field]) -> dict[str, Any]:
    """`body` without the declared fields that are null (their defaults apply); RequestError for a declared field
    of another kind, then for a missing required one. Undeclared fields pass through (SGLang's structs have more)."""
    for name, spec in fields.items():
        value = body.get(name)
        if value is not None and not is_kind(value, spec.kinds):
            kinds = " or ".join(KIND_NAMES[k] for k in spec.kinds)
            raise RequestError(name, f"{name} must be {kinds}, got {describe(value)}")
    for name, spec in fields.items():
        if spec.required and body.get(name) is None:
            raise RequestError(name, f"{name} is required")
    return {k: v for k, v in body.items() if not (v is None and k in fields)}


def is_json_media_type(content_type: str | None) -> bool:
    """No Content-Type, application/json or application/*+json (what FastAPI, and so SGLang, parses as JSON)."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: web.Request, fields: Mapping[str, Field], *, may_be_empty: bool) -> dict[str, Any]:
    """The request's JSON object, checked against `fields`. An empty body is `{}` where `may_be_empty` (SGLang's
    optional bodies), else refused, as SGLang refuses a missing required body."""
    raw = await request.read()
    if not raw or raw.isspace():
        if may_be_empty:
            return {}
        raise RequestError("body", "is empty; send a JSON object ({} for every default)")
    body = decode_json(raw)
    content_type = request.headers.get("Content-Type")
    if not is_json_media_type(content_type):
        raise RequestError("Content-Type", f"Content-Type {describe(content_type)} is not JSON; send the body as "
                                           "application/json", status=415)
    if not isinstance(body, dict):
        raise RequestError("body", f"must be a JSON object, got {type(body).__name__}")
    return check_fields(body, fields)
