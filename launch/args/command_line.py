"""The command line as data: sluice's own flags, slime's launch arguments and the generated pass-through groups of
every back-end (megatron, sglang, router) in one parser; `sluice --help [TOPIC]`; and argv taken apart into the
config file, the pass-through flags as config sections, slime's arguments and the dotted overrides (launch.config
then builds the run config from them)."""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from launch.args import sglang as sglang_args
from launch.args.help import config_reference
from launch.args.megatron import add_megatron_flags, route
from launch.args.options import add_options, likely_takes
from launch.args.router import router_options
from launch.config import apply_override, merge
from launch.slime import args as slime_args

USAGE = ("sluice --config RUN.yaml [section.key=value | --section.key VALUE ...] [--<slime argument> ...] "
         "[--<megatron flag> ...] "
         "[--sglang-<option> ...] [--router-<option> ...] [--dry-run]\n       sluice plot RUN_DIR [--out DIR]")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the problem (argparse's default prints the usage, which is a page long here)."""
        self.exit(2, f"sluice: error: {message} (see sluice --help)\n")


BACKENDS = ("megatron", "sglang", "router")


def build_parser(backends: tuple[str, ...] = BACKENDS, *, own_flags: bool = True) -> argparse.ArgumentParser:
    """sluice's own flags, then the generated groups of `backends` (all of them to parse; one alone, without
    sluice's flags, for `--help <backend>`)."""
    usage = USAGE if own_flags else "sluice --config RUN.yaml [{} ...]".format(
        {"megatron": "--<megatron flag>"}.get(backends[0], f"--{backends[0]}-<option>"))
    parser = Parser(
        prog="sluice", usage=usage, allow_abbrev=False, add_help=False,
        description="RL post-training: SGLang rollout fleet behind sgl-router, megatron-core trainer, weight bridge.",
        epilog="Any config key can be overridden as section.key=value or --section.key value (CLI wins over YAML), "
               "e.g. `sluice --config examples/configs/demo.yaml run.num_steps=5 --trainer.lr 1e-3`.",
    )
    if own_flags:
        own = parser.add_argument_group("sluice")
        own.add_argument("-h", "--help", nargs="?", const="config", metavar="TOPIC",
                         help="this help with every config key; TOPIC megatron, sglang or router lists that backend's "
                              "pass-through options instead; TOPIC slime lists slime's launch arguments and the "
                              "sluice keys they set")
        own.add_argument("--config", help="YAML run config (sections: run, model, rollout, trainer, loss, sync, eval, "
                                          "cluster, sft, sglang, router)")
        own.add_argument("--dry-run", action="store_true",
                         help="resolve and validate, check the model directory, plugins, data files, tokenizer, "
                              "ports and placement, print the config and the plan (ranks, engine and router commands, "
                              "weight group and bytes per sync), and exit without starting anything; a model directory "
                              "holding config.json alone is enough to plan")
    if own_flags and "megatron" in backends:  # slime's spellings first: they own the Megatron-LM ones they share
        slime_args.add_slime_flags(parser)
    if "megatron" in backends:
        add_megatron_flags(parser, skip=slime_args.FLAGS if own_flags else frozenset())
    if "sglang" in backends:
        sglang = sglang_args.sglang_options()
        group = parser.add_argument_group(
            "sglang (generated from the installed sglang's ServerArgs; forwarded to every engine)",
            "Any SGLang server option as --sglang-<option>; YAML: sglang.<option>." if sglang is not None else
            "sglang is not installed: --sglang-<option> [VALUE] is forwarded verbatim, unchecked.")
        if sglang is not None:
            add_options(group, sglang, prefix="sglang", section="sglang")
    if "router" in backends:
        router = router_options()
        group = parser.add_argument_group(
            "router (generated from sglang_router's RouterArgs; forwarded to sgl-router)",
            "Any sgl-router option as --router-<option>; YAML: router.<option>.")
        if router is not None:
            add_options(group, router, prefix="router", section="router")
    return parser


def help_text(topic: str, config: str | None = None, overrides: list[str] = ()) -> str:
    """`sluice --help`: usage, sluice's flags, every config key with its default and doc, and how to list the
    backends' options; `sluice --help megatron|sglang|router`: that backend's group alone; `sluice --help slime`:
    slime's arguments and the sluice keys they set. With `--config X` (and section.key=value overrides) each key X
    sets shows X's value beside the default."""
    if topic == "slime":
        return slime_args.help_table()
    if topic in BACKENDS:
        return build_parser((topic,), own_flags=False).format_help()
    given = {}
    if config is not None:
        import yaml  # lazy: only a --config X --help reads a file

        given = yaml.safe_load(Path(config).read_text()) or {}
        for item in overrides:
            apply_override(given, item)

    counts = {name: len(group._group_actions)  # argparse has no public view of its groups
              for group in build_parser()._action_groups for name in BACKENDS
              if (group.title or "").startswith(name)}
    return "\n".join([build_parser(()).format_help().rstrip(), "", "config keys (YAML section.key, or "
                      "section.key=value on the command line)" + (f", with the values of {config}" if config else "")
                      + ":", *config_reference(given=given, source=_source(config, overrides)), "",
                      "backend pass-through options: " + " | ".join(f"sluice --help {name} ({n} options)"
                                                                     for name, n in counts.items()),
                      f"slime's launch arguments: sluice --help slime ({len(slime_args.ROWS)} arguments, "
                      "docs/from_slime.md)", ""])


def _source(config: str | None, overrides: list[str]) -> str:
    """How `--config X --help` names where a value came from."""
    if config is None:
        return "the command line"
    return Path(config).name + (" + the command line" if overrides else "")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(args, dotted overrides); `args.flags` holds the pass-through flags as nested config sections, `args.slime`
    slime's arguments by name (launch.slime.args), `args.env` the environment variables some of them stand for."""
    parser = build_parser()
    args, rest = parser.parse_known_args(_overrides_first(argv, parser))
    if args.help is not None:
        if args.help not in ("config", *BACKENDS, "slime"):
            parser.error(f"--help {args.help}: choose one of config, {', '.join(BACKENDS)}, slime")
        if args.config is not None and not Path(args.config).is_file():
            parser.error(f"--config {args.config}: no such file")
        overrides = [item.lstrip("-") for item in rest if OVERRIDE.match(item.lstrip("-"))]
        print(help_text(args.help, args.config, overrides), end="")
        parser.exit(0)
    rest, verbatim = _unparsed_sglang(rest)
    flags: dict[str, Any] = {"sglang": verbatim} if verbatim else {}
    megatron, slime = {}, {}
    for dest, value in list(vars(args).items()):
        section, sep, key = dest.partition(":")
        if not sep:
            continue
        delattr(args, dest)
        if section == "megatron":
            megatron[key] = value
        elif section == "slime":
            slime[key] = value
        else:
            flags.setdefault(section, {})[key] = value
    if megatron:
        merge(flags, route(megatron))
    args.flags = flags
    args.env = slime_args.environment(slime)
    args.slime = {name: value for name, value in slime.items() if name not in slime_args.ENV}
    return args, _overrides(rest, parser)


def _unparsed_sglang(rest: list[str]) -> tuple[list[str], dict[str, Any]]:
    """`--sglang-x [values]` the parser did not know (sglang not installed, a misspelling, a renamed option): kept
    as given (a bare flag is true, several values a list), with as many values as the option meant in its place
    takes (launch.args.options.likely_takes), or without sglang every value up to the next option or override;
    `plan.resolve` then names the option in its place, or forwards it verbatim with a warning without sglang."""
    specs = sglang_args.sglang_options() or {}
    out, verbatim, i = [], {}, 0
    while i < len(rest):
        item = rest[i]
        i += 1
        if not item.startswith("--sglang-"):
            out.append(item)
            continue
        name, eq, value = item[len("--sglang-"):].partition("=")
        key = name.replace("-", "_")
        most = MOST_VALUES[likely_takes(key, specs)]
        values = [value] if eq else []
        while not eq and len(values) < most and i < len(rest) and _is_value(rest[i]):
            values.append(rest[i])
            i += 1
        verbatim[key] = values[0] if len(values) == 1 else values or True
    return out, verbatim


def _overrides_first(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with every section.key=value override that follows the values of a several-valued option
    (`--sglang-cuda-graph-bs-decode 1 2 4 run.num_steps=3`) moved in front, so that the option's values end where
    the override begins (argparse, like SGLang's own parser, would take it as one more value)."""
    several = {s for a in parser._actions if a.nargs in ("+", "*") for s in a.option_strings}  # no public list
    moved, kept, in_values = [], [], False
    for item in argv:
        if in_values and OVERRIDE.match(item):
            moved.append(item)
            continue
        in_values = item in several or (in_values and _is_value(item))
        kept.append(item)
    return moved + kept


MOST_VALUES = {"none": 0, "one": 1, "optional": 1, "many": sys.maxsize, "any": sys.maxsize, None: sys.maxsize}
OVERRIDE = re.compile(r"[A-Za-z_]\w*\.[\w.]+=")  # section.key=value


def _is_value(item: str) -> bool:
    """Whether a token after an option is one of its values: not an option, not a section.key=value override."""
    return not item.startswith("--") and not OVERRIDE.match(item)


def _overrides(rest: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Turn `--a.b v`, `--a.b=v` and `a.b=v` into `a.b=v` strings."""
    out, i = [], 0
    while i < len(rest):
        item = rest[i]
        if item.startswith("--") and "." not in item.partition("=")[0]:
            known = [s for a in parser._actions for s in a.option_strings]  # argparse has no public list
            guess = difflib.get_close_matches(item.partition("=")[0], known, n=1)
            hint = f"; did you mean {guess[0]}?" if guess else ""
            parser.error(f"unrecognised option {item!r}: not a sluice, slime, megatron, --sglang-* or --router-* "
                         f"flag{hint}")
        if item.startswith("--") and "=" not in item:
            if i + 1 >= len(rest):
                parser.error(f"{item} needs a value")
            out.append(f"{item[2:]}={rest[i + 1]}")
            i += 2
            continue
        if "=" not in item:
            parser.error(f"unrecognised argument {item!r}: overrides look like section.key=value")
        out.append(item.lstrip("-"))
        i += 1
    return out
