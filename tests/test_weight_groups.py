"""The weight groups the plan lists (issue 38 items 2 and 6) and NCCL's device rule over them: no NCCL communicator
holds two ranks on one GPU, so `--dry-run` (and every start) refuses a weight group over nccl with two members on one
device, in one line naming both ranks, the GPU and the way out; where CPU bundles stand for an SGLang run's GPUs
(strict engines) the engines and the trainer's channel refuse such a group when it forms, as NCCL would."""
from __future__ import annotations

import threading

import pytest
import yaml

from conftest import free_port
from launch.cli import main
from launch.config import load_config
from launch.plan.run_plan import resolve
from weight_sync.process_group import PLANNED_DEVICES, create_process_group, destroy_process_group

DEMO = "examples/configs/demo.yaml"
COLOCATED_GPUS = ["cluster.gpus_per_node=2", "cluster.placement=colocated", "sync.backend=nccl"]


def refusal(capsys, argv: list[str], *, dry_run: bool = True) -> str:
    assert main([*(["--dry-run"] if dry_run else []), "--config", DEMO, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("sluice: config error: "), err
    return err


def test_a_colocated_sglang_run_over_nccl_is_refused_naming_the_ranks_the_gpu_and_ipc_as_the_way_out(capsys):
    # SGLang servers (the default engines on GPU) sync colocated by ipc unless broadcast is asked for
    line = refusal(capsys, [*COLOCATED_GPUS, "sync.transport=broadcast"])
    assert ("rank 0 (trainer rank 0) and rank 1 (engine 0 TP rank 0) of weight group sluice_weights share one device, "
            "node 0 gpu 0: NCCL refuses a communicator with two ranks on one device") in line
    assert "sync.transport=ipc" in line and "or disk" in line
    assert "cluster.placement=disaggregated" in line
    # a real start refuses it before starting anything
    assert refusal(capsys, [*COLOCATED_GPUS, "sync.transport=broadcast"], dry_run=False) == line


def test_colocated_embedded_engines_over_nccl_are_pointed_at_the_ipc_transport(capsys):
    line = refusal(capsys, [*COLOCATED_GPUS, "cluster.engine=embedded"])
    assert "node 0 gpu 0" in line and "use sync.transport=ipc (colocated engines map the trainer's buffers" in line


def checked(capsys, argv: list[str]) -> list[str]:
    assert main(["--dry-run", "--config", DEMO, *argv]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)["checked"]


def test_disaggregated_nccl_disk_and_gloo_layouts_pass_and_say_so(capsys):
    assert "weight groups: 1 (nccl), no two members on one device" in checked(
        capsys, ["cluster.gpus_per_node=4", "sync.backend=nccl"])
    assert "weight groups: none (disk transport)" in checked(capsys, [*COLOCATED_GPUS, "sync.transport=disk"])
    lenient = checked(capsys, ["cluster.placement=colocated"])  # embedded engines on CPU over gloo: allowed
    assert ("weight groups: 1 (gloo); rank 0 (trainer rank 0) and rank 1 (engine 0 TP rank 0) of weight group "
            "sluice_weights share one device, cpu bundle 0, which gloo allows") in lenient


def test_strict_engines_on_cpu_model_the_devices_and_the_dry_run_says_the_group_will_be_refused(capsys):
    from launch.run.components import engine_env, trainer_actor_options

    cfg, plan = resolve(load_config(DEMO, ["cluster.placement=colocated", "cluster.engine=sglang_strict"]))
    assert plan.models_devices and plan.to_dict()["devices"].startswith("modeled")

    class Placement:  # the bundles' Ray options and GPUs (none on CPU), as launch.run.cluster.Placement gives them
        def actor_options(self, bundle, *, num_cpus, num_gpus=0):
            return {"bundle": bundle}

        def engine_env(self, engine):
            return {}

    options = trainer_actor_options(cfg, plan, Placement())
    assert options == [{"bundle": 0, "runtime_env": {"env_vars": {PLANNED_DEVICES: "cpu bundle 0"}}}]
    assert [engine_env(plan, Placement(), e) for e in plan.engines] == [
        {PLANNED_DEVICES: "cpu bundle 0"}, {PLANNED_DEVICES: "cpu bundle 1"}]
    line = next(c for c in checked(capsys, ["cluster.placement=colocated", "cluster.engine=sglang_strict"])
                if c.startswith("weight groups"))
    assert "share one device, cpu bundle 0, which gloo allows, but the strict engines" in line
    cfg, plan = resolve(load_config(DEMO, ["cluster.placement=colocated"]))  # lenient engines: nothing modeled
    assert not plan.models_devices and "runtime_env" not in trainer_actor_options(cfg, plan, Placement())[0]


def test_the_plan_finds_one_source_per_pipeline_stage_from_config_json_alone():
    from glue.embedded_engine.tiny_model import tiny_config
    from glue.trainer.config import TrainerConfig
    from launch.plan.weight_groups import trainer_sources

    parts = trainer_sources(tiny_config(family="qwen3"), TrainerConfig(pipeline_model_parallel_size=2))
    layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
             "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
             "post_attention_layernorm")  # two layers, one per stage; the embedding first, norm and output last
    assert [(p.rank, p.members) for p in parts] == [(0, (0,)), (1, (1,))]
    assert set(parts[0].names) == {"model.embed_tokens.weight", *(f"model.layers.0.{n}.weight" for n in layer)}
    assert set(parts[1].names) == {"model.norm.weight", "lm_head.weight",
                                   *(f"model.layers.1.{n}.weight" for n in layer)}


def join_all(devices: list[str | None]) -> list[object]:
    """Every member of one weight group joins at once, member r claiming `devices[r]`; each one's group or error."""
    port, results = free_port(), [None] * len(devices)

    def join(rank: int) -> None:
        try:
            results[rank] = create_process_group(master_address="127.0.0.1", master_port=port, rank=rank,
                                                 world_size=len(devices), group_name="g", timeout_s=30,
                                                 device=devices[rank])
        except RuntimeError as err:
            results[rank] = err

    threads = [threading.Thread(target=join, args=(r,)) for r in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_a_group_whose_members_stand_on_one_device_is_refused_by_every_member_that_models_devices():
    results = join_all(["cpu bundle 0", "cpu bundle 1", "cpu bundle 0"])
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert all("Duplicate GPU detected: rank 0 and rank 2 both on cpu bundle 0" in str(r) for r in results)
    fine = join_all(["cpu bundle 0", "cpu bundle 1", None])  # a member that models nothing is not waited for
    assert not any(isinstance(r, Exception) for r in fine), fine
    for group in fine:
        destroy_process_group(group)


@pytest.mark.slow
def test_a_strict_engine_refuses_a_weight_group_whose_source_stands_on_its_device(engine_processes, tiny_model_dir,
                                                                                  tmp_path_factory, monkeypatch):
    from glue.loop.config import SyncConfig
    from helpers.weights import hf_model, source_of
    from weight_sync.bridge import make_bridge

    monkeypatch.setenv(PLANNED_DEVICES, "cpu bundle 0,cpu bundle 1")  # the engine's two TP ranks (and, here, the
    engine = engine_processes.start_sglang_stand_in(tiny_model_dir, "--tp-size", "2")  # source: index 0 is bundle 0)
    model, _ = hf_model(tmp_path_factory, seed=3)
    cfg = SyncConfig(transport="broadcast", timeout_s=60)
    with pytest.raises(Exception, match="Duplicate GPU detected: rank 0 and rank 1 both on cpu bundle 0"):
        make_bridge(cfg, source=source_of(model), engine_urls=[engine], engine_tp_size=2)
    monkeypatch.setenv(PLANNED_DEVICES, "cpu bundle 2")  # a source on a device of its own: the same engine joins
    bridge = make_bridge(cfg, source=source_of(model), engine_urls=[engine], engine_tp_size=2)
    try:
        bridge.sync(1)
    finally:
        bridge.close()
