"""One row of the slime table (launch.slime.args): a slime (or Megatron-LM) launch argument as slime's parser
defines it, and what it becomes in a sluice config: keys set from its value, a refusal naming what to use instead,
or a check against the checkpoint's config.json. Imports no backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

Takes = Literal["none", "one", "many", "negatable"]  # store_true, one value, nargs "+", --x / --no-x
Apply = Callable[[Any, dict[str, Any]], dict[str, Any]]  # (value, every slime value given) -> {dotted key: value}


@dataclass(frozen=True)
class SlimeArg:
    flag: str  # as slime's scripts spell it, e.g. "--rollout-batch-size"
    group: str  # slime's argument group (cluster, rollout, data, eval, algo, checkpoint, logging, ...)
    key: str  # the sluice config key(s) it sets, as shown by `sluice --help slime`
    takes: Takes = "one"
    scalar: type = str  # type of one value
    apply: Apply | None = None  # value -> config values; None: refused (`note` says what to use) or `derived`
    note: str = ""  # meaning, slime's default where sluice's differs, or why it is refused
    derived: bool = False  # its config values need the whole run config (launch.slime.args derives them)

    @property
    def name(self) -> str:
        """The argparse dest: slime's attribute name."""
        return self.flag[2:].replace("-", "_")

    @property
    def refused(self) -> bool:
        return self.apply is None and not self.derived


def to(flag: str, key: str, group: str, scalar: type = str, *, takes: Takes = "one", note: str = "",
       convert: Callable[[Any], Any] = lambda v: v) -> SlimeArg:
    """A flag whose value (converted) is the value of one config key."""
    return SlimeArg(flag, group, key, takes, scalar, lambda value, given: {key: convert(value)}, note)


def also(flag: str, keys: dict[str, Callable[[Any], Any]], group: str, scalar: type = str, *,
         takes: Takes = "one", note: str = "") -> SlimeArg:
    """A flag that sets several config keys, each from its value."""
    return SlimeArg(flag, group, ", ".join(keys), takes, scalar,
                    lambda value, given: {k: f(value) for k, f in keys.items()}, note)


def switch(flag: str, values: dict[str, Any], group: str, *, note: str = "") -> SlimeArg:
    """A store_true flag that sets fixed config values when given."""
    shown = ", ".join(f"{k}: {_yaml(v)}" for k, v in values.items())
    return SlimeArg(flag, group, shown, "none", bool, lambda value, given: dict(values) if value else {}, note)


def same(flag: str, group: str, why: str, *, takes: Takes = "none", scalar: type = str) -> SlimeArg:
    """Accepted with no config change: sluice already behaves so (`why` says how)."""
    return SlimeArg(flag, group, "(sluice does this already)", takes, scalar, lambda value, given: {}, why)


def no(flag: str, group: str, use: str, *, takes: Takes = "one", scalar: type = str) -> SlimeArg:
    """Refused: sluice has no equivalent; `use` says what to use instead."""
    return SlimeArg(flag, group, "-", takes, scalar, None, f"no equivalent: {use}")


def derived(flag: str, key: str, group: str, scalar: type = str, *, takes: Takes = "one", note: str = "") -> SlimeArg:
    """A flag read together with others and the run config (launch.slime.args.derive)."""
    return SlimeArg(flag, group, key, takes, scalar, None, note, derived=True)


def _yaml(value: Any) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)
