"""Pictures of a run, drawn from its metrics.jsonl: reward, response length, train/*, staleness, off-policy ratios
and a per-step timeline of where the time went, as PNGs in runs/<name>/plots/. Written at the end of a run and by
`sluice plot`. Matplotlib's Agg canvas only (no window, no pyplot state); a figure whose keys are missing is skipped."""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Callable

from glue.metrics.logger import read_metrics

Records = list[dict[str, Any]]
MAX_TIMELINE_ROWS = 60  # more steps than this are shown as bins of consecutive steps
PHASES = [("time/rollout_s", "waiting for rollouts", "#e8a33d"), ("time/train_s", "train", "#3b75af"),
          ("time/sync_s", "weight sync", "#c03d3e"), ("eval/time_s", "eval", "#7c5ba6")]
TRAIN_FIRST = ["train/loss", "train/pg_loss", "train/clipfrac", "train/grad_norm", "train/entropy", "train/kl"]


def write_plots(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Draw every figure the run's metrics allow into `out_dir` (default `run_dir/plots`); returns the files
    written. Raises FileNotFoundError when `run_dir` has no metrics.jsonl."""
    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        figure = draw(records)
        if figure is None:
            continue
        figure.savefig(out / name, dpi=100)
        written.append(out / name)
    return written


def series(records: Records, key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the records that hold a finite number for it (NaN is logged as a string)."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(float(record.get("step", len(steps))))
            values.append(float(value))
    return steps, values


def numeric_keys(records: Records, prefix: str) -> list[str]:
    """Every key under `prefix` that holds a number in some record, in first-seen order."""
    seen: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith(prefix) and isinstance(value, (int, float)) and not isinstance(value, bool):
                seen.setdefault(key)
    return list(seen)


def moving_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the `window - 1` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def new_figure(width: float, height: float, rows: int = 1, cols: int = 1, **kwargs):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    return figure, figure.subplots(rows, cols, squeeze=False, **kwargs)


def finish(ax, title: str, ylabel: str, xlabel: str = "step") -> None:
    from matplotlib.ticker import MaxNLocator

    if xlabel == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def plot_reward(records: Records):
    """Train reward (mean over each step's samples, ± std, and a moving mean) with eval reward and pass@k."""
    steps, reward = series(records, "rollout/reward_mean")
    evals = [k for k in numeric_keys(records, "eval/") if k == "eval/reward_mean" or k.startswith("eval/pass@")]
    if not steps and not evals:
        return None
    figure, axes = new_figure(9, 5)
    ax = axes[0][0]
    if steps:
        _, std = series(records, "rollout/reward_std")
        if len(std) == len(reward):
            ax.fill_between(steps, [r - s for r, s in zip(reward, std)], [r + s for r, s in zip(reward, std)],
                            color="C0", alpha=0.12, label="train ± std over samples")
        window = max(1, len(reward) // 20)
        ax.plot(steps, reward, color="C0", alpha=0.45 if window > 1 else 1.0, lw=1, label="train (rollout/reward_mean)")
        if window > 1:
            ax.plot(steps, moving_mean(reward, window), color="C0", lw=2.2, label=f"train, mean of last {window} steps")
    for i, key in enumerate(evals):
        ax.plot(*series(records, key), marker="o", ms=4, lw=1.6, ls="-" if key == "eval/reward_mean" else "--",
                color=f"C{i + 1}", label=key)
    finish(ax, "Reward: train rollouts" + (" and held-out eval" if evals else ""), "reward")
    return figure


def plot_response_length(records: Records):
    """Mean response length in tokens (train and eval), and the share of responses cut at max_new_tokens."""
    lengths = [k for k in ("rollout/response_len_mean", "eval/response_len_mean") if series(records, k)[0]]
    truncated = [k for k in ("rollout/truncated_frac", "eval/truncated_frac") if series(records, k)[0]]
    if not lengths:
        return None
    figure, axes = new_figure(9, 6.5 if truncated else 4.5, 2 if truncated else 1, 1, sharex=True)
    for key in lengths:
        axes[0][0].plot(*series(records, key), marker="o" if key.startswith("eval/") else None, ms=4, label=key)
    finish(axes[0][0], "Response length", "tokens (mean over samples)", xlabel="")
    if truncated:
        for key in truncated:
            axes[1][0].plot(*series(records, key), marker="o" if key.startswith("eval/") else None, ms=4, label=key)
        axes[1][0].set_ylim(-0.03, 1.03)
        finish(axes[1][0], "Truncated responses (hit max_new_tokens)", "share of samples")
    return figure


def plot_train(records: Records):
    """One small panel per train/* key (loss, clipfrac, grad norm, ...); the ratio families have their own figure."""
    keys = [k for k in numeric_keys(records, "train/")
            if not k.startswith(("train/discrepancy/", "train/staleness/"))]
    if not keys:
        return None
    keys.sort(key=lambda k: (TRAIN_FIRST.index(k) if k in TRAIN_FIRST else len(TRAIN_FIRST), k))
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    figure, axes = new_figure(4.2 * cols, 2.8 * rows + 0.5, rows, cols)
    for i, ax in enumerate(ax for row in axes for ax in row):
        if i >= len(keys):
            ax.set_visible(False)
            continue
        ax.plot(*series(records, keys[i]), color=f"C{i % 10}", lw=1.4)
        finish(ax, keys[i].removeprefix("train/"), "")
    figure.suptitle("Trainer metrics (train/*) per step")
    return figure


def plot_staleness(records: Records):
    """Share of trained tokens at each staleness (stacked bars per step) and the staleness/lag summaries."""
    hist = sorted((k for k in numeric_keys(records, "staleness/hist_") if k.rsplit("_", 1)[1].isdigit()),
                  key=lambda k: int(k.rsplit("_", 1)[1]))
    lines = [k for k in ("staleness/max", "staleness/mean", "staleness/in_flight", "staleness/in_queue",
                         "weights/lag") if series(records, k)[0]]
    if not hist and not lines:
        return None
    figure, axes = new_figure(9, 3.6 * (bool(hist) + bool(lines)) + 0.4, bool(hist) + bool(lines), 1, sharex=True)
    if hist:
        ax = axes[0][0]
        rows = [r for r in records if any(k in r for k in hist)]
        steps = [float(r.get("step", i)) for i, r in enumerate(rows)]
        bottom = [0.0] * len(rows)
        for key, color in zip(hist, _sequential(len(hist))):
            share = [_number(r.get(key)) for r in rows]
            ax.bar(steps, share, bottom=bottom, width=1.0, color=color, label=f"{key.rsplit('_', 1)[1]} behind")
            bottom = [b + s for b, s in zip(bottom, share)]
        ax.set_ylim(0, 1.02)
        finish(ax, "Token staleness per step (versions behind the trainer)", "share of trained tokens", xlabel="")
    row = 1 if hist else 0
    if lines:
        ax = axes[row][0]
        for key in lines:
            ax.plot(*series(records, key), lw=1.5, label=key)
        finish(ax, "Staleness and lag", "versions")
    return figure


def _number(value: Any) -> float:
    """A logged value as a number for stacking: anything else (missing, "nan") counts as 0."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0


def _sequential(n: int) -> list:
    from matplotlib import colormaps

    return [colormaps["viridis"](0.15 + 0.75 * i / max(1, n - 1)) for i in range(n)]


RATIO_FAMILIES = [("train/discrepancy/", "trainer vs rollout engine logprobs"),
                  ("train/staleness/", "current policy vs the (stale) behaviour policy")]


def plot_ratios(records: Records):
    """Per family (train/discrepancy/*, train/staleness/*): the importance ratio's min..max band and mean per
    step, and the distribution over steps of the mean |log ratio|."""
    from matplotlib.ticker import MaxNLocator

    families = [(p, d) for p, d in RATIO_FAMILIES if numeric_keys(records, p)]
    if not families:
        return None
    figure, axes = new_figure(12, 3.8 * len(families) + 0.4, len(families), 2, width_ratios=[2, 1])
    for (prefix, description), (band_ax, hist_ax) in zip(families, axes):
        name = prefix.rstrip("/").removeprefix("train/")
        lo, hi, mean = (series(records, prefix + k) for k in ("ratio_min", "ratio_max", "ratio_mean"))
        if lo[0] and len(lo[1]) == len(hi[1]):
            band_ax.fill_between(lo[0], lo[1], hi[1], color="C0", alpha=0.25, label="min..max over tokens")
            if min(lo[1]) > 0 and max(hi[1]) / min(lo[1]) > 20:  # heavy tails: keep both ends readable
                _plain_log_scale(band_ax)
        if mean[0]:
            band_ax.plot(*mean, color="C0", lw=1.6, label="mean")
        band_ax.axhline(1.0, color="k", lw=0.8, ls="--", label="ratio 1 (on-policy)")
        finish(band_ax, f"{name} ratio: {description}", "importance ratio")
        steps, spread = series(records, prefix + "abs_log_ratio_mean")
        if spread:
            low, high = min(spread), max(spread)
            pad = 0.0 if high > low else 0.1 * abs(low) + 1e-3  # one value: a narrow bin around it, not +-0.5
            hist_ax.hist(spread, bins=min(30, max(5, len(spread) // 3)), range=(low - pad, high + pad), color="C1",
                         alpha=0.8)
            hist_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            finish(hist_ax, f"{name}: mean |log ratio|, over steps", "steps", xlabel="mean |log ratio| of a step")
        else:
            hist_ax.set_visible(False)
    figure.suptitle("Off-policy ratio distributions (train/discrepancy/*, train/staleness/*)")
    return figure


def _plain_log_scale(ax) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def timeline_rows(records: Records, max_rows: int = MAX_TIMELINE_ROWS) -> list[tuple[str, dict[str, float]]]:
    """(label, mean seconds / fractions) per step, or per bin of consecutive steps when there are more than
    `max_rows` steps; only records of train steps (ones holding time/* keys) count."""
    phase_keys = [k for k, _, _ in PHASES]
    keys = phase_keys + ["time/step_s", "time/rollout_idle_frac", "time/trainer_idle_frac"]
    steps = [r for r in records if any(isinstance(r.get(k), (int, float)) for k in ("time/step_s", "time/train_s"))]
    size = max(1, math.ceil(len(steps) / max_rows))
    rows = []
    for start in range(0, len(steps), size):
        chunk = steps[start:start + size]
        values = {}
        for key in keys:
            numbers = [float(r[key]) for r in chunk if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if numbers:  # a phase missing from a step took 0 s there (e.g. eval); a missing fraction is unknown
                values[key] = sum(numbers) / (len(chunk) if key in phase_keys else len(numbers))
        first, last = chunk[0].get("step", start + 1), chunk[-1].get("step", start + len(chunk))
        rows.append((f"{first}" if size == 1 else f"{first}-{last}", values))
    return rows


def plot_timeline(records: Records):
    """Per step: a horizontal bar stacked from the trainer's phases (waiting for rollouts, train, weight sync,
    eval, the rest), beside the share of the step the engines were idle and the trainer waited. Sync mode shows
    long waits and idle engines; async that overlaps shows train-dominated bars and low idle shares."""
    rows = timeline_rows(records)
    if not rows:
        return None
    labels = [label for label, _ in rows]
    y = list(range(len(rows)))
    figure, axes = new_figure(13, min(18.0, 2.2 + 0.24 * len(rows)), 1, 2, sharey=True, width_ratios=[3, 1])
    time_ax, idle_ax = axes[0]
    left = [0.0] * len(rows)
    for key, name, color in PHASES + [("other", "other (rewards, batching, logging)", "#b0b0b0")]:
        if key == "other":
            width = [max(0.0, v.get("time/step_s", 0.0) - used) for (_, v), used in zip(rows, left)]
        else:
            width = [v.get(key, 0.0) for _, v in rows]
        if any(width):
            time_ax.barh(y, width, left=left, height=0.8, color=color, label=name)
            left = [a + b for a, b in zip(left, width)]
    time_ax.set_yticks(y, labels, fontsize="small" if len(rows) > 30 else None)
    time_ax.invert_yaxis()
    time_ax.set_title("Trainer time per step")
    time_ax.set_xlabel("seconds")
    time_ax.set_ylabel("step" if all("-" not in label for label in labels) else "steps (mean over each bin)")
    time_ax.grid(axis="x", alpha=0.3)
    for offset, key, name, color in ((-0.2, "time/rollout_idle_frac", "engines idle", "#5aa05a"),
                                     (0.2, "time/trainer_idle_frac", "trainer waiting", "#e8a33d")):
        share = [v.get(key, 0.0) for _, v in rows]
        if any(key in v for _, v in rows):
            idle_ax.barh([i + offset for i in y], share, height=0.4, color=color, label=name)
    idle_ax.set_xlim(0, 1)
    idle_ax.set_title("Idle share of each step")
    idle_ax.set_xlabel("fraction of step wall time")
    idle_ax.grid(axis="x", alpha=0.3)
    handles, names = (a + b for a, b in zip(time_ax.get_legend_handles_labels(), idle_ax.get_legend_handles_labels()))
    figure.legend(handles, names, loc="outside lower center", ncols=len(names), fontsize="small")  # bars stay clear
    figure.suptitle(timeline_summary(records))
    return figure


def timeline_summary(records: Records) -> str:
    """The headline: how much of the run's wall time the trainer waited and the engines sat idle."""
    wall = series(records, "time/step_s")[1]
    total = sum(wall)
    if not total:
        return "Step timeline"
    waited = sum(series(records, "time/rollout_s")[1]) / total
    idle = [r["time/rollout_idle_frac"] * r["time/step_s"] for r in records
            if isinstance(r.get("time/rollout_idle_frac"), (int, float)) and isinstance(r.get("time/step_s"),
                                                                                       (int, float))]
    text = f"Step timeline: {len(wall)} steps, {total:.1f} s; trainer waited for rollouts {waited:.0%} of it"
    return text + (f", engines idle {sum(idle) / total:.0%}" if idle else "")


FIGURES: dict[str, Callable[[Records], Any]] = {
    "reward.png": plot_reward, "response_length.png": plot_response_length, "train.png": plot_train,
    "staleness.png": plot_staleness, "ratios.png": plot_ratios, "timeline.png": plot_timeline}


def write_learning_table_plots(table_path: Path) -> list[Path]:
    """Draw `make learning-table`'s JSON (docs/async_learning.json): per section (task x lr) one PNG next to it,
    `<stem>_<task>_lr<lr>.png`, mean reward ± std over seeds of each row by step and by wall clock, with the
    sync row's final reward as a dashed line. Re-drawable from the JSON alone."""
    import json

    table_path = Path(table_path)
    table = json.loads(table_path.read_text())
    sections = table.get("sections") or {table.get("primary", "table"): {"settings": table["settings"]}}
    written = []
    for name, section in sections.items():
        figure = plot_learning_section(name, section)
        path = table_path.with_name(f"{table_path.stem}_{name.replace('/lr=', '_lr')}.png")
        figure.savefig(path, dpi=100)
        written.append(path)
    return written


def plot_learning_section(name: str, section: dict[str, Any]):
    """Two panels: reward by step and by wall clock (seconds of training), a mean line and a ± std band per row."""
    figure, axes = new_figure(13, 5, 1, 2, sharey=True)
    for i, (row, data) in enumerate(section["settings"].items()):
        n = len(data.get("runs", []))
        label = f"{row} ({data['final_reward_mean']:.2f} ± {data['final_reward_std']:.2f}, n={n})"
        for ax, x, curve in ((axes[0][0], None, data["reward_by_step"]),
                             (axes[0][1], data["reward_by_time"]["time_s"], data["reward_by_time"])):
            x = x or list(range(1, len(curve["mean"]) + 1))
            ax.plot(x, curve["mean"], color=f"C{i}", lw=1.8, label=label)
            ax.fill_between(x, [m - s for m, s in zip(curve["mean"], curve["std"])],
                            [m + s for m, s in zip(curve["mean"], curve["std"])], color=f"C{i}", alpha=0.12)
    for ax in axes[0]:
        if section.get("target_reward") is not None:
            ax.axhline(section["target_reward"], color="grey", ls="--", lw=1, label="sync's final reward")
    finish(axes[0][0], f"{name}: reward by step (mean ± std over seeds)", "rollout/reward_mean")
    finish(axes[0][1], f"{name}: reward by wall clock", "rollout/reward_mean", xlabel="seconds of training")
    return figure


def write_eval_runs_plot(path: Path, groups: dict[str, list[dict[str, Any]]], title: str) -> Path:
    """Greedy eval accuracy of several runs per group (e.g. sync, async S=2), by step and by wall clock: each run
    thin, each group's mean by step thick, and the first group's mean final accuracy as a dashed line. A run is
    {"eval_pass_at_1": {step: acc}, "elapsed_s_at_step": {step: s}} (docs/async_smollm2.json's shape)."""
    figure, axes = new_figure(13, 5, 1, 2, sharey=True)
    target = None
    for i, (group, runs) in enumerate(groups.items()):
        steps = sorted(int(k) for k in runs[0]["eval_pass_at_1"])
        mean = [statistics.mean(r["eval_pass_at_1"][str(k)] for r in runs) for k in steps]
        target = mean[-1] if target is None else target
        for run in runs:
            accuracy = [run["eval_pass_at_1"][str(k)] for k in steps]
            axes[0][0].plot(steps, accuracy, color=f"C{i}", lw=0.8, alpha=0.5, marker="o", ms=3)
            axes[0][1].plot([run["elapsed_s_at_step"][str(k)] for k in steps], accuracy, color=f"C{i}", lw=0.8,
                            alpha=0.5, marker="o", ms=3)
        axes[0][0].plot(steps, mean, color=f"C{i}", lw=2.2,
                        label=f"{group}: mean of {len(runs)} (final {mean[-1]:.3f})")
        seconds = [statistics.mean(r["elapsed_s_at_step"][str(k)] for r in runs) for k in steps]
        axes[0][1].plot(seconds, mean, color=f"C{i}", lw=2.2, label=f"{group}: mean at mean time")
    for ax in axes[0]:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"{next(iter(groups))}'s mean final accuracy")
    finish(axes[0][0], f"{title}: greedy eval accuracy by step", "eval/pass@1")
    finish(axes[0][1], f"{title}: by wall clock", "eval/pass@1", xlabel="seconds of training")
    figure.savefig(path, dpi=100)
    return Path(path)
