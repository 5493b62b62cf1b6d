"""One run per folder (launch.run.folder_lock): a live holder, in another process or on another host, refuses a second
run and a dry run in one line naming it; a stale lock (a dead pid here, a heartbeat too old elsewhere) is taken over;
the lock goes on every way out, SIGTERM included; a resume passes over a checkpoint that is not complete."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glue.loop.checkpoint import Checkpoints
from launch.cli import main
from launch.config import SluiceConfig, RunConfig
from launch.run.folder import find_checkpoint
from launch.run.folder_lock import LOCK, RunFolderHeld, RunFolderLock, read_holder

DEMO = ["--config", "examples/configs/demo.yaml", "run.num_steps=2", "rollout.num_engines=1"]
HOLD = """
import sys, time
from pathlib import Path
from launch.run.folder_lock import RunFolderLock
with RunFolderLock(Path(sys.argv[1]), refresh_s=0.2):
    print("held", flush=True)
    time.sleep(60)
"""


def write_lock(run_dir: Path, *, host: str, pid: int, refreshed_ago: float) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK).write_text(json.dumps({"host": host, "pid": pid, "started": "2026-11-29T08:00:00+00:00",
                                            "refreshed": time.time() - refreshed_ago, "token": "theirs"}))


def hold_in_subprocess(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_run_and_a_dry_run_are_refused_in_one_line_naming_the_live_holder_in_another_process(tmp_path, capsys):
    holder = hold_in_subprocess(tmp_path / "x")
    try:
        argv = [*DEMO, f"run.output_dir={tmp_path}", "run.name=x"]
        assert main(["--dry-run", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        line = captured.err.strip()
        assert "\n" not in line
        assert line.startswith(f"sluice: error: {tmp_path / 'x'} is held by run on host {socket.gethostname()} pid "
                               f"{holder.pid} since ")
        assert "(refreshed 0 s ago); wait for it to end or stop it, or start this one under another run.name" in line
        assert main(argv) == 2  # a real start: refused before Ray or anything else starts
        assert capsys.readouterr().err.strip().startswith(f"sluice: error: {tmp_path / 'x'} is held by run on host")
        assert sorted(p.name for p in (tmp_path / "x").iterdir()) == [LOCK]  # nothing of the second run's
        time.sleep(0.5)
        assert time.time() - read_holder(tmp_path / "x")["refreshed"] < 0.5  # the heartbeat runs
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_another_host_refreshes_refuses_and_one_it_stopped_refreshing_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "x"
    write_lock(run_dir, host="node-7", pid=4242, refreshed_ago=3)
    with pytest.raises(RunFolderHeld, match=r"is held by run on host node-7 pid 4242 since 2026-11-29T08:00:00\+00:00 "
                                            r"\(refreshed 3 s ago\).*not refreshed for 60 s is taken over"):
        RunFolderLock(run_dir).__enter__()
    assert main(["--dry-run", *DEMO, f"run.output_dir={tmp_path}", "run.name=x"]) == 2
    assert "is held by run on host node-7 pid 4242" in capsys.readouterr().err
    write_lock(run_dir, host="node-7", pid=4242, refreshed_ago=61)  # 6 refreshes of 10 s missed
    assert main(["--dry-run", *DEMO, f"run.output_dir={tmp_path}", "run.name=x"]) == 0
    assert f"run folder: {run_dir} has a stale lock (host node-7 pid 4242)" in capsys.readouterr().out
    assert read_holder(run_dir)["token"] == "theirs"  # a dry run only looks
    with RunFolderLock(run_dir):
        assert read_holder(run_dir)["pid"] == os.getpid()
    assert "taking over the stale lock of" in capsys.readouterr().out


def test_a_lock_whose_pid_is_gone_on_this_host_is_taken_over_at_once(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_lock(tmp_path, host=socket.gethostname(), pid=gone.pid, refreshed_ago=0)
    with RunFolderLock(tmp_path):
        assert read_holder(tmp_path)["pid"] == os.getpid()


def test_the_lock_is_released_on_a_normal_exit_an_error_and_sigterm(tmp_path):
    with RunFolderLock(tmp_path):
        assert (tmp_path / LOCK).exists()
    assert not (tmp_path / LOCK).exists()
    with pytest.raises(ValueError):
        with RunFolderLock(tmp_path):
            raise ValueError("the run failed")
    assert not (tmp_path / LOCK).exists()
    holder = hold_in_subprocess(tmp_path / "x")
    holder.send_signal(signal.SIGTERM)
    holder.wait(timeout=10)
    assert not (tmp_path / "x" / LOCK).exists()


def test_a_resume_passes_over_a_checkpoint_without_its_state_and_says_so(tmp_path, capsys):
    cfg = SluiceConfig(run=RunConfig(output_dir=str(tmp_path), name="r"))
    checkpoints = Checkpoints(cfg.run_dir / "checkpoints", keep=2)
    checkpoints.save(2, lambda folder: None, {"mode": "sync"})
    (cfg.run_dir / "checkpoints" / "step_00000004" / "dist").mkdir(parents=True)  # a newer one, cut short
    assert find_checkpoint(cfg) == cfg.run_dir / "checkpoints" / "step_00000002"
    assert capsys.readouterr().out.strip() == (
        f"sluice: {cfg.run_dir / 'checkpoints' / 'step_00000004'} is not a complete checkpoint (no state.json, which "
        f"is written last): passed over; resuming from {cfg.run_dir / 'checkpoints' / 'step_00000002'}")
    # pruning moves a checkpoint out of the step_ names before deleting it: none is left half deleted
    for step in (4, 6, 8):
        checkpoints.save(step, lambda folder: None, {"mode": "sync"})
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
