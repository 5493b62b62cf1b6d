"""Step records reach TensorBoard (read back with TensorBoard's own event reader) and W&B offline, with the run's
config and commit beside them; run.loggers is validated at config time."""
import importlib.util
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from glue.metrics.logger import git_commit, open_run_logger, run_info
from launch.config import ConfigError, load_config


def read_events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def log_steps(run_dir: Path, steps, resume_step=None, scale=1.0, loggers=("jsonl", "tensorboard")) -> None:
    logger = open_run_logger(run_dir, loggers=list(loggers), info=run_info({"run": {"name": "t"}}),
                             resume_step=resume_step)
    for step in steps:
        logger.log({"step": step, "rollout/reward_mean": scale * step / 10, "train/loss": float("nan"),
                    "rollout/group_ids": "0,2-3", "weights/version": step})
    logger.close()


def test_tensorboard_event_files_hold_the_numeric_values_and_not_the_strings(tmp_path):
    log_steps(tmp_path, [1, 2, 3])
    events = read_events(tmp_path / "tensorboard")
    rewards = [(e.step, round(e.value, 5)) for e in events.Scalars("rollout/reward_mean")]
    assert rewards == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.value for e in events.Scalars("weights/version")] == [1.0, 2.0, 3.0]
    tags = events.Tags()["scalars"]
    assert "rollout/group_ids" not in tags and "train/loss" not in tags  # a string, and NaN (logged as "nan")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/group_ids"] for r in lines] == ["0,2-3"] * 3 and lines[0]["train/loss"] == "nan"


def next_second() -> None:
    """torch names an event file by the second it was opened, then by a per-process counter compared as text
    ("...10" sorts before "...9"), and TensorBoard reads a folder's files in name order: two writers one process opens
    in one second can be read out of order, once enough writers came before them in the session. A resumed run is a
    new process, seconds after the one it resumes, so only a test meets this."""
    time.sleep(1.01 - time.time() % 1)


def test_a_resumed_run_replaces_the_tensorboard_steps_logged_after_its_checkpoint(tmp_path):
    log_steps(tmp_path, [1, 2, 3, 4, 5])
    next_second()
    log_steps(tmp_path, [4, 5], resume_step=3, scale=10.0)
    values = [(e.step, round(e.value, 5)) for e in read_events(tmp_path / "tensorboard").Scalars("rollout/reward_mean")]
    assert values == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 4.0), (5, 5.0)]


def test_a_fresh_start_clears_the_events_of_the_run_it_replaces(tmp_path):
    log_steps(tmp_path, [1, 2, 3, 4])
    log_steps(tmp_path, [1, 2])
    steps = [e.step for e in read_events(tmp_path / "tensorboard").Scalars("rollout/reward_mean")]
    assert steps == [1, 2]


def test_the_run_info_holds_the_config_and_commit_in_the_run_folder_and_in_tensorboard(tmp_path):
    log_steps(tmp_path, [1])
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["config"] == {"run": {"name": "t"}} and info["resumed_from_step"] is None
    if shutil.which("git") and (Path(__file__).parents[1] / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parents[1]).stdout.strip()
        assert info["git"]["commit"] == head
    text = read_events(tmp_path / "tensorboard").Tensors("run_info/text_summary")[0].tensor_proto.string_val[0]
    assert '"name": "t"' in text.decode()


def test_a_folder_outside_any_git_checkout_has_no_commit(tmp_path):
    assert git_commit(tmp_path) is None


def test_the_default_loggers_are_jsonl_and_tensorboard():
    cfg = load_config("examples/configs/demo.yaml")
    assert cfg.run.loggers == ["jsonl", "tensorboard"] and cfg.run.wandb.mode == "offline"


def test_an_unknown_logger_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"run.loggers: unknown logger 'tb'; choose from \['jsonl', 'tensorboard'"):
        load_config("examples/configs/demo.yaml", ["run.loggers=[jsonl,tb]"])


def test_wandb_without_the_package_is_a_config_error_saying_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        load_config("examples/configs/demo.yaml", ["run.loggers=[jsonl,wandb]"])


def test_wandb_offline_writes_a_local_run_that_a_resumed_run_continues(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    log_steps(run_dir, [1, 2], loggers=("jsonl", "wandb"))
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{12}", run_id)
    log_steps(run_dir, [3], resume_step=2, loggers=("jsonl", "wandb"))
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    # one folder per session, both named after the same run id (W&B adds "-1" when they start in the same second)
    assert len(offline) == 2, offline
    assert all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", name) for name in offline), offline
    logs = [path for name in offline for path in (run_dir / "wandb" / name).glob(f"run-{run_id}*.wandb")]
    assert len(logs) == 2 and all(path.stat().st_size > 0 for path in logs), logs
