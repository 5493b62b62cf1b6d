"""`--dry-run` and a real start agree on the megatron options: those sluice never runs (launch.args.megatron.NOT_RUN)
are refused by both in one line; those that run on Transformer Engine (glue.trainer.te_spec.TE_OPTIONS) are a
`requires:` line when the plan is for other nodes, and refused in one line by a run on a machine where TE does not
import. Where TE imports they reach megatron's configs unchanged."""
from __future__ import annotations

import pytest
import yaml

from glue.trainer import te_spec
from glue.trainer.config import TrainerConfig
from glue.trainer.megatron_fields import megatron_fields
from helpers.cli import DEMO, one_line_error
from launch.args.megatron import NOT_RUN
from launch.cli import main
from launch.config import ConfigError, load_config
from launch.plan.run_plan import resolve

NO_TE = ("--moe-permute-fusion, --moe-router-fusion need transformer-engine, which does not import on this machine "
         "(the trainer nodes share its venv): install transformer-engine[pytorch] there or drop them")
MOE = ["model.tiny.family=qwen3_moe"]


def not_run_argv(name: str) -> list[str]:
    """The flag asking for `name`: a switch, or `--optimizer sgd` (adam is what the trainer runs anyway)."""
    flag = "--" + name.replace("_", "-")
    return [flag] if megatron_fields()[name].kind == "flag" else [flag, "sgd"]


@pytest.fixture
def te_absent(monkeypatch):
    """The launcher's and the trainer's answer on a machine without Transformer Engine."""
    monkeypatch.setattr(te_spec, "te_available", lambda: False)


@pytest.fixture
def te_present(monkeypatch):
    """The answer on a machine where Transformer Engine imports (it does not on this CPU machine)."""
    monkeypatch.setattr(te_spec, "te_available", lambda: True)


@pytest.fixture
def plan_only_moe(tmp_path):
    """A model directory holding a Qwen3-MoE config.json and no weights: a plan for GPU nodes elsewhere."""
    from glue.embedded_engine.tiny_model import tiny_config

    tiny_config(family="qwen3_moe", vocab_size=64, num_kv_heads=4, num_experts=4).save_pretrained(tmp_path)
    return str(tmp_path)


def checked_lines(capsys, argv: list[str]) -> list[str]:
    assert main(["--dry-run", "--config", DEMO, *argv]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)["checked"]


def test_every_option_sluice_never_runs_is_refused_by_dry_run_and_by_a_start_in_one_line(capsys):
    assert set(NOT_RUN) <= set(megatron_fields()), "NOT_RUN names a field megatron-core does not have"
    for name in NOT_RUN:
        argv = not_run_argv(name)
        line = one_line_error(capsys, argv)
        assert line.startswith(f"sluice: config error: trainer.megatron.{name} ({argv[0]}) is not run by this "
                               f"trainer: {NOT_RUN[name]}"), line
        assert line.endswith("; drop it")
        with pytest.raises(ConfigError, match=rf"\({argv[0]}\) is not run by this trainer"):
            resolve(load_config(DEMO, [f"trainer.megatron.{name}={argv[1] if len(argv) > 1 else 'true'}"]))


