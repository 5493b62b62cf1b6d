"""`make rehearse` (`python -m launch.tools.rehearse`): every shipped recipe (examples/configs/*.yaml) and launch script
(launch/scripts/*.sh) run for two steps on CPU, shrunk by `launch.tools.shrink.shrink`, each in its own run folder under a
temp folder; a summary table and bench-results/rehearse.json (one row per recipe: passed, steps, first step and
sync seconds from the run's metrics.jsonl, and the shrink record).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from launch.args.command_line import parse_args
from launch.config import compose, load_config
from launch.plan.run_plan import resolve
from launch.tools.shrink import STEPS, shrink, write_data

REPO = Path(__file__).resolve().parents[2]
CONFIGS = "examples/configs"
SCRIPTS = "launch/scripts"
OUT = "bench-results/rehearse.json"
# The argv recorder a script runs in place of sluice (scripts honour SLUICE): its arguments, NUL-separated, and the
# environment it was started with.
RECORDER = '#!/bin/sh\nprintf "%s\\0" "$@" > "$REHEARSE_ARGV"\nenv -0 > "$REHEARSE_ENV"\n'


@dataclass
class Recipe:
    name: str  # repository-relative path of the config or script
    argv: list[str]  # the sluice arguments it stands for (--config ... [overrides] [pass-through flags])
    env: dict[str, str]  # environment variables the script sets for sluice (empty for a config)
    notes: list[str]


def shipped_recipes() -> list[str]:
    """Every config in examples/configs and every runnable script in launch/scripts (common.bash is a library)."""
    return ([f"{CONFIGS}/{p.name}" for p in sorted((REPO / CONFIGS).glob("*.yaml"))]
            + [f"{SCRIPTS}/{p.name}" for p in sorted((REPO / SCRIPTS).glob("*.sh"))])


def load_recipe(name: str, scratch: Path) -> Recipe:
    if name.endswith(".sh"):
        return script_recipe(name, scratch)
    return Recipe(name=name, argv=["--config", name], env={}, notes=[])


def script_recipe(name: str, scratch: Path) -> Recipe:
    """The sluice command line a launch script builds: the script runs in its --dry-run mode with SLUICE pointing at
    a recorder, so every config, override and pass-through flag it adds is captured as it would reach sluice."""
    scratch.mkdir(parents=True, exist_ok=True)
    recorder = scratch / "sluice-recorder"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    env = {**os.environ, "SLUICE": str(recorder), "REHEARSE_ARGV": str(scratch / "argv"),
           "REHEARSE_ENV": str(scratch / "env")}
    done = subprocess.run(["bash", str(REPO / name), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0 or not (scratch / "argv").exists():
        raise RuntimeError(f"{name} --dry-run with SLUICE=<recorder> exited {done.returncode}: {done.stderr.strip()}")
    argv = [a for a in (scratch / "argv").read_text().split("\0")[:-1] if a != "--dry-run"]
    seen = dict(item.split("=", 1) for item in (scratch / "env").read_text().split("\0") if "=" in item)
    own = {k: v for k, v in seen.items() if env.get(k) != v and k not in ("PWD", "OLDPWD", "SHLVL", "_")}
    notes = []
    if "multi_node.sh" in (REPO / name).read_text():  # multi_node.sh names itself in its usage lines
        notes.append("multi-node script rehearsed on one node: the sluice command it runs on the head, against a "
                     "local Ray (its `ray start` on each node and its waits are not rehearsed)")
    return Recipe(name=name, argv=argv, env=own, notes=notes)


def raw_config(argv: list[str]) -> dict[str, Any]:
    """The config mapping sluice would build from `argv`: YAML, then pass-through flags and slime's arguments, then
    overrides (launch.config.compose, as load_config does), before typing."""
    args, overrides = parse_args(argv)
    return compose(REPO / args.config if args.config else None, overrides, args.flags, args.slime)


def rehearse(recipe: Recipe, folder: Path, *, engine: str, steps: int = STEPS, timeout_s: float = 900) -> dict:
    """Shrink `recipe`, run it with sluice in `folder` (a subprocess, stopped by its pid on timeout) and read its
    metrics: the row of rehearse.json."""
    shrunk = shrink(raw_config(recipe.argv), data_dir=folder / "data", engine=engine, steps=steps,
                    name_hint=recipe.name)
    shrunk.record.notes += recipe.notes
    write_data(shrunk)
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(shrunk.raw, sort_keys=False))
    run_name = shrunk.raw.get("run", {}).get("name", "demo")
    engine_args = planned_engine_args(config)
    command = [str(Path(sys.executable).parent / "sluice"), "--config", str(config),
               f"run.output_dir={folder / 'runs'}", "run.overwrite=true"]
    started = time.monotonic()
    returncode, log = run_sluice(command, folder, env={**os.environ, **recipe.env}, timeout_s=timeout_s)
    row = {"name": recipe.name, "passed": False, "returncode": returncode,
           "wall_s": round(time.monotonic() - started, 1),
           **read_metrics(folder / "runs" / run_name / "metrics.jsonl"), "engine_args": engine_args,
           "shrunk": shrunk.record.to_dict()}
    if recipe.env:
        row["script_env"] = recipe.env
    row["passed"] = returncode == 0 and row["steps"] == steps
    if not row["passed"]:
        row["error"] = error_line(log)
        row["log_tail"] = log.splitlines()[-25:]
    return row


def planned_engine_args(config: Path) -> list[str]:
    """The flags sluice's plan gives every engine for `config` (e.g. --tp-size 2 --sglang-strict), for the report."""
    return resolve(load_config(config))[1].engine_args


