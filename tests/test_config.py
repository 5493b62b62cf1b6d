"""Config loading: YAML + CLI overrides, typed validation, errors that name the key and the fix."""
import subprocess
import sys

import pytest
import yaml

from launch.args.command_line import parse_args
from launch.cli import main
from launch.config import ConfigError, load_config


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_cli_overrides_win_over_yaml_in_every_spelling(tmp_path):
    path = write(tmp_path, "run: {num_steps: 3}\ntrainer: {lr: 0.5}\n")
    args, overrides = parse_args(["--config", str(path), "run.num_steps=7", "--trainer.lr", "1e-3",
                                  "--rollout.samples_per_prompt=4"])
    cfg = load_config(args.config, overrides)
    assert cfg.run.num_steps == 7
    assert cfg.trainer.lr == pytest.approx(1e-3)
    assert cfg.rollout.samples_per_prompt == 4


def test_an_unknown_key_is_an_error_with_a_suggestion(tmp_path):
    path = write(tmp_path, "rollout: {samples_per_promt: 4}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.samples_per_promt'.*did you mean 'rollout.samples_per_prompt'"):
        load_config(path)


def test_an_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'trainr'.*did you mean 'trainer'"):
        load_config(write(tmp_path, "trainr: {lr: 1}\n"))


def test_a_value_of_the_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout.num_engines must be int, got 'two'"):
        load_config(None, ["rollout.num_engines=two"])


def test_component_validation_reaches_the_user_as_a_config_error():
    with pytest.raises(ConfigError, match="samples_per_prompt must be >= 2"):
        load_config(None, ["rollout.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        load_config(None, ["rollout.sampling.temperature=0"])


def test_a_function_path_that_is_not_an_import_path_is_rejected():
    with pytest.raises(ConfigError, match="rollout.function must be an import path"):
        load_config(None, ["rollout.function=not a path!"])


def test_dry_run_prints_the_resolved_config_with_defaults(capsys):
    assert main(["--dry-run", "run.num_steps=2"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["run"]["num_steps"] == 2
    assert resolved["rollout"]["sampling"]["max_new_tokens"] == 8  # a default, written out
    assert resolved["loss"]["advantage_estimator"] == "grpo"


def test_the_cli_exits_2_with_a_one_line_message_on_a_bad_key(capsys):
    assert main(["--dry-run", "run.num_stepz=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sluice: config error: unknown config key 'run.num_stepz'") and "\n" not in err


def test_the_demo_config_is_valid():
    cfg = load_config("examples/configs/demo.yaml")
    assert cfg.rollout.num_engines == 2 and cfg.run.num_steps >= 10


def test_importing_the_config_imports_no_backend():
    code = ("import sys, launch.config, glue.loop.config, glue.rollout.config, glue.rewards.config, weight_sync.config, loss; "
            "bad = [m for m in ('ray', 'sglang', 'megatron') if m in sys.modules]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_launch_plan_modules_import_no_backend_either():
    code = ("import sys, launch.config, launch.plan.run_plan, launch.args.options, launch.args.sglang, glue.trainer.megatron_fields; "
            "bad = [m for m in ('ray', 'sglang', 'megatron') if m in sys.modules]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cluster_section_is_typed_and_validated():
    cfg = load_config(None, ["cluster.gpus_per_node=8", "cluster.placement=colocated"])
    assert cfg.cluster.engine_kind == "sglang" and load_config(None, []).cluster.engine_kind == "embedded"
    with pytest.raises(ConfigError, match="cluster.placement must be one of"):
        load_config(None, ["cluster.placement=shared"])
    with pytest.raises(ConfigError, match="cluster.gpus_per_node must be >= 0"):
        load_config(None, ["cluster.gpus_per_node=-1"])
