"""Learning curves of several runs (seeds) of one setting, from their metrics.jsonl: the final reward, mean ± std by
step and by wall clock, and the time to reach a target reward. `make learning-table` writes them into
docs/async_learning.json and `glue.metrics.plots.write_learning_table_plots` draws them. Pure arithmetic; the one I/O is
`python -m glue.metrics.learning_curves OUT [PIECE...]` (`make learning-merge`): merge tables run in pieces into OUT."""
from __future__ import annotations

import bisect
import statistics
import json
import sys
from pathlib import Path
from typing import Any

FINAL_WINDOW = 5  # the final reward is the mean of the last FINAL_WINDOW steps' rollout/reward_mean
TIME_POINTS = 50  # points of the by-wall-clock grid
DIGITS = 4  # reward curves are stored rounded to this many digits
REACHED = 0.5 * 10 ** -DIGITS  # so a curve within half a unit of the last digit reaches its target


def run_curves(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's reward per step (`rollout/reward_mean`), the wall clock at the end of each step (`time/elapsed_s`,
    seconds since the training loop started) and its final reward."""
    steps = [r for r in records if r.get("step", 0) >= 1 and "rollout/reward_mean" in r]
    rewards = [float(r["rollout/reward_mean"]) for r in steps]
    return {"final_reward": statistics.mean(rewards[-FINAL_WINDOW:]), "reward_curve": rounded(rewards),
            "time_curve": [round(float(r["time/elapsed_s"]), 3) for r in steps]}


def trailing_mean(values: list[float], window: int = FINAL_WINDOW) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start): the final reward's smoothing."""
    return [statistics.mean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def time_to_reach(rewards: list[float], times: list[float], target: float) -> float | None:
    """The wall clock at the first step whose trailing mean reward reaches `target`; None if none does. With the
    sync row's final mean as target, the trailing mean of the sync row's own mean curve reaches it by the last step."""
    for reward, t in zip(trailing_mean(rewards), times):
        if reward >= target - REACHED:
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
    return {"seeds": [r.get("seed") for r in runs], "final_reward_mean": statistics.mean(finals),
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


def score_section(section: dict[str, Any]) -> None:
    """Set a table section's target (the sync row's final mean reward; None without a sync row) and, per row, the time
    to reach it and that time over the sync row's training time (issue 27's wall-clock target is <= 0.6)."""
    rows = section["settings"]
    sync = rows.get("sync")
    section["target_reward"] = target = sync["final_reward_mean"] if sync else None
    for row in rows.values():
        row["time_to_target_s"] = None
        if target is not None:
            add_time_to_target(row, target)
        row["time_to_target_vs_sync_train_s"] = (None if row["time_to_target_s"] is None else
                                                 row["time_to_target_s"] / sync["train_s_mean"])


def merge_rows(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """One row from two runs of the same setting: runs of other seeds add up, a seed run again takes the later run,
    and the row is summarised again over them all. Two settings under one name refuse to merge."""
    if earlier.get("setup") != later.get("setup"):
        raise ValueError(f"rows of one name, two setups: {earlier.get('setup')} then {later.get('setup')}")
    runs = list({run.get("seed"): run for run in [*earlier["runs"], *later["runs"]]}.values())
    return {**later, **summarise_row(runs), "runs": runs}


def merge_tables(tables: list[dict[str, Any]], primary: str, order: list[str] | None = None) -> dict[str, Any]:
    """One table from tables run in pieces, later ones winning: a row in two tables gets the runs of both
    (`merge_rows`: a seed in both takes the later run), other rows and sections stay. Rows go in `order` (default: as
    first seen; unknown names last), each section is scored again (a new sync row moves the target of every row
    beside it), and the top-level `settings` are the `primary` section's (the first section's if there is none).
    Header keys come from the last table, less `seeds`: each row lists its own."""
    sections: dict[str, Any] = {}
    for table in tables:
        for name, section in table["sections"].items():
            rows = dict(sections[name]["settings"]) if name in sections else {}
            for row_name, row in section["settings"].items():
                rows[row_name] = merge_rows(rows[row_name] if row_name in rows else {**row, "runs": []}, row)
            sections[name] = {**section, "settings": rows}
    order = order or [row for section in sections.values() for row in section["settings"]]
    for section in sections.values():
        section["settings"] = {k: section["settings"][k] for k in sorted(
            section["settings"], key=lambda k: order.index(k) if k in order else len(order))}
        score_section(section)
    primary = primary if primary in sections else next(iter(sections))
    header = {k: v for table in tables for k, v in table.items() if k not in ("sections", "settings", "seeds")}
    return {**header, "primary": primary, "task": sections[primary]["task"], "settings": sections[primary]["settings"],
            "sections": sections}


def rounded(values: list[float], digits: int = DIGITS) -> list[float]:
    return [round(v, digits) for v in values]


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m glue.metrics.learning_curves OUT [PIECE...] (OUT's own sections are kept if it "
                         "exists; OUT alone is summarised and scored again)")
    out, pieces = Path(argv[0]), [Path(p) for p in argv[1:]]
    tables = [json.loads(p.read_text()) for p in ([out] if out.exists() else []) + pieces]
    merged = merge_tables(tables, tables[0].get("primary", ""))
    out.write_text(json.dumps(merged, indent=1))
    for name, section in merged["sections"].items():
        print(name, "target", section["target_reward"])
        for row_name, row in section["settings"].items():
            print(f"  {row_name:28s} {row['final_reward_mean']:.3f} +- {row['final_reward_std']:.3f}  "
                  f"train {row['train_s_mean']:.1f} s  to target {row['time_to_target_s']} s "
                  f"({row['time_to_target_vs_sync_train_s']} x sync)")


if __name__ == "__main__":
    main(sys.argv[1:])
