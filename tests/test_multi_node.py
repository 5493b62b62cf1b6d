"""Two Ray nodes on one machine, started by launch/scripts/multi_node.sh in its real roles: a head raylet and a
worker raylet, each with its own loopback address (127.0.0.3 and 127.0.0.2), and CPU bundles spread over them.

Each script runs in a session of its own; afterwards every process of both sessions must be gone, stopped by pid:
the head script stops its Ray by the pid it started it with, the test the worker's `ray start` by its pid."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from glue.metrics.logger import read_metrics
from helpers.processes import end_session

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch/scripts/multi_node.sh"
HEAD_IP, WORKER_IP = "127.0.0.3", "127.0.0.2"
RUN = ["run.num_steps=2", "rollout.prompts_per_step=4"]


# The head script's SLUICE hook: run sluice, then, as an operator would when the job is done, stop the worker node
# (SIGTERM to its `ray start`, by pid) and wait until its session is empty, all while the head's Ray is still up.
# A worker stopped after its head is gone leaves Ray's node agents waiting a minute or more for the head.
STOP_WORKER_AFTER = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from helpers.processes import session_pids
from launch.cli import main
code = main(sys.argv[1:])
if "--dry-run" not in sys.argv:
    pid = int(open({pid_file!r}).read())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while session_pids(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
sys.exit(code)
"""


def sluice_then_stop(tmp_path: Path, worker: "Role") -> Path:
    (tmp_path / "worker.pid").write_text(str(worker.proc.pid))
    path = tmp_path / "sluice_then_stop_worker"
    code = STOP_WORKER_AFTER.format(tests=str(REPO / "tests"), pid_file=str(tmp_path / "worker.pid"))
    path.write_text(f"#!{sys.executable}\n{code}")
    path.chmod(0o755)
    return path


