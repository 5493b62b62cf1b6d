"""A backend's command-line options as data (`OptionSpec`), so the CLI can offer them under a prefix (`--sglang-*`,
`--router-*`), the config can check YAML values against them, and the fleet gets them back as the backend's argv.

Config values are keyed by the backend's flag name with `_` for `-` (`--mem-fraction-static` -> mem_fraction_static).
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

Takes = Literal["none", "one", "optional", "many", "any"]  # argparse nargs 0, None, "?", "+", "*"
FLAG_START = re.compile(r"(?<!\S)--")  # where a flag begins in a backend's text


@dataclass(frozen=True)
class OptionSpec:
    key: str  # config key
    flag: str  # the backend's own spelling, e.g. "--mem-fraction-static"
    takes: Takes
    scalar: type = str  # type of one value
    choices: tuple | None = None
    default: Any = None
    help: str = ""
    aliases: tuple[str, ...] = ()  # other spellings the backend accepts, e.g. "--tensor-parallel-size"
    negatable: bool = False  # a boolean that also has --no-<flag>
    successor: str | None = None  # the backend's replacement for a deprecated spelling, in its own words


def key_of(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def successors_of(key: str, specs: dict[str, OptionSpec]) -> list[str]:
    """The options that stand in the place of `key`, one the backend does not have, when it was renamed by a
    suffix naming the variant (SGLang 0.5.23: cuda_graph_bs -> cuda_graph_bs_decode, cuda_graph_bs_prefill): keys
    of `key` + one more word, at most three of them (more is a prefix of a family, not a rename)."""
    found = sorted(k for k in specs if k.startswith(key + "_") and "_" not in k[len(key) + 1:])
    return found if len(found) <= 3 else []


def likely_takes(key: str, specs: dict[str, OptionSpec]) -> Takes | None:
    """How many values an option the backend does not have would take, as the option meant in its place takes
    them (its successor, else the closest spelling); None when there is none."""
    meant = successors_of(key, specs) or difflib.get_close_matches(key, specs, n=1)
    return specs[meant[0]].takes if meant else None


def add_options(group: Any, specs: dict[str, OptionSpec], *, prefix: str, section: str) -> None:
    """Register every spec as `--<prefix>-<flag>` (and its aliases); parsed values land in dest `section:key`."""
    for spec in specs.values():
        names = [f"--{prefix}-{name.lstrip('-')}" for name in (spec.flag, *spec.aliases)]
        kwargs: dict[str, Any] = {"dest": f"{section}:{spec.key}", "default": argparse.SUPPRESS,
                                  "help": _short(spec.help) or argparse.SUPPRESS}
        if spec.takes == "none":
            kwargs["action"] = argparse.BooleanOptionalAction if spec.negatable else "store_true"
        else:
            kwargs["type"] = spec.scalar if spec.scalar in (int, float) else str
            if spec.choices:
                kwargs["choices"] = spec.choices
            else:
                kwargs["metavar"] = {int: "INT", float: "FLOAT"}.get(spec.scalar, "VALUE")
            kwargs["nargs"] = {"one": None, "optional": "?", "many": "+", "any": "*"}[spec.takes]
            if spec.takes == "optional":
                kwargs["const"] = True
        try:
            group.add_argument(*names, **kwargs)
        except argparse.ArgumentError:  # a spelling another group already owns: keep the first one
            continue


def _short(text: str, limit: int = 180) -> str:
    text = " ".join(text.split()).replace("%", "%%")
    return text if len(text) <= limit else text[: limit - 3].rsplit(" ", 1)[0] + "..."


def check_values(values: dict[str, Any], specs: dict[str, OptionSpec], *, section: str, prefix: str,
                 owned: dict[str, str]) -> dict[str, Any]:
    """Check `section` values against the specs: unknown keys (did-you-mean), owned keys (name sluice's own
    setting), value types and choices. Raises ValueError with the key and the fix; returns the values."""
    aliases = {key_of(a): s.key for s in specs.values() for a in s.aliases}
    out = {}
    for key, value in values.items():
        key = aliases.get(key, key)
        if key in owned:
            raise ValueError(f"--{prefix}-{key.replace('_', '-')} ({section}.{key}) is set by sluice itself; "
                             f"use {owned[key]} instead")
        spec = specs.get(key)
        if spec is None:
            raise ValueError(f"unknown {prefix} option {section}.{key} (--{prefix}-{key.replace('_', '-')})"
                             + _meant(key, specs, prefix))
        if spec.successor:
            successor = FLAG_START.sub(f"--{prefix}-", spec.successor)  # the backend's words in pass-through flags
            raise ValueError(f"--{prefix}-{spec.flag[2:]} ({section}.{key}) is deprecated by the installed {prefix}: "
                             f"use {successor} instead")
        out[key] = _check_one(spec, value, f"{section}.{key}")
    return out


def _meant(key: str, specs: dict[str, OptionSpec], prefix: str) -> str:
    """What an unknown option's message suggests: the options in its place, else the closest spelling."""
    flags = [f"--{prefix}-{k.replace('_', '-')}" for k in successors_of(key, specs)]
    if flags:
        return f": the installed {prefix} has {' / '.join(flags)} in its place (a renamed option); use those"
    guess = difflib.get_close_matches(key, specs, n=1)
    return f"; did you mean --{prefix}-{guess[0].replace('_', '-')}?" if guess else ""


