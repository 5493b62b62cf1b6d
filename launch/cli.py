"""`sluice --config run.yaml [section.key=value ...] [--<slime argument> ...] [--<megatron-field> ...] [--sglang-* ...]
[--router-* ...] [--dry-run]`: parse, resolve into a plan, validate, then run (or print the plan and exit).
`sluice plot RUN_DIR [--out DIR]`: draw a run's metrics.jsonl as PNGs (glue.metrics.plots), during or after the run."""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

from glue.fleet.fleet import ProcessDied
from glue.loop.stream import RolloutFailed
from glue.metrics.plots import write_plots
from launch import sglang_args, slime_args
from launch.cluster import ClusterError
from launch.config import ConfigError, apply_override, load_config, merge, to_dict
from launch.help import config_reference
from launch.megatron_args import add_megatron_flags, route
from launch.options import add_options, likely_takes
from launch.plan import resolve
from launch.router_args import router_options
from launch.user_code import put_on_import_path

USAGE = ("sluice --config RUN.yaml [section.key=value | --section.key VALUE ...] [--<slime argument> ...] "
         "[--<megatron flag> ...] "
         "[--sglang-<option> ...] [--router-<option> ...] [--dry-run]\n       sluice plot RUN_DIR [--out DIR]")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the problem (argparse's default prints the usage, which is a page long here)."""
        self.exit(2, f"sluice: error: {message} (see sluice --help)\n")


BACKENDS = ("megatron", "sglang", "router")


def build_parser(backends: tuple[str, ...] = BACKENDS, *, own_flags: bool = True) -> argparse.ArgumentParser:
    """sluice's own flags, then the generated groups of `backends` (all of them to parse; one alone, without
    sluice's flags, for `--help <backend>`)."""
    usage = USAGE if own_flags else "sluice --config RUN.yaml [{} ...]".format(
        {"megatron": "--<megatron flag>"}.get(backends[0], f"--{backends[0]}-<option>"))
    parser = _Parser(
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
    slime's arguments by name (launch.slime_args), `args.env` the environment variables some of them stand for."""
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
    takes (launch.options.likely_takes), or without sglang every value up to the next option or override;
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


def plot_main(argv: list[str]) -> int:
    """`sluice plot RUN_DIR [--out DIR]`: write the run's plots and list them; exit 2 with one line when RUN_DIR
    holds no metrics."""
    parser = _Parser(prog="sluice plot", usage="sluice plot RUN_DIR [--out DIR]",
                     description="Draw a run's metrics.jsonl as PNGs: reward, response length, train/*, staleness, "
                                 "off-policy ratios and the per-step timeline.")
    parser.add_argument("run_dir", help="the run folder (<run.output_dir>/<run.name>), holding metrics.jsonl")
    parser.add_argument("--out", help="where the PNGs go (default RUN_DIR/plots)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:
        return int(done.code or 0)

    metrics = Path(args.run_dir) / "metrics.jsonl"
    if not metrics.is_file() or not metrics.read_text().strip():
        print(f"sluice plot: error: {metrics} {'is empty' if metrics.is_file() else 'does not exist'}: point "
              "RUN_DIR at a run folder (<run.output_dir>/<run.name>) that has logged a step", file=sys.stderr)
        return 2

    written = write_plots(Path(args.run_dir), Path(args.out) if args.out else None)
    for path in written:
        print(path)
    if not written:
        print(f"sluice plot: {metrics} holds none of the keys the plots draw", file=sys.stderr)
    return 0


def start(cfg, plan) -> Path:
    """Run the resolved config to completion: an SFT run (launch.sft) or an RL run (launch.runner); returns the run
    directory. Each is imported here, when it runs: both bring up Ray and the trainer."""
    if cfg.run.mode == "sft":
        if plan.notes:
            raise ConfigError("this build cannot run the plan: " + "; ".join(plan.notes))
        from launch.sft import run_sft  # lazy: the SFT driver (trainer group, torch); keeps sluice --help off it

        return run_sft(cfg, plan)
    from launch.runner import run  # lazy: the RL driver (fleet, trainer, torch); keeps sluice --help off it

    return run(cfg)


def left_behind(run_dir: Path) -> str:
    """What an interrupted run left that is worth a look, naming only files that exist ("." when none does: an
    interrupt during start-up, before the first step, leaves no metrics)."""
    metrics, logs = run_dir / "metrics.jsonl", run_dir / "logs"
    found = []
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"metrics so far: {metrics}")
    if logs.is_dir() and any(logs.iterdir()):
        found.append(f"process logs: {logs}")
    said = "; ".join(found)
    return f". {said[:1].upper()}{said[1:]}" if found else "."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # megatron-core warns at import that it falls back to torch without TE / Apex (every CPU run); what matters of it
    # is checked and said by launch.model_check (the layer spec), so a run's console does not repeat it
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    if argv[:1] == ["export-hf"]:
        from launch.export_hf import main as export_main  # lazy: torch + megatron checkpoints; sluice export-hf only

        return export_main(argv[1:])
    try:
        args, overrides = parse_args(argv)
    except SystemExit as done:  # --help, or a one-line argparse error already printed
        return int(done.code or 0)
    put_on_import_path(args.config)  # user modules import from the config's folder and the working directory
    try:
        os.environ.update(args.env)  # --wandb-key and the like: the run's environment, never its config
        cfg, plan = resolve(load_config(args.config, overrides, args.flags, args.slime))
    except (ConfigError, FileNotFoundError) as err:
        print(f"sluice: config error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        import yaml

        from launch.preflight import preflight  # lazy: --dry-run only; pulls glue.trainer.model (torch)

        try:
            checked = preflight(cfg, plan, here=False)
            if cfg.run.mode == "sft":
                from launch.sft import check_sft_files  # lazy: launch.sft is the SFT driver (torch)

                checked.append(check_sft_files(cfg))
        except ConfigError as err:
            print(f"sluice: config error: {err}", file=sys.stderr)
            return 2
        from launch.memory_plan import fleet_lines, memory_plan  # lazy: --dry-run only; pulls glue.trainer.model (torch)
        from launch.weight_groups import weight_sync_plan  # lazy: --dry-run only; pulls glue.trainer (torch)

        sync = weight_sync_plan(cfg, plan) if plan.engines else "none: no engines (run.mode sft)"
        shown = {**to_dict(cfg), "plan": {**plan.to_dict(), "fleets": fleet_lines(cfg, plan), "weight_sync": sync,
                                          "memory": memory_plan(cfg)},
                 "checked": checked}
        print(yaml.safe_dump(shown, sort_keys=False, width=1000), end="")
        return 0

    try:
        start(cfg, plan)
    except ProcessDied as err:
        print(f"sluice: error: {err}. Every other process it started is stopped; the same command resumes from the "
              f"last checkpoint in {cfg.run_dir / 'checkpoints'} (run.resume=auto)", file=sys.stderr)
        return 1
    except ConfigError as err:  # found at start-up: the run folder, the model path
        print(f"sluice: config error: {err}", file=sys.stderr)
        return 2
    except (ClusterError, RolloutFailed) as err:
        print(f"sluice: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"sluice: interrupted; the engines, router, trainer and Ray it started are stopped{left_behind(cfg.run_dir)}",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
