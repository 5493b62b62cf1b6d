"""The launch scripts as a cluster operator runs them: they parse, the config is checked before Ray starts, and a
worker that cannot reach its head gives up within its deadline with one line naming the address it tried."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "launch/scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_launch_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def test_a_worker_whose_head_never_answers_stops_within_its_deadline_naming_the_address(tmp_path):
    port = closed_port()
    env = {**os.environ, "ROLE": "worker", "HEAD_IP": "127.0.0.1", "RAY_PORT": str(port), "NODE_WAIT_S": "3",
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    (tmp_path / "ray").write_text(f"#!/bin/sh\ntouch {tmp_path}/ray-was-called\n")
    (tmp_path / "ray").chmod(0o755)
    started = time.monotonic()
    result = subprocess.run(["bash", str(REPO / "launch/scripts/multi_node.sh")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30
    assert result.stderr.strip() == (f"sluice: no Ray head answered at 127.0.0.1:{port} within 3s; check HEAD_IP "
                                      "and RAY_PORT, and start the head first")
    assert not (tmp_path / "ray-was-called").exists()


def test_the_head_checks_the_config_before_it_starts_ray(tmp_path):
    (tmp_path / "ray").write_text(f"#!/bin/sh\ntouch {tmp_path}/ray-was-called\n")
    (tmp_path / "ray").chmod(0o755)
    env = {**os.environ, "ROLE": "head", "CONFIG": "examples/configs/demo.yaml", "GPUS_PER_NODE": "0",
           "NUM_NODES": "1", "SLUICE": str(Path(sys.executable).parent / "sluice"),
           "PATH": f"{tmp_path}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(["bash", str(REPO / "launch/scripts/multi_node.sh"), "run.num_stepz=3"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "unknown config key 'run.num_stepz'" in result.stderr
    assert not (tmp_path / "ray-was-called").exists(), "ray start ran before the config was checked"


def test_the_model_path_engines_and_trainer_get_is_absolute(tmp_path, monkeypatch):
    from launch.config import load_config
    from launch.run.folder import prepare_model

    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(REPO / "examples/configs/demo.yaml"), ["run.output_dir=runs"])
    tiny = prepare_model(cfg, Path("runs/demo"))
    assert tiny == str(tmp_path / "runs/demo/init_model")
    cfg = load_config(str(REPO / "examples/configs/demo.yaml"), ["model.path=runs/demo/init_model"])
    assert prepare_model(cfg, Path("runs/other")) == tiny


def test_cpu_bundles_may_span_nodes_but_every_node_needs_one(capsys):
    from launch.cli import main

    demo = str(REPO / "examples/configs/demo.yaml")  # 2 engines + 1 trainer rank = 3 CPU bundles
    assert main(["--config", demo, "cluster.num_nodes=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "node any (Ray spreads CPU bundles over the nodes)" in out and "placement_group:" in out
    assert main(["--config", demo, "cluster.num_nodes=4", "--dry-run"]) == 2
    assert "cluster.num_nodes=4 but the run has only 3 CPU bundles" in capsys.readouterr().err
    assert main(["--config", demo, "cluster.node_wait_s=-1", "--dry-run"]) == 2


def test_a_failed_start_into_a_folder_holding_a_previous_run_leaves_every_file_untouched(tmp_path, capsys):
    from launch.cli import main

    demo = str(REPO / "examples/configs/demo.yaml")
    run_dir = tmp_path / "demo"
    (run_dir / "logs").mkdir(parents=True)
    files = {"metrics.jsonl": '{"step": 1}\n{"step": 2}\n', "config.yaml": "run: {name: demo}\n",
             "logs/router.log": "old router log\n"}
    for name, text in files.items():
        (run_dir / name).write_text(text)
    assert main(["--config", demo, f"run.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"sluice: config error: {run_dir} holds a previous run (2 steps in metrics.jsonl); start this one under "
        "another run.name=..., or set run.overwrite=true to replace it (its files are replaced only once the new "
        "run has started)")
    # with overwrite, a start that fails (here: a model path without a checkpoint) still deletes nothing
    assert main(["--config", demo, f"run.output_dir={tmp_path}", "run.overwrite=true",
                 f"model.path={tmp_path / 'nothing'}"]) == 2
    assert "does not exist: point it at a local HF checkpoint" in capsys.readouterr().err
    assert {name: (run_dir / name).read_text() for name in files} == files
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")) == ["config.yaml", "logs",
                                                                                   "logs/router.log", "metrics.jsonl"]
