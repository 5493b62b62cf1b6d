"""`make learning-table`: what staleness costs in learning. Eight settings x three seeds, the same number of samples
each (60 steps x 16 prompts x 8 samples) on the slow-tool echo task (rewards wait 0.2-1.0 s, so async runs do
reach their staleness bound), about 20 minutes on 2 cores. Every setting names its correction, so a change of
demo_async.yaml's own does not move the rows. Writes docs/async_learning.json; docs/async.md carries the table."""
from __future__ import annotations

import json
import statistics
import time

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.learning

STEPS, SEEDS = 60, (0, 1, 2)
SETTINGS = {
    "sync": ("demo_async.yaml", ["run.mode=sync", "sync.max_staleness=0", "loss.correction=none"]),
    "async_s2_recompute": ("demo_async.yaml", ["sync.max_staleness=2", "trainer.old_logprobs=recompute",
                                               "loss.correction=none"]),
    "async_s2_recompute_tis": ("demo_async.yaml", ["sync.max_staleness=2", "trainer.old_logprobs=recompute",
                                                   "loss.correction=tis"]),
    "async_s8_recompute": ("demo_async.yaml", ["sync.max_staleness=8", "trainer.old_logprobs=recompute",
                                               "loss.correction=none"]),
    "async_s8_recompute_tis": ("demo_async.yaml", ["sync.max_staleness=8", "trainer.old_logprobs=recompute",
                                                   "loss.correction=tis"]),
    "async_s8_rollout_no_correction": ("demo_async.yaml", ["sync.max_staleness=8", "loss.old_logprobs_from=rollout",
                                                           "loss.correction=none"]),
    "async_s8_snapshot_icepop_clip": ("demo_async.yaml", ["sync.max_staleness=8", "trainer.old_logprobs=snapshot",
                                                          "loss.correction=icepop"]),
    "mu_grpo_4_stages": ("mu_grpo.yaml", ["sync.interval=15", "sync.max_staleness=14"]),
}


def run_one(tmp_path, name: str, seed: int) -> dict:
    from glue.metrics import read_metrics
    from launch.config import load_config
    from launch.runner import run

    config, overrides = SETTINGS[name]
    cfg = load_config(str(REPO_ROOT / "examples/configs" / config), [
        *overrides, f"run.output_dir={tmp_path}", f"run.name={name}_{seed}", f"run.num_steps={STEPS}",
        f"run.seed={seed}", f"model.tiny.seed={seed}"])
    started = time.perf_counter()
    records = read_metrics(run(cfg) / "metrics.jsonl")
    return {"seed": seed, "final_reward": statistics.mean(r["rollout/reward_mean"] for r in records[-5:]),
            "wall_s": time.perf_counter() - started,
            "staleness_max": max(r["staleness/max"] for r in records),
            "staleness_mean": statistics.mean(r["staleness/mean"] for r in records),
            "syncs": records[-1]["async/syncs"],
            "reward_curve": [round(r["rollout/reward_mean"], 4) for r in records]}


@pytest.mark.timeout(3600)
def test_learning_table(tmp_path):
    table = {}
    for name in SETTINGS:
        runs = [run_one(tmp_path, name, seed) for seed in SEEDS]
        finals = [r["final_reward"] for r in runs]
        table[name] = {"final_reward_mean": statistics.mean(finals), "final_reward_std": statistics.stdev(finals),
                       "wall_s_mean": statistics.mean(r["wall_s"] for r in runs), "runs": runs}
        print(name, json.dumps({k: v for k, v in table[name].items() if k != "runs"}), flush=True)
    out = REPO_ROOT / "docs" / "async_learning.json"
    out.write_text(json.dumps({"steps": STEPS, "prompts_per_step": 16, "samples_per_prompt": 8,
                               "task": "SlowToolEchoTask, rewards wait U(0.2, 1.0) s", "settings": table}, indent=1))
    assert all(r["staleness_max"] <= 8 for name in ("async_s8_rollout_no_correction", "async_s8_snapshot_icepop_clip")
               for r in table[name]["runs"])
    assert all(r["syncs"] == STEPS // 15 for r in table["mu_grpo_4_stages"]["runs"])
