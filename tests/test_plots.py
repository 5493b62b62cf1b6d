"""glue.metrics.plots draws a run's metrics.jsonl: sync-like and async-like records (eval at some steps, keys missing at
others) give the expected PNGs, figures whose keys are absent are skipped, and `sluice plot` exits 0 or 2."""
import json
import struct
from pathlib import Path

import pytest

from glue.metrics.plots import timeline_rows, timeline_summary, write_plots
from launch.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL = {"reward.png", "response_length.png", "train.png", "staleness.png", "ratios.png", "timeline.png"}


def sync_like(steps: int = 12) -> list[dict]:
    """Rollout then train then sync: the trainer waits for every batch and the engines idle while it trains."""
    records = [{"step": 0, "eval/reward_mean": 0.1, "eval/pass@4": 0.3, "eval/time_s": 0.4, "weights/version": 0}]
    for step in range(1, steps + 1):
        record = {"step": step, "rollout/reward_mean": 0.05 * step, "rollout/reward_std": 0.1,
                  "rollout/response_len_mean": 4.0 + step % 3, "rollout/truncated_frac": 0.5,
                  "rollout/group_ids": "0-3", "train/loss": 0.1 / step, "train/clipfrac": 0.01,
                  "train/grad_norm": 1.0 + step % 2, "staleness/max": 0.0, "staleness/mean": 0.0,
                  "staleness/hist_0": 1.0, "time/rollout_s": 2.0, "time/train_s": 1.0, "time/sync_s": 0.5,
                  "time/step_s": 3.6, "time/rollout_idle_frac": 0.42, "time/trainer_idle_frac": 0.56,
                  "weights/version": step}
        if step % 5 == 0:
            record.update({"eval/reward_mean": 0.05 * step, "eval/pass@4": 0.1 * step, "eval/time_s": 0.3,
                           "eval/response_len_mean": 5.0})
        if step == 7:  # a NaN loss is logged as a string; a step without a sync has no time/sync_s
            record["train/loss"] = "nan"
            del record["time/sync_s"]
        records.append(record)
    return records


def async_like(steps: int = 12) -> list[dict]:
    """Rollout overlaps training: short waits, stale tokens, off-policy ratios logged."""
    records = []
    for step, record in enumerate(sync_like(steps)[1:], start=1):
        behind = min(step - 1, 2)
        record.update({"time/rollout_s": 0.05, "time/train_s": 1.0, "time/sync_s": 0.2, "time/step_s": 1.3,
                       "time/rollout_idle_frac": 0.05, "time/trainer_idle_frac": 0.04,
                       "staleness/max": float(behind), "staleness/mean": behind * 0.7,
                       "staleness/in_flight": 1.0, "weights/lag": 0.0,
                       "train/discrepancy/ratio_min": 0.6, "train/discrepancy/ratio_max": 1.8,
                       "train/discrepancy/ratio_mean": 1.0, "train/discrepancy/abs_log_ratio_mean": 0.01 * step,
                       "train/staleness/ratio_min": 0.9, "train/staleness/ratio_max": 1.2,
                       "train/staleness/ratio_mean": 1.01, "train/staleness/abs_log_ratio_mean": 0.02})
        record.pop("staleness/hist_0")
        record.update({f"staleness/hist_{s}": 1.0 / (behind + 1) for s in range(behind + 1)})
        records.append(record)
    return records


def write_run(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width >= 600 and height >= 300, (path, width, height)


def test_a_sync_like_run_gets_every_figure_but_the_ratio_one(tmp_path):
    run_dir = write_run(tmp_path / "sync", sync_like())
    written = write_plots(run_dir)
    assert {p.name for p in written} == ALL - {"ratios.png"}  # no train/discrepancy/* or train/staleness/* keys
    assert all(p.parent == run_dir / "plots" for p in written)
    for path in written:
        assert_png(path)


def test_sluice_plot_draws_all_six_figures_of_an_async_like_run_and_exits_0(tmp_path, capsys):
    run_dir = write_run(tmp_path / "async", async_like())
    assert main(["plot", str(run_dir), "--out", str(tmp_path / "pngs")]) == 0
    listed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in listed) == sorted(ALL)
    for name in ALL:
        assert_png(tmp_path / "pngs" / name)
    assert not (run_dir / "plots").exists()


def test_a_run_with_only_a_reward_gets_only_the_reward_figure(tmp_path):
    run_dir = write_run(tmp_path / "bare", [{"step": 1, "rollout/reward_mean": 0.2}, {"step": 2, "note": "x"}])
    assert [p.name for p in write_plots(run_dir)] == ["reward.png"]


@pytest.mark.parametrize("metrics", [None, ""])
def test_sluice_plot_on_a_folder_without_metrics_exits_2_with_one_line(tmp_path, capsys, metrics):
    if metrics is not None:
        (tmp_path / "metrics.jsonl").write_text(metrics)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "metrics.jsonl" in err, err
    assert not (tmp_path / "plots").exists()


def test_the_timeline_bins_a_long_run_and_averages_each_bin():
    records = [{"step": s, "time/train_s": float(s), "time/step_s": 2.0 * s} for s in range(1, 151)]
    records[1]["eval/time_s"] = 0.9  # eval at step 2 only: 0.3 s a step over the bin of steps 1-3
    rows = timeline_rows(records, max_rows=60)
    assert len(rows) == 50  # 150 steps in bins of ceil(150 / 60) = 3
    assert rows[0] == ("1-3", {"time/train_s": 2.0, "eval/time_s": 0.3, "time/step_s": 4.0})
    assert rows[-1][0] == "148-150"


def test_the_timeline_headline_says_how_long_the_trainer_waited_and_the_engines_idled():
    records = [{"step": 0, "eval/time_s": 1.0},
               {"step": 1, "time/rollout_s": 3.0, "time/step_s": 4.0, "time/rollout_idle_frac": 0.5},
               {"step": 2, "time/rollout_s": 0.0, "time/step_s": 4.0, "time/rollout_idle_frac": 0.0}]
    # waited 3 of 8 s = 38%; engines idle 0.5 x 4 s of 8 s = 25%
    assert timeline_summary(records) == ("Step timeline: 2 steps, 8.0 s; trainer waited for rollouts 38% of it, "
                                         "engines idle 25%")


def test_a_failing_plot_costs_the_run_one_warning_line(tmp_path, capsys, monkeypatch):
    import launch.run.folder
    from launch.run.folder import plot_run

    def broken(run_dir):
        raise RuntimeError("no font\nsecond line")

    monkeypatch.setattr(launch.run.folder, "write_plots", broken)
    assert plot_run(tmp_path) == ""
    out = capsys.readouterr().out
    assert out.splitlines() == [f"sluice: warning: plots not written (RuntimeError: no font); try `sluice plot "
                                f"{tmp_path}`"]