def run_sluice(command: list[str], folder: Path, *, env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run sluice to completion or `timeout_s`; on timeout SIGTERM (sluice stops after the step), a second SIGTERM
    (at once), then SIGKILL to the process group it leads. Returns (exit code, its output)."""
    log_path = folder / "sluice.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = stop(proc)
    return returncode, log_path.read_text(errors="replace")


def stop(proc: subprocess.Popen) -> int | None:
    """Stop a sluice that ran past its limit: SIGTERM twice (after the step, then at once), then SIGKILL to the
    process group it leads; returns its exit code."""
    for _ in range(2):
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            continue
    os.killpg(proc.pid, signal.SIGKILL)  # the group sluice leads (start_new_session): only what it started
    return proc.wait()


def read_metrics(path: Path) -> dict[str, Any]:
    """steps trained, the first step's wall time and the mean weight-sync time from a run's metrics.jsonl."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    steps = [r for r in records if r.get("step", 0) >= 1]
    syncs = [r["time/sync_s"] for r in steps if "time/sync_s" in r]
    first = steps[0]["time/step_s"] if steps else None
    return {"steps": len(steps), "first_step_s": None if first is None else round(first, 2),
            "sync_s": round(sum(syncs) / len(syncs), 3) if syncs else None}


def error_line(log: str) -> str:
    """The line that says why a run failed: sluice's own error line, else the last exception line, else the last."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for prefix in ("sluice: error", "sluice: config error"):
        found = [line for line in lines if line.startswith(prefix)]
        if found:
            return found[-1]
    found = [line for line in lines if "Error" in line or "error:" in line]
    return found[-1] if found else (lines[-1] if lines else "no output")


def table(rows: list[dict]) -> str:
    head = f"{'recipe':<44} {'result':<6} {'steps':>5} {'1st step s':>10} {'sync s':>7} {'scaled':>6} {'dropped':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        shrunk = r.get("shrunk", {})
        lines.append(f"{r['name']:<44} {'pass' if r['passed'] else 'FAIL':<6} {r.get('steps', 0):>5} "
                     f"{_num(r.get('first_step_s')):>10} {_num(r.get('sync_s')):>7} "
                     f"{len(shrunk.get('scaled', {})):>6} {len(shrunk.get('dropped', {})):>7}")
        if not r["passed"]:
            lines.append(f"    {r.get('error', '')}")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.tools.rehearse", description=__doc__)
    parser.add_argument("recipes", nargs="*", help="recipe paths (default: every shipped config and script)")
    parser.add_argument("--engine", choices=("sglang_strict", "embedded"), default="sglang_strict",
                        help="cluster.engine of every rehearsal")
    parser.add_argument("--out", default=OUT, help="the JSON report")
    parser.add_argument("--timeout-s", type=float, default=900, help="one rehearsal's limit")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (run folders, logs)")
    args = parser.parse_args(argv)
    temp = Path(tempfile.mkdtemp(prefix="sluice-rehearse-"))
    rows = []
    try:
        for i, name in enumerate(args.recipes or shipped_recipes()):
            folder = temp / f"{i:02d}-{Path(name).stem}"
            folder.mkdir()
            print(f"rehearse: {name} ...", flush=True)
            try:
                row = rehearse(load_recipe(name, folder / "script"), folder, engine=args.engine,
                               timeout_s=args.timeout_s)
            except Exception as err:  # a recipe that cannot even be shrunk is a failed row, the others still run
                row = {"name": name, "passed": False, "steps": 0, "error": f"{type(err).__name__}: {err}"}
            print(f"rehearse: {name}: {'passed' if row['passed'] else 'FAILED: ' + row['error']}", flush=True)
            rows.append(row)
    finally:
        if args.keep:
            print(f"rehearse: run folders kept in {temp}")
        else:
            shutil.rmtree(temp, ignore_errors=True)
    out = REPO / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"engine": args.engine, "steps": STEPS, "recipes": rows}, indent=1, default=str) + "\n")
    print(table(rows))
    print(f"rehearse: {sum(r['passed'] for r in rows)}/{len(rows)} passed; {out}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
