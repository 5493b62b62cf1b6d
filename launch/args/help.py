"""`sluice --help [TOPIC]`: sluice's own flags and every config key with its default and doc first; the backends'
pass-through groups (thousands of flags) only on request: `--help megatron | sglang | router`.

The key docs are the trailing comments of the config dataclasses' fields (where they are written for readers of
the code), read from their source, so the help and the code cannot drift apart."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any

from launch.config import SluiceConfig

TOPICS = {"config": "every config key (the default)", "megatron": "megatron-core flags",
          "sglang": "SGLang server options (--sglang-*)", "router": "sgl-router options (--router-*)",
          "slime": "slime's launch arguments and the sluice keys they set"}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its trailing comment in `cls`'s source (empty when it has none)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    docs = {}
    for number, line in enumerate(source.splitlines(), start=1):
        name, colon, _ = line.strip().partition(":")
        if colon and line.startswith("    ") and not line.startswith("     ") and name.isidentifier():
            docs.setdefault(name, comments.get(number, ""))
    return docs


def config_reference(cls: type | None = None, prefix: str = "", width: int = 118, given: dict | None = None,
                     source: str = "") -> list[str]:
    """One entry per config key: `section.key  (type, default: value)` and its doc, indented below it; with
    `given` (a config file's YAML, read as it is), a key it sets also shows that value: `..., in SOURCE: value`."""
    cls, given = cls or SluiceConfig, given if isinstance(given, dict) else {}
    hints, lines = typing.get_type_hints(cls), []
    docs = {k: v for base in reversed(cls.__mro__) if dataclasses.is_dataclass(base)  # a section's inherited keys too
            for k, v in field_docs(base).items()}
    for f in dataclasses.fields(cls):
        key, hint = prefix + f.name, optional_section(hints[f.name])
        if dataclasses.is_dataclass(hint):
            if not prefix:
                lines += ["", f"{key}:" + (f"  {docs[f.name]}" if docs.get(f.name) else "")]
            lines += config_reference(hint, key + ".", width, given.get(f.name), source)
            continue
        mine = f", in {source}: {given[f.name]!r}" if f.name in given else ""
        lines.append(f"  {key}  ({_type_name(hint)}, default: {_default(f)}{mine})")
        if docs.get(f.name):
            lines += textwrap.wrap(docs[f.name], width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def optional_section(hint: Any) -> Any:
    """`Section | None` (a section that is off unless given, e.g. judge:) reads as the section."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    is_optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return args[0] if is_optional and len(args) == 1 and dataclasses.is_dataclass(args[0]) else hint


def _type_name(hint: Any) -> str:
    text = str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))
    return text.replace("typing.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"
