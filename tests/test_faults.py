"""A process the run depends on dies: the run ends within seconds with one line naming it and its log, stops
everything else, and the same command resumes from the last checkpoint."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import descendants, is_alive, sluice_run
from glue.metrics.logger import read_metrics


def pids_running(driver: int, module: bytes) -> list[int]:
    """The run's processes whose command line names `module`, by pid."""
    return sorted(p for p in descendants(driver) if module in (Path("/proc") / str(p) / "cmdline").read_bytes())


def engine_pids(driver: int) -> list[int]:
    return pids_running(driver, b"glue.embedded_engine")


def running_requests(pid: int) -> int:
    """Requests engine `pid` holds right now (its /get_server_info), asked at the --host / --port with the
    --api-key it was started with."""
    argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
    host, port = argv[argv.index("--host") + 1], argv[argv.index("--port") + 1]
    keys = [a.partition("=")[2] for a in argv if a.startswith("--api-key=")]
    request = urllib.request.Request(f"http://{host}:{port}/get_server_info",
                                     headers={"Authorization": f"Bearer {keys[0]}"} if keys else {})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.load(answer)["internal_states"][0]["num_running_reqs"]


def finished_with_nothing_lost(proc, err: str, metrics: Path, steps: int) -> list[dict]:
    """The run's records, once it is known to have exited 0 having logged steps 1..`steps` with no sample lost and no
    group failed."""
    assert proc.returncode == 0, err[-3000:]
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert sum(r["rollout/lost_samples"] for r in records) == 0
    assert sum(r["rollout/failed_groups"] for r in records) == 0
    return records


def kill_when_busy(pid: int, timeout_s: float = 60) -> int:
    """SIGKILL engine `pid` at a moment it is decoding requests (so the router has some to send again); returns how
    many it held at the last look."""
    deadline, held = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and (held := running_requests(pid)) < 1:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return held


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async"])  # generation never pauses: the kill lands mid-rollout
def test_an_engine_killed_mid_rollout_is_restarted_and_the_run_finishes_with_nothing_lost(tmp_path, mode):
    metrics = tmp_path / "f" / "metrics.jsonl"
    command = [sys.executable, "-m", "launch", "--config", "examples/configs/demo_async.yaml", f"run.mode={mode}",
               f"run.output_dir={tmp_path}", "run.name=f", "run.num_steps=8", "rollout.prompts_per_step=4",
               "rollout.sampling.max_new_tokens=64"]
    if mode == "sync":
        command.append("sync.max_staleness=0")
    with sluice_run(command, lambda: metrics.exists() and len(read_metrics(metrics)) >= 2,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as (proc, seen):
        engines = engine_pids(proc.pid)
        assert len(engines) == 2, engines
        held = kill_when_busy(engines[1])  # started second: engine 1, killed while it decodes requests
        assert held >= 1, "engine 1 never held a request within 60 s"
        out, err = proc.communicate(timeout=240)
    records = finished_with_nothing_lost(proc, err, metrics, steps=8)
    assert records[-1]["fault/engine_restarts"] >= 1
    assert records[-1]["fault/reissued_requests"] >= 1  # engine 1 died holding requests: the router sent them again
    restarts = [line for line in out.splitlines() if "serves again" in line]
    # a single-node run's engines listen on loopback only (multi-node ones on the node address, with keys)
    assert restarts and re.match(r"sluice: engine 1 serves again at http://127\.0\.0\.1:\d+ with the current weights",
                                 restarts[0])
    print(restarts[0], f"held {held}, reissued requests: {records[-1]['fault/reissued_requests']:.0f}")


@pytest.mark.slow
@pytest.mark.long  # 27 s; the restart of a killed engine stays in CI
def test_an_engine_killed_with_no_restarts_left_ends_the_run_with_one_line_naming_the_engine_and_its_log(tmp_path):
    metrics = tmp_path / "f" / "metrics.jsonl"
    command = [sys.executable, "-m", "launch", "--config", "examples/configs/demo_async.yaml", "run.mode=sync",
               "sync.max_staleness=0", f"run.output_dir={tmp_path}", "run.name=f", "run.num_steps=200",
               "rollout.prompts_per_step=4", "run.save_interval=2", "rollout.max_engine_restarts=0"]
    with sluice_run(command, lambda: metrics.exists() and len(read_metrics(metrics)) >= 2,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as (proc, seen):
        engines = engine_pids(proc.pid)
        assert len(engines) == 2, engines
        victim = engines[1]  # started second: engine 1
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - killed_at
    assert proc.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("sluice: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert re.match(r"sluice: error: engine \d \(http://[\d.]+:\d+\) exited with code -9; its log: \S+/logs/"
                    r"engine_\d\.log \(rollout\.max_engine_restarts=0 restarts used up\)\. Every other process it started is stopped; the same command resumes", errors[0])
    print(errors[0], f"(ended {took:.1f} s after the kill)")
    assert took < 30, took  # detected within seconds (the watchdog polls every 2 s)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(is_alive(p) for p in seen):
        time.sleep(0.5)
    assert not [p for p in seen if is_alive(p)], "processes left running after an engine died"


@pytest.mark.slow
@pytest.mark.long  # a whole run; tests/test_fleet_watch.py keeps the router's restart in CI
def test_a_router_killed_mid_rollout_is_replaced_and_the_run_finishes_with_nothing_lost(tmp_path):
    metrics = tmp_path / "f" / "metrics.jsonl"
    command = [sys.executable, "-m", "launch", "--config", "examples/configs/demo_async.yaml", f"run.output_dir={tmp_path}",
               "run.name=f", "run.num_steps=8", "rollout.prompts_per_step=4", "rollout.sampling.max_new_tokens=64"]
    with sluice_run(command, lambda: metrics.exists() and len(read_metrics(metrics)) >= 2,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as (proc, seen):
        routers = pids_running(proc.pid, b"sglang::router")  # the title the router gives its process
        assert len(routers) == 1, routers
        os.kill(routers[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    records = finished_with_nothing_lost(proc, err, metrics, steps=8)
    assert records[-1]["fault/router_restarts"] == 1.0
    restarts = [line for line in out.splitlines() if "a new router serves again" in line]
    assert restarts and re.match(r"sluice: a new router serves again on :\d+ with 2 engines", restarts[0])
    print(restarts[0], f"reissued requests: {records[-1]['fault/reissued_requests']:.0f}")
