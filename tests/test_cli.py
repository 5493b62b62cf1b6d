"""The CLI as a new user meets it: `--help` shows sluice's own keys first and the backends on request, `--dry-run`
catches what would fail a minute into start-up (model directory, plugins, ports, placement) with one line and exit
2, and Ctrl-C during start-up is one line."""
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT, is_alive, sluice_run
from launch.cli import main
from helpers.cli import DEMO, one_line_error


def test_dry_run_refuses_a_model_path_that_does_not_exist(capsys, tmp_path):
    line = one_line_error(capsys, [f"model.path={tmp_path / 'nope'}"])
    assert f"model.path '{tmp_path / 'nope'}' does not exist" in line


def test_dry_run_refuses_a_model_directory_the_trainer_cannot_build(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    line = one_line_error(capsys, [f"model.path={tmp_path}"])
    assert "its config.json does not load" in line and "model_type 'gpt2' is not supported" in line


def test_dry_run_refuses_an_unimportable_rollout_function(capsys, tmp_path, monkeypatch):
    line = one_line_error(capsys, ["rollout.function=my_rollouts:generate"])
    assert "rollout.function: cannot load 'my_rollouts:generate': module 'my_rollouts' not found" in line
    (tmp_path / "broken_rollouts.py").write_text("def generate(ctx, prompt, num_samples)\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = one_line_error(capsys, ["rollout.function=broken_rollouts:generate"])
    assert "importing 'broken_rollouts:generate' failed: SyntaxError" in line
    line = one_line_error(capsys, ["rollout.task=rollout_fns.toy_tasks:EchoTsk"])
    assert "did you mean 'EchoTask'" in line


@pytest.mark.parametrize("setting", ["trainer.master_port={port}", "--router-prometheus-port={port}"])
def test_dry_run_refuses_a_port_that_is_taken(capsys, setting):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line_error(capsys, [setting.format(port=port)])
    key = setting.split("=")[0].lstrip("-").replace("router-prometheus-port", "router.prometheus_port")
    assert f"{key}={port}: the port is in use on this machine" in line


def test_dry_run_refuses_routing_replay_on_a_dense_model(capsys):
    line = one_line_error(capsys, ["rollout.return_routed_experts=true"])  # the demo's tiny model is a dense qwen2
    assert "rollout.return_routed_experts needs a mixture-of-experts model" in line
    assert main(["--dry-run", "--config", DEMO, "rollout.return_routed_experts=true",
                 "model.tiny.family=qwen3_moe"]) == 0
    capsys.readouterr()
    line = one_line_error(capsys, ["trainer.routing_replay=true", "model.tiny.family=qwen3_moe"])
    assert "set rollout.return_routed_experts: true too" in line


def test_dry_run_refuses_a_placement_group_the_local_cluster_cannot_hold(capsys):
    line = one_line_error(capsys, ["run.ray_num_cpus=2"])  # 2 engines + 1 trainer rank = 3 CPU bundles
    assert "needs 3 CPUs" in line and "run.ray_num_cpus=2" in line


def test_dry_run_lists_what_it_checked(capsys):
    assert main(["--dry-run", "--config", DEMO]) == 0
    checked = yaml.safe_load(capsys.readouterr().out)["checked"]
    assert [line.split(":")[0] for line in checked] == ["plugins", "eval", "model", "layer spec", "attention (auto)",
                                                        "memory", "data", "weight groups", "tokenizer", "ports",
                                                        "placement", "run folder"]


def _attention_line(capsys, args: list[str]) -> str:
    assert main(["--dry-run", "--config", DEMO, *args]) == 0
    return next(line for line in yaml.safe_load(capsys.readouterr().out)["checked"] if line.startswith("attention"))


def test_dry_run_names_the_attention_kernel_every_trainer_rank_runs(capsys):
    assert "sluice core attention on CPU" in _attention_line(capsys, [])
    assert "FlashAttention varlen" in _attention_line(capsys, ["cluster.gpus_per_node=4", "--attention-backend", "flash"])
    reference = _attention_line(capsys, ["cluster.gpus_per_node=4", "--attention-backend", "local"])
    assert reference.startswith("attention (local): megatron DotProductAttention, unfused")
    assert "torch.compile" not in reference
    assert "trainer.compile: RMSNorms, RoPE, SwiGLU" in _attention_line(capsys, ["trainer.compile=true"])


def test_help_shows_sluice_keys_with_their_docs_and_the_backends_only_on_request(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "--tensor-model-parallel-size" not in text and "--sglang-mem-fraction-static" not in text
    assert "  run.num_steps  (int, default: 30)\n      training steps" in text
    assert "  sync.max_staleness  (" in text and "  loss.preset  (" in text
    assert "sluice --help megatron (" in text and "sluice --help router (" in text
    assert len(text.splitlines()) < 700  # sluice's own keys (~530 lines with judge, reward_model, sft, teacher); the
    # backends' ~950 options stay out
    assert main(["--help", "megatron"]) == 0
    megatron = capsys.readouterr().out
    assert "--tensor-model-parallel-size" in megatron and "  run.num_steps  (" not in megatron
    assert "--sglang-" not in megatron and "--router-" not in megatron
    assert main(["-h", "router"]) == 0
    assert "--router-request-timeout-secs" in capsys.readouterr().out
    assert main(["--help", "sgl"]) == 2
    assert "choose one of config, megatron, sglang, router" in capsys.readouterr().err


def test_every_config_key_has_a_doc_in_the_help():
    from launch.args.help import config_reference
    from launch.config import SluiceConfig

    lines = config_reference()
    keys = [line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("   ")]
    undocumented = [k for k, nxt in zip(lines, lines[1:] + [""]) if k.startswith("  ") and not k.startswith("   ")
                    and not nxt.startswith("      ")]
    assert not undocumented, undocumented  # a new key gets a trailing comment, which is its help
    assert {k.split(".")[0] for k in keys} == {f.name for f in dataclasses.fields(SluiceConfig)}


@pytest.mark.slow
def test_start_up_prints_one_line_per_phase_and_ctrl_c_during_it_is_one_line(tmp_path):
    """A Ctrl-C as a terminal sends it: SIGINT to the whole process group, here while the engines start."""
    out_path = tmp_path / "out.txt"
    command = [sys.executable, "-m", "launch", "--config", DEMO, f"run.output_dir={tmp_path}", "run.name=c"]
    with open(out_path, "w") as out, sluice_run(command, lambda: "sluice: ray" in out_path.read_text(),
                                                stdout=out, stderr=subprocess.PIPE, text=True) as (proc, seen):
        assert proc.poll() is None, out_path.read_text()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("sluice: interrupted"), err
    # it names only what exists: no metrics before the first step
    assert "metrics.jsonl" not in err and all(Path(p).exists() for p in re.findall(rf"{tmp_path}[^\s;]*", err)), err
    phases = [line.split()[1] for line in out_path.read_text().splitlines() if line.startswith("sluice: ")]
    assert phases[:2] == ["model", "ray"], out_path.read_text()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(is_alive(p) for p in seen):
        time.sleep(0.5)
    assert not [p for p in seen if is_alive(p)], "processes left running after Ctrl-C"
