"""`make bench`: synchronous vs asynchronous training on the slow-tool echo task (every reward waits 0.05-0.25 s on a
simulated tool), same machine, one invocation. Rollout capacity is fixed (`rollout.max_concurrent_groups` =
one step's groups, like a fixed pool of sandboxes), so async can at best hide the shorter of rollout and
training behind the longer: the bound is (T_roll + T_train) / max(T_roll, T_train), from the sync run's own
phase times. Writes bench-results/async.json."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.bench

STEPS, WARMUP = 40, 5  # steps per run; the first WARMUP steps (start-up, first syncs) are not timed
PROMPTS, SAMPLES = 16, 8
MODES = [("sync", 0), ("async", 1), ("async", 2), ("async", 4)]


def run_mode(tmp_path: Path, mode: str, max_staleness: int) -> list[dict]:
    from glue.metrics.logger import read_metrics
    from launch.config import load_config
    from launch.run.runner import run

    cfg = load_config(str(REPO_ROOT / "examples/configs/demo_async.yaml"), [
        f"run.output_dir={tmp_path}", f"run.name={mode}_{max_staleness}", f"run.num_steps={STEPS}",
        f"run.mode={mode}", f"sync.max_staleness={max_staleness}", f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.samples_per_prompt={SAMPLES}", f"rollout.max_concurrent_groups={PROMPTS}",
        "rollout.task_args={min_latency_s: 0.05, max_latency_s: 0.25}"])
    return read_metrics(run(cfg) / "metrics.jsonl")


def summarize(records: list[dict]) -> dict[str, float]:
    timed = records[WARMUP:]
    wall = sum(r["time/step_s"] for r in timed)
    waited = sum(r["time/rollout_s"] for r in timed)
    return {
        "steps_timed": len(timed),
        "wall_s": wall,
        "samples_per_s": len(timed) * PROMPTS * SAMPLES / wall,
        "step_s_median": statistics.median(r["time/step_s"] for r in timed),
        "train_s_mean": statistics.mean(r["time/train_s"] for r in timed),
        "sync_s_mean": statistics.mean(r.get("time/sync_s", 0.0) for r in timed),
        "trainer_wait_s_mean": waited / len(timed),
        "trainer_idle_frac": waited / wall,
        "rollout_idle_frac": statistics.mean(r["time/rollout_idle_frac"] for r in timed),
        "staleness_max": max(r["staleness/max"] for r in timed),
        "staleness_mean": statistics.mean(r["staleness/mean"] for r in timed),
        "reward_last5": statistics.mean(r["rollout/reward_mean"] for r in records[-5:]),
    }


def test_async_training_against_sync_on_a_latency_bound_task(tmp_path):
    rows = {}
    for mode, bound in MODES:
        rows[f"{mode}_s{bound}"] = summarize(run_mode(tmp_path, mode, bound))
    sync = rows["sync_s0"]
    t_roll, t_train = sync["trainer_wait_s_mean"], sync["train_s_mean"] + sync["sync_s_mean"]
    limit = (t_roll + t_train) / max(t_roll, t_train)
    for name, row in rows.items():
        row["speedup_vs_sync"] = row["samples_per_s"] / sync["samples_per_s"]
        row["fraction_of_bound"] = row["speedup_vs_sync"] / limit
    result = {"task": "SlowToolEchoTask, rewards wait U(0.05, 0.25) s", "steps": STEPS, "warmup_steps": WARMUP,
              "prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES, "max_concurrent_groups": PROMPTS,
              "T_roll_s": t_roll, "T_train_s": t_train, "bound": limit, "modes": rows,
              "best_async": max((n for n in rows if n != "sync_s0"), key=lambda n: rows[n]["fraction_of_bound"])}
    out = REPO_ROOT / "bench-results" / "async.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    assert sync["staleness_max"] == 0
    assert all(rows[f"async_s{b}"]["staleness_max"] <= b for _, b in MODES[1:])
