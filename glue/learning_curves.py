"""Learning curves of several runs (seeds) of one setting, from their metrics.jsonl: the final reward, mean ± std by
step and by wall clock, and the time to reach a target reward. `make learning-table` writes them into
docs/async_learning.json and `glue.plots.write_learning_table_plots` draws them. Pure arithmetic, no I/O."""
from __future__ import annotations

import bisect
import statistics
from typing import Any

FINAL_WINDOW = 5  # the final reward is the mean of the last FINAL_WINDOW steps' rollout/reward_mean
TIME_POINTS = 50  # points of the by-wall-clock grid


def run_curves(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's reward per step (`rollout/reward_mean`), the wall clock at the end of each step (`time/elapsed_s`,
    seconds since the training loop started) and its final reward."""
    steps = [r for r in records if r.get("step", 0) >= 1 and "rollout/reward_mean" in r]
    rewards = [float(r["rollout/reward_mean"]) for r in steps]
    return {"final_reward": statistics.mean(rewards[-FINAL_WINDOW:]), "reward_curve": [round(x, 4) for x in rewards],
            "time_curve": [round(float(r["time/elapsed_s"]), 3) for r in steps]}


def trailing_mean(values: list[float], window: int = FINAL_WINDOW) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start): the final reward's smoothing."""
    return [statistics.mean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def time_to_reach(rewards: list[float], times: list[float], target: float) -> float | None:
    """The wall clock at the first step whose trailing mean reward reaches `target`; None if none does. With the
    sync row's final mean as target, the trailing mean of the sync row's own mean curve reaches it by the last step."""
    for reward, t in zip(trailing_mean(rewards), times):
        if reward >= target - 1e-12:
            return t
    return None


def mean_std(columns: list[list[float]]) -> tuple[list[float], list[float]]:
    """Per position, the mean and sample std (0 for one run) of equally long rows."""
    by_position = list(zip(*columns))
    return ([statistics.mean(c) for c in by_position],
            [statistics.stdev(c) if len(c) > 1 else 0.0 for c in by_position])


def reward_at(times: list[float], rewards: list[float], t: float) -> float:
    """The reward of the last step finished by time `t` (the first step's before it ends)."""
    return rewards[max(bisect.bisect_right(times, t) - 1, 0)]


def summarise_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A setting's runs (each with final_reward, reward_curve, time_curve, wall_s) as the table's row: final reward
    mean ± std, wall time, and the reward curves' mean ± std by step and by wall clock. By wall clock the grid ends at
    the shortest run's end, so every point averages every run."""
    finals = [r["final_reward"] for r in runs]
    steps = min(len(r["reward_curve"]) for r in runs)
    by_step_mean, by_step_std = mean_std([r["reward_curve"][:steps] for r in runs])
    end = min(r["time_curve"][-1] for r in runs)
    grid = [round(end * (i + 1) / TIME_POINTS, 3) for i in range(TIME_POINTS)]
    by_time_mean, by_time_std = mean_std([[reward_at(r["time_curve"], r["reward_curve"], t) for t in grid]
                                          for r in runs])
    return {"final_reward_mean": statistics.mean(finals),
            "final_reward_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "wall_s_mean": statistics.mean(r["wall_s"] for r in runs),
            "train_s_mean": statistics.mean(r["time_curve"][-1] for r in runs),
            "reward_by_step": {"mean": rounded(by_step_mean), "std": rounded(by_step_std),
                               "time_s_mean": rounded(mean_std([r["time_curve"][:steps] for r in runs])[0], 3)},
            "reward_by_time": {"time_s": grid, "mean": rounded(by_time_mean), "std": rounded(by_time_std)}}


def add_time_to_target(row: dict[str, Any], target: float) -> None:
    """`time_to_target_s`: when the row's mean curve (mean over seeds by step, trailing-mean smoothed as the final
    reward is) first reaches `target`, at the mean wall clock of that step; None if it never does. Each run's own
    time (None if it never gets there) goes into the run, and how many did into `runs_reaching_target`."""
    curve = row["reward_by_step"]
    row["time_to_target_s"] = time_to_reach(curve["mean"], curve["time_s_mean"], target)
    for run in row["runs"]:
        run["time_to_target_s"] = time_to_reach(run["reward_curve"], run["time_curve"], target)
    row["runs_reaching_target"] = sum(run["time_to_target_s"] is not None for run in row["runs"])


def rounded(values: list[float], digits: int = 4) -> list[float]:
    return [round(v, digits) for v in values]
