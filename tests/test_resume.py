"""Never lose a run: the driver is killed with SIGKILL after a checkpoint, the same command resumes it, and the
finished run has trained every prompt exactly once, logged every step exactly once, kept the staleness bound right
after the resume, and exported its final policy as an HF checkpoint."""
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
from helpers.runs import expand, learning_record

REPO = Path(__file__).resolve().parents[1]
STEPS, GROUPS = 6, 4
RAY_AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}


def sluice(tmp_path, config, *extra, steps=STEPS):
    return [sys.executable, "-m", "launch", "--config", config, f"run.output_dir={tmp_path}", "run.name=r",
            f"run.num_steps={steps}", f"rollout.prompts_per_step={GROUPS}", "run.save_interval=2", *extra]


def kill_after_checkpoint(tmp_path, command) -> int:
    """Start `command`, SIGKILL it once checkpoint 2 exists and step 3 is logged; returns the steps it had logged.
    Every process below it must be gone within 60 s (the engines and router follow their parent)."""
    run_dir = tmp_path / "r"

    def checkpoint_2_and_step_3() -> bool:
        logged = len(read_metrics(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else 0
        return (run_dir / "checkpoints/step_00000002/state.json").exists() and logged >= 3

    with sluice_run(command, checkpoint_2_and_step_3, timeout_s=300, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL) as (proc, seen):
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def alive() -> dict[int, str]:
        return {p: (Path("/proc") / str(p) / "cmdline").read_bytes().split(b"\0")[0].decode() for p in seen
                if is_alive(p)}

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and set(alive().values()) - RAY_AGENTS:
        time.sleep(0.5)
    left = alive()
    for pid in left:  # nothing outlives the test
        os.kill(pid, signal.SIGKILL)
    # Ray's two node agents of the local cluster wait a minute or more for the dead GCS before they exit; they hold
    # no port or device. Everything else (engines, router, trainer, raylet, GCS) must be gone.
    assert set(left.values()) <= RAY_AGENTS, left
    return len(read_metrics(run_dir / "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.long  # 56 s; in CI the trainer's exact resume is tests/test_checkpoint.py, the whole killed run is here
@pytest.mark.parametrize("mode", ["async"])  # sync mode: the deterministic test below resumes it
def test_a_run_killed_after_a_checkpoint_resumes_without_losing_or_repeating_a_prompt_or_a_step(tmp_path, mode):
    # rewards take 0.2-1.0 s (demo_async's task), so a step lasts long enough to be killed in the middle of the run
    mode_args = ["run.mode=sync", "sync.max_staleness=0"] if mode == "sync" else []
    command = sluice(tmp_path, "examples/configs/demo_async.yaml", *mode_args)
    logged_before_kill = kill_after_checkpoint(tmp_path, command)
    assert logged_before_kill >= 3  # it logged past checkpoint 2: the resume must cut metrics back to its checkpoint
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    resumed = re.search(r"sluice: resuming from \S+/step_(\d+) \(step (\d+), policy version (\d+)\)", done.stdout)
    assert resumed, done.stdout[-2000:]
    step = int(resumed.group(2))
    assert int(resumed.group(1)) == step == int(resumed.group(3))
    assert step in (2, 4) and step <= logged_before_kill  # a checkpoint is written after its step is logged
    carried = re.search(r"(\d+) finished groups back in the buffer, (\d+) that were generating issued again \((\d+) "
                        r"of their samples continue from the tokens they had\)", done.stdout)
    assert carried, done.stdout[-2000:]
    print(carried.group(0))
    if mode == "async":  # generation runs on through the sync before the checkpoint: groups were in flight
        assert int(carried.group(2)) > 0 and int(carried.group(3)) > 0
    records = read_metrics(tmp_path / "r/metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step logged once
    assert [r["weights/version"] for r in records] == list(range(1, STEPS + 1))
    trained = [i for r in records for i in expand(r["rollout/group_ids"])]
    assert sorted(trained) == list(range(STEPS * GROUPS)), trained  # every prompt once: none skipped or repeated
    limit = 0 if mode == "sync" else 2
    assert all(r["staleness/max"] <= limit for r in records[2:])  # bounded right after the resume
    # ... and not by dropping: under stale_policy drop an over-stale sample is withheld, so staleness/max alone
    # cannot fail; admission keeps every group within the bound, resumed ones with the deadlines they had
    assert [r["async/dropped_stale"] for r in records] == [0.0] * STEPS
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "r/hf")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert sorted(p.name for p in (tmp_path / "r/checkpoints").iterdir()) == ["step_00000004", "step_00000006"]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_in_deterministic_mode_a_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, mode):
    """Metrics and final weights bit for bit. Async: the checkpoint holds finished groups waiting in the buffer and
    the partial samples of the groups generating (an evaluation after each step's sync lets the next groups start
    before the checkpoint), which continue from their tokens after the resume."""
    mode_args = (["run.mode=sync", "sync.max_staleness=0"] if mode == "sync" else
                 # rewards take 2-3 s, so the groups started after a sync are still in flight, with tokens, when
                 # the checkpoint is taken after the (quick) evaluation: their samples are checkpointed part-way
                 ["eval.interval=1", "eval.num_prompts=2", "eval.task=rollout_fns.toy_tasks:EchoTask",
                  "eval.sampling.max_new_tokens=4", "rollout.task_args.min_latency_s=2.0",
                  "rollout.task_args.max_latency_s=3.0"])
    config = "examples/configs/demo_async.yaml"
    steps = 4 if mode == "sync" else 5  # async: step 5's groups are the ones generating at checkpoint 2
    straight = subprocess.run(sluice(tmp_path / "straight", config, *mode_args, "run.deterministic=true", steps=steps),
                              cwd=REPO, capture_output=True, text=True, timeout=400,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert straight.returncode == 0, straight.stderr[-3000:]
    command = sluice(tmp_path, config, *mode_args, "run.deterministic=true", steps=steps)
    kill_after_checkpoint(tmp_path, command)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    resumed = re.search(r"resuming from \S+ \(step (\d+).*?(\d+) finished groups back in the buffer, (\d+) that were "
                        r"generating issued again \((\d+) of their samples continue", done.stdout)
    assert resumed, done.stdout[-2000:]
    print(resumed.group(0))
    if mode == "async":  # staleness 2: later steps' groups were finished and waiting, the next ones generating
        assert int(resumed.group(2)) > 0 and int(resumed.group(4)) > 0

    expected = read_metrics(tmp_path / "straight/r/metrics.jsonl")
    got = read_metrics(tmp_path / "r/metrics.jsonl")
    assert [learning_record(r) for r in got] == [learning_record(r) for r in expected]
    trained = [i for r in got if r["step"] > 0 for i in expand(r["rollout/group_ids"])]
    assert sorted(trained) == list(range(steps * GROUPS))  # every prompt once, none skipped or repeated
    import torch
    from safetensors.torch import load_file

    def weights(run: Path) -> dict:
        return {k: v for f in sorted((run / "hf").glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    a, b = weights(tmp_path / "straight/r"), weights(tmp_path / "r")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
