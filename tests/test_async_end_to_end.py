"""Asynchronous training through every real seam (Ray, embedded engines behind sgl-router, megatron-core on gloo,
the broadcast bridge): it learns within the staleness bound; SIGTERM in the middle stops it after the step in
progress and a second signal at once, and neither leaves anything running."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import is_alive, sluice_run
from glue.metrics.logger import read_metrics
from launch.config import load_config
from launch.run.runner import run
from helpers.processes import live_children


@pytest.mark.slow
def test_an_async_run_learns_and_never_trains_a_token_beyond_max_staleness(tmp_path):
    before = set(live_children(os.getpid()))
    cfg = load_config("examples/configs/demo_async.yaml", [
        f"run.output_dir={tmp_path}", "run.name=async", "run.num_steps=40",
        "rollout.task_args={min_latency_s: 0.0, max_latency_s: 0.3}", "sync.max_staleness=2"])
    records = read_metrics(run(cfg) / "metrics.jsonl")
    assert [r["weights/version"] for r in records] == list(range(1, 41))
    assert max(r["staleness/max"] for r in records) <= 2
    assert any(r["staleness/max"] > 0 for r in records), "an async run with slow rewards should use its allowance"
    assert all(r["async/dropped_stale"] == 0 for r in records)
    # It learns: some 5-step window's mean reward beats the first 5 steps' by 0.1. Not the last window: at this
    # learning rate with staleness 2 a run occasionally learns and then collapses (seen once in CI: 0.04 -> 0.39 by
    # step 24, a train/rollout log-ratio spike of 4 at step 32, 0.04 at step 33); how often is a question for the
    # learning benchmarks (make learning-table), not for this test of the seams and the staleness bound.
    rewards = [r["rollout/reward_mean"] for r in records]
    windows = [sum(rewards[i:i + 5]) / 5 for i in range(len(rewards) - 4)]
    assert max(windows[1:]) > windows[0] + 0.1, windows
    assert set(live_children(os.getpid())) <= before, "processes left running after the run"


def signal_mid_run(tmp_path, config: str, signals: list[int], *, after_steps: int = 3, overrides=()):
    """Start `sluice` as a process, send `signals` (one after another) once `after_steps` steps are logged, and
    return (exit code, output, metrics records, processes still alive among those that ran below it)."""
    metrics = tmp_path / "stop" / "metrics.jsonl"
    command = [sys.executable, "-m", "launch", "--config", config, f"run.output_dir={tmp_path}", "run.name=stop",
               "run.num_steps=200", "rollout.prompts_per_step=4", *overrides]
    with sluice_run(command, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as (proc, seen):
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.2)
        output, _ = proc.communicate(timeout=120)
    assert len(seen) >= 3, f"expected engines, router and Ray below the driver, saw {seen}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(is_alive(p) for p in seen):
        time.sleep(0.5)
    left = {p: (Path("/proc") / str(p) / "cmdline").read_bytes()[:120] for p in seen if is_alive(p)}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return proc.returncode, output.decode(errors="replace"), records, left


@pytest.mark.slow
def test_sigterm_in_async_mode_stops_after_the_step_in_progress_with_exit_0_and_leaves_nothing_running(tmp_path):
    code, text, records, left = signal_mid_run(tmp_path, "examples/configs/demo_async.yaml", [signal.SIGTERM])
    assert code == 0, text[-3000:]
    assert "sluice: SIGTERM: stopping after the step in progress" in text
    assert f"sluice: stopped at step {len(records)} of 200 on SIGTERM" in text, text[-3000:]
    checkpoint = tmp_path / "stop" / "checkpoints" / f"step_{len(records):08d}"
    assert (checkpoint / "state.json").exists() and (checkpoint / "dist" / "metadata.json").exists()
    assert f"checkpoint {checkpoint}; the same command resumes it" in text
    assert "Traceback" not in text and "Aborted" not in text
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # no step lost or logged twice
    assert all(r["staleness/max"] <= 2 for r in records)
    assert not left, f"left running after SIGTERM: {left}"


@pytest.mark.slow
@pytest.mark.long  # 27 s; the graceful stop on the first signal stays in CI
def test_a_second_signal_stops_at_once_with_exit_130_and_leaves_nothing_running(tmp_path):
    # on-policy (max_staleness 0) with rewards that take 2-3 s, every step waits >= 2 s for fresh groups, so both
    # signals (0.2 s apart, right after step 1 is logged) land within step 2
    code, text, records, left = signal_mid_run(tmp_path, "examples/configs/demo_async.yaml",
                                               [signal.SIGINT, signal.SIGINT], after_steps=1,
                                               overrides=["rollout.task_args={min_latency_s: 2.0, max_latency_s: 3.0}",
                                                          "sync.max_staleness=0"])
    assert code == 130 and "sluice: interrupted" in text, text[-3000:]
    assert not left, f"left running after two Ctrl-C: {left}"