class Role:
    """multi_node.sh in one role, in a new session, output to a file."""

    def __init__(self, tmp_path: Path, role: str, port: int, args=(), wrap=(), **env: str):
        self.log = tmp_path / f"{role}.log"
        venv = Path(sys.executable).parent
        full_env = {**os.environ, "ROLE": role, "RAY_PORT": str(port), "GPUS_PER_NODE": "0", "NUM_NODES": "2",
                    "CONFIG": "examples/configs/demo.yaml", "SLUICE": str(venv / "sluice"),
                    "PATH": f"{venv}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore", **env}
        full_env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen([*wrap, "bash", str(SCRIPT), *args], env=full_env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_session_empty(self, timeout_s: float) -> list[int]:
        """Pids of this session still alive after `timeout_s` (SIGKILLed by pid, so nothing outlives the test)."""
        return end_session(self.proc.pid, timeout_s, poll_s=1)


@pytest.fixture
def roles():
    started: list[Role] = []
    yield started
    for role in started:  # on failure: nothing may outlive the test
        role.stop(signal.SIGKILL)
        role.wait_session_empty(0)


def test_a_run_spans_a_head_and_a_worker_node_through_the_script_and_stops_by_pid(tmp_path, roles):
    port = free_port()
    worker = Role(tmp_path, "worker", port, HEAD_IP=HEAD_IP, NODE_IP=WORKER_IP, NODE_WAIT_S="120")
    roles.append(worker)
    head = Role(tmp_path, "head", port, [*RUN, f"run.output_dir={tmp_path}/runs"], NODE_IP=HEAD_IP,
                NODE_WAIT_S="120", SLUICE=str(sluice_then_stop(tmp_path, worker)))
    roles.append(head)
    assert head.proc.wait(timeout=420) == 0, head.output()[-4000:]
    out = head.output()
    assert f"sluice: 2/2 nodes joined: {WORKER_IP}, {HEAD_IP}" in out
    placed = re.search(r"sluice: placement +[\d.]+ s +(.*)", out).group(1)
    nodes = dict(part.split(": ", 1) for part in placed.split("; "))
    assert set(nodes) == {HEAD_IP, WORKER_IP}, placed  # CPU bundles spread over both nodes
    assert "trainer rank 0" in nodes[WORKER_IP], placed  # the driver's node sorts first; the trainer takes the last
    host = re.search(r"weight group hosted by trainer rank 0 at ([\d.]+):\d+", out).group(1)
    assert host == WORKER_IP  # rank 0's node address, not the driver's
    records = read_metrics(tmp_path / "runs/demo/metrics.jsonl")
    assert [r["weights/version"] for r in records] == [1, 2]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3  # weights crossed the nodes
    worker.proc.wait(timeout=5)  # stopped by the SLUICE hook while the head was up (`ray start` exits 1 on SIGTERM)
    assert worker.wait_session_empty(0) == [], "the worker's Ray left processes behind"
    assert head.wait_session_empty(30) == [], "the head script left processes behind"


@pytest.mark.long  # about 2 min on a shared CPU; the two-node engine stays in CI through test_engine_nodes_fleet.py
def test_an_engine_over_two_nodes_puts_a_node_rank_on_each_and_the_run_syncs_it(tmp_path, roles):
    port = free_port()
    worker = Role(tmp_path, "worker", port, HEAD_IP=HEAD_IP, NODE_IP=WORKER_IP, NODE_WAIT_S="120")
    roles.append(worker)
    # two bundles (colocated: trainer rank 0 shares node rank 0's), which SPREAD puts one on each node; disk, as a
    # broadcast group would hold trainer rank 0 and engine TP rank 0 on one device, which strict engines refuse
    spanning = ["cluster.engine=sglang_strict", "cluster.engine_tensor_parallel_size=2", "cluster.engine_nodes=2",
                "rollout.num_engines=1", "cluster.placement=colocated", "sync.transport=disk"]
    head = Role(tmp_path, "head", port, [*RUN, *spanning, f"run.output_dir={tmp_path}/runs"], NODE_IP=HEAD_IP,
                NODE_WAIT_S="120", SLUICE=str(sluice_then_stop(tmp_path, worker)))
    roles.append(head)
    assert head.proc.wait(timeout=420) == 0, head.output()[-4000:]
    placed = re.search(r"sluice: placement +[\d.]+ s +(.*)", head.output()).group(1)
    nodes = dict(part.split(": ", 1) for part in placed.split("; "))
    where = {item: ip for ip, items in nodes.items() for item in items.split(", ")}
    assert where["engine 0"] != where["engine 0 node rank 1"], placed  # a node rank on each node
    joined = (tmp_path / "runs/demo/logs/engine_0_node_1.log").read_text()
    assert f"node rank 1 joined node rank 0 at {where['engine 0']}:" in joined  # rank 0's node address
    records = read_metrics(tmp_path / "runs/demo/metrics.jsonl")
    assert [r["weights/version"] for r in records] == [1, 2]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3
    worker.proc.wait(timeout=5)
    assert worker.wait_session_empty(0) == [] and head.wait_session_empty(30) == []


@pytest.mark.long  # 22 s; the two-node run above stays in CI
def test_a_head_whose_worker_never_joins_stops_within_its_deadline_with_one_line(tmp_path, roles):
    head = Role(tmp_path, "head", free_port(), [*RUN, f"run.output_dir={tmp_path}/runs"], NODE_IP=HEAD_IP,
                NODE_WAIT_S="6")
    roles.append(head)
    assert head.proc.wait(timeout=180) == 1, head.output()[-4000:]
    out = head.output()
    assert f"sluice: 1/2 nodes joined: {HEAD_IP}; waiting up to" in out  # progress while it waits
    errors = [line for line in out.splitlines() if line.startswith("sluice: error:")]
    assert errors == [f"sluice: error: only 1/2 nodes joined the Ray cluster within cluster.node_wait_s=6 s (joined: "
                      f"{HEAD_IP}); start the others with `ROLE=worker HEAD_IP=<head address> "
                      "launch/scripts/multi_node.sh`, or lower cluster.num_nodes"], out[-3000:]
    assert "Traceback" not in out
    assert head.wait_session_empty(30) == [], "the head script left processes behind"


def _private_mounts_work() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _private_mounts_work(), reason="needs `unshare --mount` (root) to hide a folder from a node")
@pytest.mark.long  # 23 s; the two-node run stays in CI
def test_a_model_directory_the_worker_node_cannot_see_is_named_with_the_node_before_any_engine_starts(tmp_path,
                                                                                                      roles):
    # The worker raylet runs in a mount namespace where the run folder is an empty tmpfs: the head writes the
    # initial model there, the worker node cannot see it, as on two machines without a shared file system.
    runs = tmp_path / "runs"
    runs.mkdir()
    port = free_port()
    hide = ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs sluice-hidden "{runs}" && exec "$0" "$@"']
    worker = Role(tmp_path, "worker", port, wrap=hide, HEAD_IP=HEAD_IP, NODE_IP=WORKER_IP, NODE_WAIT_S="120")
    roles.append(worker)
    head = Role(tmp_path, "head", port, [*RUN, f"run.output_dir={runs}"], NODE_IP=HEAD_IP, NODE_WAIT_S="120",
                SLUICE=str(sluice_then_stop(tmp_path, worker)))
    roles.append(head)
    assert head.proc.wait(timeout=300) == 1, head.output()[-4000:]
    out = head.output()
    model = runs / "demo/init_model"
    errors = [line for line in out.splitlines() if line.startswith("sluice: error:")]
    assert errors == [f"sluice: error: node {WORKER_IP} cannot see the model directory {model} (engines and trainer "
                      "ranks placed there load it from that path): put it on a file system every node mounts at the "
                      "same path, or copy it there"], out[-3000:]
    assert not (runs / "demo/logs").exists() or not list((runs / "demo/logs").glob("engine_*.log"))
    worker.proc.wait(timeout=5)
    assert worker.wait_session_empty(0) == []
    assert head.wait_session_empty(30) == []