def _check_one(spec: OptionSpec, value: Any, where: str) -> Any:
    if spec.takes == "none":
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: true or false, got {value!r}")
        return value
    if spec.takes in ("many", "any"):
        items = value if isinstance(value, list) else [value]
        return [_check_scalar(spec, v, where) for v in items]
    if spec.takes == "optional" and value is True:
        return value
    return _check_scalar(spec, value, where)


def _check_scalar(spec: OptionSpec, value: Any, where: str) -> Any:
    if isinstance(value, (dict, list)) and spec.scalar is str:
        return value  # JSON-valued options (e.g. --json-model-override-args) may be written as YAML
    if spec.scalar in (int, float):
        try:
            if isinstance(value, bool) or float(value) != spec.scalar(float(value)) and spec.scalar is int:
                raise ValueError
            value = spec.scalar(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} must be {spec.scalar.__name__}, got {value!r}") from None
    if spec.choices and value not in spec.choices and str(value) not in map(str, spec.choices):
        raise ValueError(f"{where} must be one of {list(spec.choices)}, got {value!r}")
    return value


def to_argv(values: dict[str, Any], specs: dict[str, OptionSpec] | None) -> list[str]:
    """The backend command-line tokens for `values`; without specs (backend not installed) a value of true is a
    bare switch, a list is several values and anything else is one value."""
    argv: list[str] = []
    for key, value in values.items():
        spec = (specs or {}).get(key)
        flag = spec.flag if spec else "--" + key.replace("_", "-")
        if value is True and (spec is None or spec.takes in ("none", "optional")):
            argv.append(flag)
        elif value is False and (spec is None or spec.takes == "none"):
            if spec is not None and spec.negatable:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, list) and (spec is None or spec.takes in ("many", "any")):
            argv += [flag, *map(_text, value)]
        elif value is not None:
            argv += [flag, _text(value)]
    return argv


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def specs_from_parser(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ("-h",)) -> dict[str, OptionSpec]:
    """OptionSpecs of every option an argparse parser defines (used where the backend's parser can be built)."""
    specs = {}
    for action in parser._actions:  # argparse has no public iterator over its actions
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or any(s in skip for s in action.option_strings):
            continue
        takes: Takes
        if action.nargs == 0:
            takes = "none"
        else:
            takes = {None: "one", "?": "optional", "+": "many", "*": "any"}.get(action.nargs, "many")
        scalar = bool if takes == "none" else action.type if action.type in (int, float) else str
        default = action.default if isinstance(action.default, (bool, int, float, str, list, type(None))) else None
        spec = OptionSpec(key=key_of(longs[0]), flag=longs[0], takes=takes, scalar=scalar,
                          choices=tuple(action.choices) if action.choices else None, default=default,
                          help=action.help or "", aliases=tuple(a for a in longs[1:] if not a.startswith("--no-")),
                          negatable=isinstance(action, argparse.BooleanOptionalAction))
        specs[spec.key] = spec
    return specs
