"""Ctrl-C is bounded, in a real run (`python -m launch` as a process: Ray, an embedded engine behind sgl-router,
megatron-core on gloo) whose rollout function's tool hangs in one group: the first SIGINT waits run.stop_grace_s,
cuts the step, checkpoints the finished group and the hung one's samples so far and exits 0; the same command
resumes it and trains every prompt once, the hung group on the samples it had. A second SIGINT stops at once. No
exit path prints asyncio noise. `ray job stop` (SIGTERM to the driver and every process below it at once) of a run
attached to a Ray head of the test's own, with run.stop_grace_s 0, still checkpoints the step's groups and exits 0.
About a minute per run on 2 loaded cores: `make test-long`."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import descendants, is_alive, sluice_run

NOISE = ("Task was destroyed", "Event loop is closed", "Traceback")


def command(tmp_path, *extra, steps=4):
    return [sys.executable, "-m", "launch", "--config", "examples/configs/demo.yaml", f"run.output_dir={tmp_path}",
            "run.name=hang", f"run.num_steps={steps}", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
            "rollout.num_engines=1", "run.save_rollouts=true", "rollout.stall_warning_s=0.5",
            "rollout.function=tests.helpers.hanging_tool:generate_group",
            "rollout.task=tests.helpers.hanging_tool:HangingToolTask", *extra]


def interrupt_hung_step(tmp_path, signals, *extra) -> tuple[int, str, float, dict]:
    """Start the run (group 3's tool hangs, so step 2 waits), send `signals` once step 1 is logged; returns (exit
    code, stderr, seconds from the first signal to the exit, processes below it still alive)."""
    metrics = tmp_path / "hang" / "metrics.jsonl"
    with sluice_run(command(tmp_path, "rollout.task_args={hang_groups: [3]}", *extra),
                    lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) as (proc, seen):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(1.0)  # step 2 is waiting on the hung group
        sent = time.monotonic()
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.3)
        _, err = proc.communicate(timeout=180)
        took = time.monotonic() - sent
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(is_alive(p) for p in seen):
        time.sleep(0.5)
    left = {p: (Path("/proc") / str(p) / "cmdline").read_bytes()[:120] for p in seen if is_alive(p)}
    return proc.returncode, err.decode(errors="replace"), took, left


def trained_groups(run_dir: Path) -> dict[int, list[list[int]]]:
    """Group id -> its samples' response tokens, over every saved step (a group trained twice fails the test)."""
    seen = {}
    for path in sorted((run_dir / "rollouts").glob("step_*.json")):
        for group in json.loads(path.read_text())["groups"]:
            assert group["group_id"] not in seen, f"group {group['group_id']} trained twice"
            seen[group["group_id"]] = [s["response_tokens"] for s in group["samples"]]
    return seen


@pytest.mark.slow
@pytest.mark.long
def test_a_first_sigint_cuts_a_hung_step_after_stop_grace_s_checkpoints_it_and_a_resume_loses_nothing(tmp_path):
    code, err, took, left = interrupt_hung_step(tmp_path, [signal.SIGINT], "run.stop_grace_s=2")
    assert code == 0, err[-3000:]
    assert "the step has waited" in err and "1 outstanding" in err  # the hang spoke before the signal
    assert "did not finish within run.stop_grace_s=2 s" in err
    assert not [n for n in NOISE if n in err], err[-3000:]
    assert took < 60, f"the stop took {took:.0f} s after a 2 s grace"
    assert not left, f"left running after SIGINT: {left}"
    checkpoint = tmp_path / "hang" / "checkpoints" / "step_00000001"
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["reissue"] == [3] and [e["group"]["group_id"] for e in state["finished"]] == [2]
    kept = [d["response_tokens"] for d in state["partial"]["3"]]
    assert len(kept) == 2 and all(kept), state["partial"]

    resumed = subprocess.run(command(tmp_path, "rollout.task_args={hang_groups: []}", steps=3),
                             cwd=Path(__file__).resolve().parents[1], capture_output=True, timeout=300)
    out, err = resumed.stdout.decode(errors="replace"), resumed.stderr.decode(errors="replace")
    assert resumed.returncode == 0, err[-3000:]
    assert "1 finished groups back in the buffer, 1 that were generating issued again (2 of their samples" in out
    assert not [n for n in NOISE if n in err], err[-3000:]
    groups = trained_groups(tmp_path / "hang")
    assert sorted(groups) == [0, 1, 2, 3, 4, 5]  # every prompt trained once, none lost to the stop
    assert groups[3] == kept  # the hung group trained on the samples it had when the step was cut


@pytest.mark.slow
@pytest.mark.long
def test_a_second_sigint_stops_a_hung_step_at_once_without_asyncio_noise(tmp_path):
    code, err, took, left = interrupt_hung_step(tmp_path, [signal.SIGINT, signal.SIGINT], "run.stop_grace_s=300")
    assert code == 130 and "sluice: interrupted" in err, err[-3000:]
    assert not [n for n in NOISE if n in err], err[-3000:]
    assert took < 120, f"the second signal took {took:.0f} s to stop it"
    assert not left, f"left running after two Ctrl-C: {left}"


@contextlib.contextmanager
def ray_head():
    """A Ray head of this test's own (`ray start --head --block`, its processes below it), yielding its address;
    stopped by its pid and its processes' pids."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="rayjs", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}",
                             "--num-cpus=8", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                             "--disable-usage-stats", f"--temp-dir={temp}"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            seen |= descendants(head.pid)
            with socket.socket() as conn:
                if conn.connect_ex(("127.0.0.1", port)) == 0 and any(
                        (Path("/proc") / str(p) / "comm").read_text().strip() == "raylet" for p in seen if is_alive(p)):
                    break
            time.sleep(0.5)
        time.sleep(3)  # the raylet registers with the GCS
        yield f"127.0.0.1:{port}"
    finally:
        seen |= descendants(head.pid)
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        for pid in seen:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.long
def test_ray_job_stop_of_an_attached_run_with_stop_grace_s_0_checkpoints_the_steps_groups_and_exits_0(tmp_path):
    # `ray job stop` sends SIGTERM to the entrypoint and every process below it (the router, the engines' hosts are
    # Ray actors of the cluster, as are the trainer ranks), then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S
    metrics = tmp_path / "hang" / "metrics.jsonl"
    with ray_head() as address, sluice_run(
            command(tmp_path, "rollout.task_args={hang_groups: [3]}", f"run.ray_address={address}",
                    "run.stop_grace_s=0"),
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE) as (proc, seen):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(1.0)  # step 2 is waiting on the hung group
        sent = time.monotonic()
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
        took = time.monotonic() - sent
    err = err.decode(errors="replace")
    assert proc.returncode == 0, err[-3000:]
    assert "stopped at step 1 of 4 on SIGTERM" in out.decode(errors="replace")
    checkpoint = tmp_path / "hang" / "checkpoints" / "step_00000001"
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["reissue"] == [3] and [e["group"]["group_id"] for e in state["finished"]] == [2]
    assert f"sluice: checkpoint {checkpoint} (the last step trained): 1 finished groups kept whole" in err
    assert not (tmp_path / "hang" / "run.lock").exists()
    assert took < 60, f"the stop took {took:.0f} s with run.stop_grace_s 0"  # 44 s on 2 cores at a load of 20
