"""`make learning-table` (issue 27 item 3): what staleness costs in learning, per step and by wall clock. Six rows
(sync, async at max_staleness 1, 2, 4 and 8 with the configs' own correction, Mu-GRPO in 4 stages) x 5 seeds, the same
number of samples each (60 steps x 16 prompts x 8 samples), on two tasks whose rewards wait on a slow tool (the
echo task, demo_async.yaml; the multi-turn calculator, calc_multi_turn.yaml) at two learning rates. Writes
docs/async_learning.json (one section per task and lr; the top-level `settings` are the echo task's at lr 5e-3) and
the plots next to it. Run it small with SLUICE_TABLE_SEEDS=2 SLUICE_TABLE_STEPS=10 SLUICE_TABLE_ONLY=echo/lr=0.005
(items: a task, task/lr=X, or a row name; a section or row is run if any item names it, or no item names any)
and SLUICE_TABLE_OUT=<path> (the default overwrites docs/). SLUICE_TABLE_MERGE=1 runs a piece of the table into an
existing OUT: a row run again gets the new runs (seeds run before are replaced, others added, so with
SLUICE_TABLE_FIRST_SEED=5 a row grows from 5 seeds to 10), the other sections and rows stay, targets are recomputed.
`make learning-merge TABLE_JSON=docs/async_learning.json PIECES="a.json b.json"` merges pieces run elsewhere."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.learning

STEPS = int(os.environ.get("SLUICE_TABLE_STEPS", "60"))
FIRST_SEED = int(os.environ.get("SLUICE_TABLE_FIRST_SEED", "0"))  # with SLUICE_TABLE_MERGE: more seeds for a row
SEEDS = tuple(range(FIRST_SEED, FIRST_SEED + int(os.environ.get("SLUICE_TABLE_SEEDS", "5"))))
ONLY = [item for item in os.environ.get("SLUICE_TABLE_ONLY", "").split(",") if item]
OUT = Path(os.environ.get("SLUICE_TABLE_OUT", REPO_ROOT / "docs" / "async_learning.json"))
MERGE = os.environ.get("SLUICE_TABLE_MERGE", "") not in ("", "0")  # keep OUT's other sections and rows
TASKS = {"echo": ("demo_async.yaml", "SlowToolEchoTask: rewards wait U(0.2, 1.0) s"),
         "calc": ("calc_multi_turn.yaml", "ToyCalculatorTask, multi-turn: each tool call waits U(0.2, 1.0) s")}
LRS = (5e-3, 2.5e-3)
PRIMARY = "echo/lr=0.005"
STAGE = max(STEPS // 4, 1)  # Mu-GRPO: 4 stages, one sync each
# No row names a correction: the async rows get the config's own (what a user of the config gets), recorded per row.
ROWS = {
    "sync": ["run.mode=sync", "sync.max_staleness=0"],
    "async_s1_default": ["sync.max_staleness=1"],
    "async_s2_default": ["sync.max_staleness=2"],
    "async_s4_default": ["sync.max_staleness=4"],
    "async_s8_default": ["sync.max_staleness=8"],
    "mu_grpo_4_stages": ["loss.preset=mu_grpo", "loss.policy_loss=mu_grpo", "loss.correction=none",
                         f"sync.interval={STAGE}", f"sync.max_staleness={STAGE - 1}"],
}
# Probes of why S=2 trails sync per step (docs/async.md): run only when SLUICE_TABLE_ONLY names them.
PROBES = {
    "async_s2_no_correction": ["sync.max_staleness=2", "loss.correction=none"],
    "async_s2_tis_high10": ["sync.max_staleness=2", "loss.correction=tis", "loss.correction_high=10"],
    "async_s2_seq_tis": ["sync.max_staleness=2", "loss.correction=seq_tis"],
    # item 5's wall-clock target with async given more steps than sync, not the same samples: 100 steps of S=2
    # take about the time of 0.6 x sync's 60 (docs/async.md)
    "async_s2_default_100_steps": ["sync.max_staleness=2", "run.num_steps=100"],
}


def section_name(task: str, lr: float) -> str:
    return f"{task}/lr={lr:g}"


def is_chosen(names: tuple[str, ...], known: set[str]) -> bool:
    """Run it if an item of SLUICE_TABLE_ONLY names it, or no item names anything of its kind (`known`)."""
    relevant = [item for item in ONLY if item in known]
    return not relevant or any(name in relevant for name in names)


def run_one(tmp_path: Path, config: str, name: str, overrides: list[str], seed: int) -> dict:
    from glue.metrics.learning_curves import run_curves
    from glue.metrics.logger import read_metrics
    from launch.config import load_config
    from launch.run.runner import run

    cfg = load_config(str(REPO_ROOT / "examples/configs" / config), [
        f"run.num_steps={STEPS}", *overrides, f"run.output_dir={tmp_path}", f"run.name={name}_{seed}",
        f"run.seed={seed}", f"model.tiny.seed={seed}"])  # a row's own run.num_steps comes after the table's
    started = time.perf_counter()
    records = read_metrics(run(cfg) / "metrics.jsonl")
    steps = [r for r in records if r.get("step", 0) >= 1]
    return {"seed": seed, "wall_s": round(time.perf_counter() - started, 2), **run_curves(steps),
            "staleness_max": max(r["staleness/max"] for r in steps),
            "staleness_mean": statistics.mean(r["staleness/mean"] for r in steps),
            "syncs": steps[-1]["async/syncs"],
            "setup": {"correction": cfg.loss.correction, "policy_loss": cfg.loss.policy_loss,
                      "old_logprobs": cfg.trainer.old_logprobs, "max_staleness": cfg.sync.max_staleness,
                      "interval": cfg.sync.interval, "lr": cfg.trainer.lr}}


def run_section(tmp_path: Path, task: str, lr: float) -> dict:
    from glue.metrics.learning_curves import summarise_row

    config, description = TASKS[task]
    rows = {}
    for name, overrides in {**ROWS, **PROBES}.items():
        if not is_chosen((name,), {*ROWS, *PROBES}) or (name in PROBES and name not in ONLY):
            continue
        runs = [run_one(tmp_path, config, f"{task}_{lr:g}_{name}", [*overrides, f"trainer.lr={lr}"], seed)
                for seed in SEEDS]
        rows[name] = {**summarise_row(runs), "setup": runs[0]["setup"], "runs": runs}
        print(section_name(task, lr), name, json.dumps({k: v for k, v in rows[name].items()
                                                        if k.startswith(("final", "wall", "train_s"))}), flush=True)
    return {"task": description, "config": config, "lr": lr, "settings": rows}  # scored by merge_tables


@pytest.mark.timeout(6 * 3600)
def test_learning_table(tmp_path):
    from glue.metrics.learning_curves import merge_tables
    from glue.metrics.plots import write_learning_table_plots

    known = {*TASKS, *(section_name(t, x) for t in TASKS for x in LRS), *ROWS, *PROBES}
    if unknown := [item for item in ONLY if item not in known]:  # a typo would silently run all 240 runs
        raise ValueError(f"SLUICE_TABLE_ONLY: unknown {unknown}; items are tasks, sections or rows: {sorted(known)}")
    sections = {}
    for task in TASKS:
        for lr in LRS:
            name = section_name(task, lr)
            if is_chosen((task, name), {*TASKS, *(section_name(t, x) for t in TASKS for x in LRS)}):
                sections[name] = run_section(tmp_path, task, lr)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    earlier = [json.loads(OUT.read_text())] if MERGE and OUT.exists() else []
    OUT.write_text(json.dumps(merge_tables([*earlier, {
        "steps": STEPS, "prompts_per_step": 16, "samples_per_prompt": 8,
        "final_reward": "mean rollout/reward_mean of the last 5 steps",
        "time": "time/elapsed_s: seconds since the training loop started (start-up, ~20 s, left out)",
        "time_to_target_s": "when the row's mean curve (5-step trailing mean) first reaches the sync row's "
                            "final_reward_mean, at that step's mean time; null if never",
        "sections": sections}], PRIMARY, [*ROWS, *PROBES]), indent=1))
    print("plots:", *write_learning_table_plots(OUT))
    for section in sections.values():
        for name, row in section["settings"].items():
            bound = row["setup"]["max_staleness"]
            assert all(r["staleness_max"] <= bound for r in row["runs"]), (name, bound)
        if "mu_grpo_4_stages" in section["settings"]:
            assert all(r["syncs"] == STEPS // STAGE for r in section["settings"]["mu_grpo_4_stages"]["runs"])