def test_adam_and_switched_off_never_run_options_are_accepted(capsys):
    assert main(["--dry-run", "--config", DEMO, "--optimizer", "adam", "--no-overlap-grad-reduce"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["plan"]["notes"] == []


def test_a_plan_only_model_directory_plans_te_options_with_a_requires_line(capsys, te_absent, plan_only_moe):
    lines = checked_lines(capsys, [f"model.path={plan_only_moe}", "--moe-grouped-gemm", "--moe-permute-fusion"])
    assert ("requires: transformer-engine on the trainer nodes, for --moe-permute-fusion (it does not import "
            "here)") in lines


def test_a_plan_for_a_ray_cluster_names_te_and_the_layer_spec_it_needs(capsys, te_absent):
    lines = checked_lines(capsys, [*MOE, "run.ray_address=10.0.0.1:6379", "trainer.layer_spec=te",
                                   "--use-precision-aware-optimizer"])
    assert "layer spec: te (built on the trainer nodes)" in lines
    assert ("requires: transformer-engine on the trainer nodes, for trainer.layer_spec=te, "
            "--use-precision-aware-optimizer (it does not import here)") in lines


def test_a_plan_for_this_machine_without_te_is_refused_like_a_start(capsys, te_absent, tmp_path):
    argv = [*MOE, "--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion", f"run.output_dir={tmp_path}"]
    assert one_line_error(capsys, argv) == f"sluice: config error: {NO_TE}"
    assert main(["--config", DEMO, *argv]) == 2  # the real start: refused before it writes or starts anything
    captured = capsys.readouterr()
    assert captured.err.strip() == f"sluice: config error: {NO_TE}" and not list(tmp_path.iterdir())


def test_where_te_imports_the_options_are_checked_here_and_reach_megatrons_configs(capsys, te_present):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from glue.trainer.megatron_fields import to_megatron

    lines = checked_lines(capsys, [*MOE, "--moe-grouped-gemm", "--moe-router-fusion"])
    assert "transformer-engine: imports here, for --moe-router-fusion" in lines
    assert "experts: transformer-engine grouped experts (TEGroupedMLP), every trainer rank" in lines
    values = TrainerConfig(megatron={"moe_grouped_gemm": True, "moe_permute_fusion": True,
                                     "use_precision_aware_optimizer": True}).megatron_values()
    assert to_megatron(TransformerConfig, values)["moe_grouped_gemm"] is True
    assert to_megatron(TransformerConfig, values)["moe_permute_fusion"] is True
    assert to_megatron(OptimizerConfig, values)["use_precision_aware_optimizer"] is True


def test_the_trainer_node_refuses_te_options_where_te_does_not_import(te_absent):
    with pytest.raises(ValueError) as refused:
        te_spec.check_te_options({"moe_router_fusion": True, "moe_permute_fusion": True, "bucket_size": 1})
    assert str(refused.value) == NO_TE
    te_spec.check_te_options({"moe_grouped_gemm": True, "bucket_size": 1})  # sluice's grouped experts need no TE


@pytest.mark.parametrize("fields, message", [
    (dict(use_distributed_optimizer=False, megatron={"use_precision_aware_optimizer": True}),
     "set trainer.use_distributed_optimizer: true or drop the flag"),
    (dict(bf16_rounding="dithered", megatron={"use_precision_aware_optimizer": True}),
     "use trainer.bf16_rounding: nearest or drop the flag"),
    (dict(routing_replay=True, megatron={"moe_router_fusion": True}), "fused top-k routing skips the router replay"),
])
def test_te_options_are_refused_with_what_they_cannot_run_beside(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**fields)


def test_without_te_grouped_experts_are_sluices_and_dry_run_names_their_kernel(capsys, te_absent):
    TrainerConfig(layer_spec="local", megatron={"moe_grouped_gemm": True})  # accepted: no TE needed
    experts = [line for line in checked_lines(capsys, [*MOE, "--moe-grouped-gemm"]) if line.startswith("experts")]
    assert experts == ["experts: sluice grouped experts on CPU: torch._grouped_mm, two per layer, fp32, every "
                       "trainer rank"]
    gpus = [line for line in checked_lines(capsys, [*MOE, "--moe-grouped-gemm", "cluster.gpus_per_node=4"])
            if line.startswith("experts")]
    assert gpus[0].startswith("experts: sluice grouped experts: one torch._grouped_mm for gate/up and one for down")
    sequential = [line for line in checked_lines(capsys, MOE) if line.startswith("experts")]
    assert sequential == ["experts: megatron SequentialMLP (each expert's products in a Python loop; "
                          "--moe-grouped-gemm groups them), every trainer rank"]
    assert not [line for line in checked_lines(capsys, []) if line.startswith("experts")]  # a dense model


def test_megatron_help_marks_the_options_sluice_never_runs_and_those_needing_te():
    from launch.args.command_line import help_text

    text = " ".join(help_text("megatron").split())
    assert "-> trainer.megatron.overlap_grad_reduce; default False; not run by sluice]" in text
    assert "-> trainer.megatron.moe_permute_fusion; default False; needs transformer-engine on the trainer nodes]" in text
    assert "-> trainer.megatron.moe_grouped_gemm; default False]" in text


def test_the_precision_aware_optimizer_needs_transformer_engine_except_under_cpu_offload():
    from glue.trainer.te_spec import te_options

    assert te_options({"use_precision_aware_optimizer": True}) == ["--use-precision-aware-optimizer"]
    assert te_options({"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}) == []
    assert te_options({"moe_permute_fusion": True, "optimizer_cpu_offload": True}) == ["--moe-permute-fusion"]
