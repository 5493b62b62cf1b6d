"""`sluice --config run.yaml [section.key=value ...] [--<slime argument> ...] [--<megatron-field> ...] [--sglang-* ...]
[--router-* ...] [--dry-run]`: parse, resolve into a plan, validate, then run (or print the plan and exit).
`sluice plot RUN_DIR [--out DIR]`: draw a run's metrics.jsonl as PNGs (glue.metrics.plots), during or after the run."""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from glue.fleet.fleet import ProcessDied
from glue.loop.stream import RolloutFailed
from glue.metrics.plots import write_plots
from launch.args.command_line import Parser, parse_args
from launch.config import ConfigError, load_config, to_dict
from launch.plan.run_plan import resolve
from launch.run.cluster import ClusterError
from launch.run.folder_lock import RunFolderHeld, check_folder_free
from launch.run.user_code import put_on_import_path


def plot_main(argv: list[str]) -> int:
    """`sluice plot RUN_DIR [--out DIR]`: write the run's plots and list them; exit 2 with one line when RUN_DIR
    holds no metrics."""
    parser = Parser(prog="sluice plot", usage="sluice plot RUN_DIR [--out DIR]",
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
    """Run the resolved config to completion: an SFT run (launch.run.sft) or an RL run (launch.run.runner); returns the run
    directory. Each is imported here, when it runs: both bring up Ray and the trainer."""
    if cfg.run.mode == "sft":
        if plan.notes:
            raise ConfigError("this build cannot run the plan: " + "; ".join(plan.notes))
        from launch.run.sft import run_sft  # lazy: the SFT driver (trainer group, torch); keeps sluice --help off it

        return run_sft(cfg, plan)
    from launch.run.runner import run  # lazy: the RL driver (fleet, trainer, torch); keeps sluice --help off it

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
    # is checked and said by launch.plan.model_check (the layer spec), so a run's console does not repeat it
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    if argv[:1] == ["export-hf"]:
        from launch.tools.export_hf import main as export_main  # lazy: torch + megatron checkpoints; sluice export-hf only

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

        from launch.run.preflight import preflight  # lazy: --dry-run only; pulls glue.trainer.model (torch)

        try:
            checked = preflight(cfg, plan, here=False)
            if cfg.run.mode == "sft":
                from launch.run.sft import check_sft_files  # lazy: launch.run.sft is the SFT driver (torch)

                checked.append(check_sft_files(cfg))
            checked.append(check_folder_free(cfg.run_dir))  # a dry run checks the lock, never takes it
        except ConfigError as err:
            print(f"sluice: config error: {err}", file=sys.stderr)
            return 2
        except RunFolderHeld as err:
            print(f"sluice: error: {err}", file=sys.stderr)
            return 2
        from launch.plan.memory_lines import fleet_lines, memory_plan  # lazy: --dry-run only; pulls glue.trainer.model (torch)
        from launch.plan.weight_groups import weight_sync_plan  # lazy: --dry-run only; pulls glue.trainer (torch)

        sync = weight_sync_plan(cfg, plan) if plan.engines else "none: no engines (run.mode sft)"
        shown = {**to_dict(cfg), "plan": {**plan.to_dict(), "fleets": fleet_lines(cfg, plan), "weight_sync": sync,
                                          "memory": memory_plan(cfg)},
                 "checked": checked}
        print(yaml.safe_dump(shown, sort_keys=False, width=1000), end="")
        return 0

    from glue.loop.checkpoint import CheckpointFailed  # lazy: torch, which the help paths never import

    try:
        start(cfg, plan)
    except ProcessDied as err:
        print(f"sluice: error: {err}. Every other process it started is stopped; the same command resumes from the "
              f"last checkpoint in {cfg.run_dir / 'checkpoints'} (run.resume=auto)", file=sys.stderr)
        return 1
    except ConfigError as err:  # found at start-up: the run folder, the model path
        print(f"sluice: config error: {err}", file=sys.stderr)
        return 2
    except RunFolderHeld as err:  # another live run writes the folder: nothing was started or touched
        print(f"sluice: error: {err}", file=sys.stderr)
        return 2
    except (ClusterError, RolloutFailed, CheckpointFailed) as err:
        print(f"sluice: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"sluice: interrupted; the engines, router, trainer and Ray it started are stopped{left_behind(cfg.run_dir)}",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
