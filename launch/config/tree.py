"""A nested dict (YAML plus dotted overrides) into typed dataclasses: deep merge, `a.b=value` overrides, and
`build`, which checks every key and value against the dataclass fields and says what is wrong in one line."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key and the fix."""


def merge(raw: dict[str, Any], extra: dict[str, Any]) -> None:
    """Deep-merge `extra` into `raw` (extra wins)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            merge(raw[key], value)
        else:
            raw[key] = value


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (so 1e-3, true, [1, 2] work)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    *parents, leaf = key.lstrip("-").split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
    node[leaf] = yaml.safe_load(value) if value != "" else None


def build(cls: type, raw: Any, prefix: str) -> Any:
    """Construct dataclass `cls` from a dict, recursing into dataclass-typed fields; unknown keys are errors."""
    where = prefix.rstrip(".") or "the top level"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            guess = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {prefix + guess[0]!r}?" if guess else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key {prefix + str(key)!r}{hint}")
        kwargs[key] = _convert(hints[key], value, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _convert(hint: Any, value: Any, key: str) -> Any:
    """Check/convert one value against its annotated type; nested dataclasses are built recursively."""
    if dataclasses.is_dataclass(hint):
        return build(hint, value, prefix=key + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if hint is float and not isinstance(value, bool):
        try:  # PyYAML reads "1e-3" as a string; accept it as the number it means
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    expected = origin or hint
    if expected is Any or isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{key} must be {getattr(hint, '__name__', hint)}, got {value!r}")
