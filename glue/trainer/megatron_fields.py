"""megatron-core's config dataclasses as pass-through fields: the launcher builds `--<field-name>` flags from them
and stores YAML-safe values in `trainer.megatron`; the trainer turns those values back into typed config fields.

Nothing here imports megatron at import time; the field tables are read from the installed megatron-core on use, or
from megatron_fields.json, their snapshot for one megatron-core version (importing megatron-core costs seconds of CPU,
which `sluice --help` and a dry run need not pay): `python -m glue.trainer.megatron_fields` rewrites it.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib.metadata
import inspect
import json
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from glue.plugins import load_object

# The megatron-core configs whose fields are passed through, `module:Class`, in the order their help is shown.
MEGATRON_CONFIGS = (
    "megatron.core.model_parallel_config:ModelParallelConfig",
    "megatron.core.transformer.transformer_config:TransformerConfig",
    "megatron.core.distributed.distributed_data_parallel_config:DistributedDataParallelConfig",
    "megatron.core.optimizer.optimizer_config:OptimizerConfig",
)
# subclasses whose own fields pass through too (those they inherit are their base's): multi-latent attention's
# (DeepSeek-V3: --q-lora-rank, --kv-lora-rank, YaRN's --mscale ...)
EXTENSION_CONFIGS = ("megatron.core.transformer.transformer_config:MLATransformerConfig",)
DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")


@dataclasses.dataclass(frozen=True)
class MegatronField:
    """One passable megatron-core config field, described in YAML-safe terms.

    kind: "flag" (bool), "value" (one scalar), "list" (one or more scalars), "dtype" (a torch dtype name),
    "enum" (a member name), "object" (an import path `module:attr` to a callable / object).
    """

    name: str
    kind: str
    scalar: type  # int, float or str: the type of one CLI value
    choices: tuple | None
    default: Any  # YAML-safe rendering of megatron's default (None when it has none or it is an object)
    help: str
    owners: tuple[str, ...]  # config classes that declare the field, e.g. ("ModelParallelConfig", "TransformerConfig")
    allows_scalar: bool = False  # a "list" field that also accepts a single value (Union[int, List[int]])


def _import(path: str) -> type:
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _field_docs(cls: type) -> dict[str, str]:
    """Megatron documents each field with a string literal right after it; read those from the class source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def describe(hint: Any) -> tuple[str, type, tuple | None, bool]:
    """(kind, scalar type, choices, allows_scalar) of a type hint; see `MegatronField`."""
    import torch

    hint = _strip_optional(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return "flag", bool, None, False
    if hint in (int, float, str):
        return "value", hint, None, False
    if origin is typing.Literal:
        return "value", type(args[0]), tuple(args), False
    if hint is torch.dtype:
        return "dtype", str, DTYPES, False
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "enum", str, tuple(m.name for m in hint), False
    if origin in (list, tuple, typing.List, typing.Tuple):
        elem = args[0] if args and args[0] in (int, float, str) else str
        return "list", elem, None, False
    if origin in (typing.Union, types.UnionType):
        scalars = [a for a in args if a in (int, float, str)]
        lists = [a for a in args if typing.get_origin(a) in (list, typing.List) or a is list]
        if scalars and lists:
            return "list", scalars[0], None, True
        if scalars:
            return "value", scalars[0], None, False
    return "object", str, None, False  # callables, context managers, recipe objects: `module:attr`


def _yaml_default(field: dataclasses.Field, kind: str) -> Any:
    if field.default is dataclasses.MISSING:
        return None
    value = field.default
    if kind == "dtype":
        return str(value).removeprefix("torch.") if value is not None else None
    if kind == "enum":
        return value.name if value is not None else None
    if kind == "object" or not isinstance(value, (bool, int, float, str, list, tuple, type(None))):
        return None
    return list(value) if isinstance(value, tuple) else value


SNAPSHOT = Path(__file__).with_name("megatron_fields.json")
SCALARS = {t.__name__: t for t in (bool, int, float, str)}


@functools.cache
def megatron_fields() -> dict[str, MegatronField]:
    """Every public field of the pass-through configs, by field name (shared fields merged, owners listed): the
    snapshot when it was taken of the installed megatron-core version, else read from megatron-core itself."""
    snapshot = snapshot_fields()
    return snapshot if snapshot is not None else live_megatron_fields()


def installed_megatron_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def snapshot_fields() -> dict[str, MegatronField] | None:
    """The fields stored in SNAPSHOT, or None when it is absent or of another megatron-core version."""
    if not SNAPSHOT.is_file():
        return None
    data = json.loads(SNAPSHOT.read_text())
    if data.get("megatron_core") != installed_megatron_version():
        return None
    return {name: MegatronField(**{**f, "scalar": SCALARS[f["scalar"]], "owners": tuple(f["owners"]),
                                   "choices": None if f["choices"] is None else tuple(f["choices"])})
            for name, f in data["fields"].items()}


def write_snapshot(path: Path = SNAPSHOT) -> None:
    """Store the installed megatron-core's fields in `path`, tagged with its version."""
    fields = {name: {**dataclasses.asdict(f), "scalar": f.scalar.__name__} for name, f in live_megatron_fields().items()}
    path.write_text(json.dumps({"megatron_core": installed_megatron_version(), "fields": fields}, indent=1) + "\n")


def live_megatron_fields() -> dict[str, MegatronField]:
    """`megatron_fields` read from the installed megatron-core's config classes (imports megatron-core)."""
    import warnings

    out: dict[str, MegatronField] = {}
    for path in MEGATRON_CONFIGS + EXTENSION_CONFIGS:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": irrelevant to field lists
            warnings.simplefilter("ignore", UserWarning)
            cls = _import(path)
        hints, docs = typing.get_type_hints(cls), _field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name.startswith("_") or not f.init:
                continue
            if f.name in out:
                prev = out[f.name]
                if cls.__name__ not in prev.owners and path not in EXTENSION_CONFIGS:
                    out[f.name] = dataclasses.replace(prev, owners=prev.owners + (cls.__name__,))
                continue
            kind, scalar, choices, allows_scalar = describe(hints[f.name])
            out[f.name] = MegatronField(name=f.name, kind=kind, scalar=scalar, choices=choices,
                                        default=_yaml_default(f, kind), help=docs.get(f.name, ""),
                                        owners=(cls.__name__,), allows_scalar=allows_scalar)
    return out


def check_value(spec: MegatronField, value: Any, where: str) -> Any:
    """Check a YAML/CLI value against the field's kind; returns the YAML-safe value (raises ValueError)."""
    if value is None:
        return None
    if spec.kind == "flag":
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if spec.kind == "list":
        items = value if isinstance(value, (list, tuple)) else [value]
        checked = [_check_scalar(spec, item, where) for item in items]
        return checked[0] if spec.allows_scalar and not isinstance(value, (list, tuple)) else checked
    if spec.kind == "object":
        if not isinstance(value, str) or ":" not in value:
            raise ValueError(f"{where} takes an import path 'pkg.module:attr' (megatron expects an object here), "
                             f"got {value!r}")
        return value
    return _check_scalar(spec, value, where)


def _check_scalar(spec: MegatronField, value: Any, where: str) -> Any:
    if spec.scalar is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{where} must be a number, got {value!r}") from None
    elif spec.scalar is int and isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, spec.scalar) or isinstance(value, bool) and spec.scalar is not bool:
        raise ValueError(f"{where} must be {spec.scalar.__name__}, got {value!r}")
    if spec.choices is not None and value not in spec.choices:
        raise ValueError(f"{where} must be one of {list(spec.choices)}, got {value!r}")
    return value


def to_megatron(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The subset of `values` that `cls` declares, converted to the objects megatron expects (dtype, enum, object)."""
    import torch

    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        kind, _, _, _ = describe(hints[f.name])
        if value is None:
            out[f.name] = None
        elif kind == "dtype":
            out[f.name] = getattr(torch, value)
        elif kind == "enum":
            out[f.name] = _strip_optional(hints[f.name])[value]
        elif kind == "object":
            out[f.name] = load_object(value, what=f"trainer.megatron.{f.name}")
        elif kind == "list" and isinstance(value, list) and typing.get_origin(_strip_optional(hints[f.name])) is tuple:
            out[f.name] = tuple(value)
        else:
            out[f.name] = value
    return out


if __name__ == "__main__":
    write_snapshot()
    print(f"wrote {SNAPSHOT} (megatron-core {installed_megatron_version()})")
