"""`sluice --config run.yaml [section.key=value | --section.key value ...] [--dry-run]`: parse, validate, run."""
from __future__ import annotations

import argparse
import sys

from launch.config import ConfigError, load_config, to_dict


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="RL post-training: SGLang rollout fleet behind sgl-router, megatron-core trainer, weight bridge.",
        epilog="Any config key can be overridden as section.key=value or --section.key value (CLI wins over YAML), "
               "e.g. `sluice --config examples/configs/demo.yaml run.num_steps=5 --trainer.lr 1e-3`.",
    )
    parser.add_argument("--config", help="YAML run config (sections: run, model, rollout, trainer, loss, sync)")
    parser.add_argument("--dry-run", action="store_true", help="resolve and validate the config, print it, and exit")
    args, rest = parser.parse_known_args(argv)
    return args, _overrides(rest, parser)


def _overrides(rest: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Turn `--a.b v`, `--a.b=v` and `a.b=v` into `a.b=v` strings."""
    out, i = [], 0
    while i < len(rest):
        item = rest[i]
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


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as err:
        print(f"sluice: config error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    from launch.runner import run

    run(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
