"""A trainer rank's output and its death: each rank writes `trainer_<rank>.log` in the run's logs/ folder; a rank
killed mid-run ends the run with one line naming the rank, its node and that log, and no traceback from the calls
that stop the rest (closing the weight channel on a dead rank)."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import is_alive, sluice_run
from glue.metrics.logger import read_metrics


def rank_pid(log: Path, timeout_s: float = 60) -> int:
    """The pid a rank wrote at the top of its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"sluice: trainer rank \d+ of \d+, pid (\d+)", log.read_text() if log.exists() else "")
        if found:
            return int(found.group(1))
        time.sleep(0.2)
    raise AssertionError(f"{log} never named its pid")


def test_a_rank_writes_its_log_and_its_death_is_named_with_rank_node_and_log_and_closing_it_raises_nothing(
        tiny_model_dir, tmp_path):
    import contextlib

    from glue.fleet.fleet import ProcessDied
    from glue.trainer.config import TrainerConfig
    from glue.trainer.group import TrainerGroup
    from launch.run.cluster import start_ray
    from loss import LossConfig

    with contextlib.ExitStack() as stack:
        start_ray(address=None, num_cpus=2, stack=stack)
        group = TrainerGroup(tiny_model_dir, TrainerConfig(), LossConfig(), log_dir=tmp_path)
        stack.callback(group.shutdown)
        log = tmp_path / "trainer_0.log"
        assert group.output_line() == f"output in {tmp_path}/trainer_<rank>.log"
        pid = rank_pid(log)
        assert is_alive(pid)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ProcessDied) as died:
            group.hf_weight_specs()
        node = group.nodes[0]
        assert re.fullmatch(rf"trainer rank 0 on node {re.escape(node)} died \(.+\); its log: {re.escape(str(log))}",
                            str(died.value)), str(died.value)
        group.close_weight_channel("disk")  # the shutdown path: a dead rank's side went with it, nothing raised


@pytest.mark.long  # a whole CLI run, about 40-90 s on a shared CPU; the TrainerGroup test above stays in CI
def test_a_trainer_rank_killed_mid_run_ends_it_with_one_line_naming_the_rank_and_its_log(tmp_path):
    metrics = tmp_path / "r" / "metrics.jsonl"
    command = [sys.executable, "-m", "launch", "--config", "examples/configs/demo.yaml", f"run.output_dir={tmp_path}",
               "run.name=r", "run.num_steps=200", "rollout.prompts_per_step=4", "run.save_interval=1",
               "run.max_restarts=0"]  # no repair in the run: tests/test_trainer_restart_runs.py has those
    with sluice_run(command, lambda: metrics.exists() and len(read_metrics(metrics)) >= 1,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as (proc, seen):
        log = tmp_path / "r/logs/trainer_0.log"
        os.kill(rank_pid(log), signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("sluice: error:")]
    assert len(errors) == 1, err[-3000:]
    assert re.match(rf"sluice: error: trainer rank 0 on node [\d.]+ died \(.+\); its log: {re.escape(str(log))} "
                    r"\(run\.max_restarts=0 restarts used up\)\. Every other process it started is stopped; the same "
                    r"command resumes from the last checkpoint",
                    errors[0]), errors[0]
    assert "sluice: trainer rank 0 of 1, pid" in log.read_text()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(is_alive(p) for p in seen):
        time.sleep(0.5)
    assert not [p for p in seen if is_alive(p)], "processes left running after a trainer rank died"
