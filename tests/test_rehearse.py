"""`make rehearse`: every shipped recipe shrunk by launch.tools.shrink to what 2 CPU cores hold, the same run in kind, and
one of them (the MoE script, the largest layout) rehearsed end to end against SGLang-strict engines."""
import json
import math
from pathlib import Path

import pytest

from launch.tools.rehearse import error_line, load_recipe, raw_config, read_metrics, rehearse, shipped_recipes
from launch.tools.shrink import MAX_TRAINER_RANKS, infer_family, shrink

RECIPES = shipped_recipes()
ENGINE = "sglang_strict"


def shrunk_recipe(name, tmp_path, engine=ENGINE):
    recipe = load_recipe(name, tmp_path / "script")
    return recipe, shrink(raw_config(recipe.argv), data_dir=tmp_path / "data", engine=engine, name_hint=name)


def test_the_shipped_recipes_are_every_config_and_every_runnable_script():
    assert [r for r in RECIPES if r.startswith("examples/")] == [
        f"examples/configs/{n}.yaml" for n in
        ("calc_multi_turn", "deepseek_v3", "demo", "demo_async", "distill", "glm45_air", "judge_reward", "moonlight",
         "mu_grpo", "openai_agent", "ppo_critic",
         "qwen3_30b_a3b", "qwen3_8b", "replay_debug", "sft", "smollm2_arith", "text_arith")]
    assert [r for r in RECIPES if r.startswith("launch/")] == [
        f"launch/scripts/{n}.sh" for n in ("deepseek_v3_moe", "glm45_air_moe", "moonlight_moe", "multi_node",
                                           "qwen3_30b_a3b_moe",
                                           "qwen3_8b_dense",
                                           "single_node",
                                           "slime_qwen3_30b_a3b_moe", "slime_qwen3_8b_dense")]


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_shrinks_to_two_steps_on_one_cpu_node_with_a_tiny_model(name, tmp_path):
    recipe, shrunk = shrunk_recipe(name, tmp_path)
    raw, record = shrunk.raw, shrunk.record
    t, c = raw.get("trainer", {}), raw.get("cluster", {})
    sizes = [t.get(f"{n}_size", 1) or 1 for n in ("tensor_model_parallel", "pipeline_model_parallel",
                                                   "expert_model_parallel", "data_parallel", "context_parallel")]
    assert max(sizes) <= 2
    assert math.prod(sizes[:2] + sizes[3:]) <= MAX_TRAINER_RANKS
    assert raw["run"]["num_steps"] == 2 and raw["run"].get("ray_address") is None
    assert c.get("gpus_per_node", 0) == 0 and c.get("num_nodes", 1) == 1 and c["engine"] == ENGINE
    assert raw["model"].get("path") is None and raw["model"]["tiny"]["family"]
    if raw["run"].get("mode") != "sft":  # an SFT recipe has no rollouts (launch.tools.shrink scales its sft: batch)
        assert raw["rollout"].get("prompts_per_step", 8) <= 4 and raw["rollout"].get("samples_per_prompt", 8) <= 4
    assert raw.get("sync", {}).get("backend", "gloo") == "gloo"
    original = raw_config(recipe.argv)
    if original.get("cluster", {}).get("engine_tensor_parallel_size", 1) > 1:
        assert c["engine_tensor_parallel_size"] == 2
    # the record accounts for every setting of the recipe: kept as it is, or scaled / dropped with a reason
    for key, change in {**record.scaled, **record.dropped}.items():
        assert change["why"], key
        assert key not in record.kept
    assert record.kept.get("run.mode", "sync") == original.get("run", {}).get("mode", "sync")


@pytest.mark.parametrize("name", RECIPES)
def test_every_shrunk_recipe_passes_the_checks_of_sluice_dry_run(name, tmp_path):
    import yaml

    from launch.config import load_config
    from launch.plan.run_plan import resolve

    _, shrunk = shrunk_recipe(name, tmp_path)
    (tmp_path / "shrunk.yaml").write_text(yaml.safe_dump(shrunk.raw))
    cfg, plan = resolve(load_config(tmp_path / "shrunk.yaml"))
    assert plan.notes == [] and plan.device == "cpu"
    assert len(plan.trainer) <= MAX_TRAINER_RANKS


def test_the_moe_script_keeps_expert_parallelism_its_router_settings_and_engine_tp(tmp_path):
    recipe, shrunk = shrunk_recipe("launch/scripts/qwen3_30b_a3b_moe.sh", tmp_path)
    t, record = shrunk.raw["trainer"], shrunk.record
    assert (t["tensor_model_parallel_size"], t["expert_model_parallel_size"], t["expert_tensor_parallel_size"],
            t["data_parallel_size"]) == (2, 2, 1, 1)
    assert record.scaled["trainer.expert_model_parallel_size"]["from"] == 8
    tiny = shrunk.raw["model"]["tiny"]
    assert (tiny["family"], tiny["num_experts"], tiny["moe_top_k"]) == ("qwen3_moe", 4, 2)
    assert shrunk.raw["cluster"]["engine_tensor_parallel_size"] == 2
    assert record.kept["trainer.megatron.sequence_parallel"] is True  # megatron-core needs it for MoE with TP > 1
    assert record.kept["trainer.megatron.moe_router_dtype"] == "fp32"
    assert record.kept["trainer.megatron.recompute_granularity"] == "full"
    assert record.kept["rollout.dynamic_sampling"] is True and record.kept["router.request_timeout_secs"] == 3600
    for gpu_only in ("moe_permute_fusion", "use_cpu_initialization", "moe_token_dispatcher_type"):
        assert record.dropped[f"trainer.megatron.{gpu_only}"]["why"].startswith("GPU only")
    assert record.dropped["sglang.mem_fraction_static"]["value"] == 0.75
    assert recipe.env["TOKENIZERS_PARALLELISM"] == "false"
    assert any("one node" in note for note in recipe.notes)


def test_an_async_recipe_keeps_its_mode_and_the_slack_between_its_sync_interval_and_staleness(tmp_path):
    _, shrunk = shrunk_recipe("examples/configs/mu_grpo.yaml", tmp_path)
    assert shrunk.raw["sync"]["interval"] == 2 and shrunk.raw["sync"]["max_staleness"] == 1  # was 16 and 15
    assert shrunk.record.kept["run.mode"] == "async" and shrunk.record.kept["loss.preset"] == "mu_grpo"


def test_routing_replay_checkpoints_and_colocation_are_kept_as_the_recipe_has_them(tmp_path):
    raw = {"run": {"num_steps": 500, "save_interval": 100, "mode": "async"}, "model": {"path": "/m/Qwen3-30B-A3B"},
           "cluster": {"placement": "disaggregated", "gpus_per_node": 8, "engine_tensor_parallel_size": 8},
           "rollout": {"return_routed_experts": True, "num_engines": 4},
           "trainer": {"routing_replay": True, "expert_model_parallel_size": 4, "data_parallel_size": 4},
           "sglang": {"enable_return_routed_experts": True}}
    shrunk = shrink(raw, data_dir=tmp_path, engine=ENGINE)
    kept = shrunk.record.kept
    assert kept["rollout.return_routed_experts"] and kept["trainer.routing_replay"] and kept["run.mode"] == "async"
    assert kept["run.save_interval"] == 100  # the run's final checkpoint is written whatever the interval
    t = shrunk.raw["trainer"]
    assert (t["data_parallel_size"], t["expert_model_parallel_size"]) == (2, 2)
    assert shrunk.raw["rollout"]["num_engines"] == 2 and shrunk.raw["cluster"]["engine_tensor_parallel_size"] == 2
    assert raw["trainer"]["data_parallel_size"] == 4, "the recipe's mapping is not changed"


def test_a_large_layout_shrinks_dp_then_pp_then_tp_and_keeps_ep_a_divisor_of_the_dense_ranks(tmp_path):
    raw = {"model": {"path": "/m/Qwen3-235B-A22B"}, "trainer": {
        "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4, "data_parallel_size": 4,
        "expert_model_parallel_size": 16, "expert_tensor_parallel_size": 2, "megatron": {"sequence_parallel": True}}}
    t = shrink(raw, data_dir=tmp_path, engine=ENGINE).raw["trainer"]
    assert (t["tensor_model_parallel_size"], t["pipeline_model_parallel_size"], t["data_parallel_size"]) == (2, 1, 1)
    # ETP x EP must divide TP x DP = 2: ETP 2 leaves room for EP 1 only
    assert (t["expert_tensor_parallel_size"], t["expert_model_parallel_size"]) == (2, 1)
    assert t["megatron"]["sequence_parallel"] is True


def test_an_uneven_pipeline_split_sized_for_the_checkpoint_is_dropped_with_the_checkpoint(tmp_path):
    # 4 + 6 x 9 + 3 = 61 layers over PP=8; the tiny stand-in has 2 layers, which no first stage of 4 leaves room in
    raw = {"model": {"path": "/m/Qwen3-8B"}, "trainer": {"pipeline_model_parallel_size": 8, "megatron": {
        "num_layers_in_first_pipeline_stage": 4, "num_layers_in_last_pipeline_stage": 3, "recompute_num_layers": 1}}}
    shrunk = shrink(raw, data_dir=tmp_path, engine=ENGINE)
    assert shrunk.raw["trainer"]["megatron"] == {"recompute_num_layers": 1}
    assert shrunk.record.dropped["trainer.megatron.num_layers_in_first_pipeline_stage"]["value"] == 4
    assert shrunk.raw["trainer"]["pipeline_model_parallel_size"] == 2 and shrunk.raw["model"]["tiny"]["num_layers"] == 2


def test_a_recipes_mla_and_router_flags_are_dropped_with_its_checkpoint(tmp_path):
    # slime's Moonlight flags (--kv-lora-rank 512, --moe-router-topk-scaling-factor 2.446 ...) describe the recipe's
    # checkpoint; the tiny stand-in has other values, so they go with the checkpoint
    _, shrunk = shrunk_recipe("launch/scripts/moonlight_moe.sh", tmp_path)
    assert shrunk.raw["model"]["tiny"]["family"] == "deepseek_v3"
    megatron = shrunk.raw["trainer"].get("megatron", {})
    for key in ("kv_lora_rank", "moe_router_topk_scaling_factor", "multi_latent_attention"):
        assert key not in megatron and "config.json" in shrunk.record.dropped[f"trainer.megatron.{key}"]["why"], key
    assert megatron["moe_router_bias_update_rate"] == 0  # a training choice, not a fact of the checkpoint: kept


def test_the_checkpoint_family_comes_from_its_config_or_else_its_name(tmp_path):
    assert infer_family("/models/Qwen3-30B-A3B", "") == "qwen3_moe"
    assert infer_family("/models/Qwen3-8B", "") == "qwen3"
    assert infer_family("models/smollm2-135m-instruct", "") == "llama"
    assert infer_family("/models/gpt-oss-120b", "") == infer_family(None, "gpt_oss_20b_grpo") == "gpt_oss"
    assert infer_family(None, "examples/configs/demo.yaml") == "qwen2"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert infer_family(str(tmp_path), "qwen3_8b") == "llama"


def test_sglang_options_the_embedded_engine_lacks_are_dropped_and_listed_as_not_rehearsed(tmp_path):
    raw = {"sglang": {"mem_fraction_static": 0.7, "api_key": "k"}}
    record = shrink(raw, data_dir=tmp_path, engine="embedded").record
    assert "unrecognized arguments: --mem-fraction-static" in record.dropped["sglang.mem_fraction_static"]["why"]
    assert record.kept["sglang.api_key"] == "k"


def test_a_text_recipe_gets_stand_in_data_under_its_own_keys_and_a_tokenizer(tmp_path):
    from launch.tools.shrink import write_data

    _, shrunk = shrunk_recipe("examples/configs/qwen3_8b.yaml", tmp_path)
    write_data(shrunk)
    path = shrunk.raw["rollout"]["task_args"]["path"]
    assert path.startswith(str(tmp_path)) and shrunk.raw["model"]["tiny"]["tokenizer"] is True
    row = json.loads(Path(path).read_text().splitlines()[0])
    assert set(row) == {"problem", "answer"}
    assert shrunk.raw["eval"]["task_args"]["path"] in shrunk.data_files


def test_metrics_give_steps_first_step_time_and_mean_sync_time(tmp_path):
    lines = [{"step": 0, "eval/pass@1": 0.0}, {"step": 1, "time/step_s": 3.0, "time/sync_s": 0.25},
             {"step": 2, "time/step_s": 1.0, "time/sync_s": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert read_metrics(tmp_path / "metrics.jsonl") == {"steps": 2, "first_step_s": 3.0, "sync_s": 0.5}
    assert read_metrics(tmp_path / "missing.jsonl") == {"steps": 0, "first_step_s": None, "sync_s": None}
    assert error_line("x\nValueError: bad\nsluice: error: engine 0 died\ntail") == "sluice: error: engine 0 died"


@pytest.mark.slow
@pytest.mark.long  # a whole rehearsal (~45 s): make rehearse runs every recipe; their shrinks and dry runs stay in CI
def test_the_moe_script_rehearses_two_steps_against_strict_engines(tmp_path):
    row = rehearse(load_recipe("launch/scripts/qwen3_30b_a3b_moe.sh", tmp_path / "script"), tmp_path,
                   engine=ENGINE, timeout_s=300)
    assert row["passed"], (row.get("error"), row.get("log_tail"))
    assert row["steps"] == 2 and row["first_step_s"] > 0 and row["sync_s"] is not None
    assert row["shrunk"]["engine"] == ENGINE


@pytest.mark.long  # a whole rehearsal start (~25 s); test_weight_groups keeps the strict engines' refusal in make test
def test_a_colocated_recipe_over_broadcast_fails_in_rehearsal_as_nccl_makes_it_fail_on_a_cluster(tmp_path):
    """Colocated, trainer rank 0 and engine 0 share bundle 0: on GPUs over NCCL the weight group is refused ("Duplicate
    GPU detected"); on CPU gloo would allow it, but strict engines model the devices, so the rehearsal fails too."""
    from launch.tools.rehearse import Recipe

    recipe = Recipe(name="colocated demo", argv=["--config", "examples/configs/demo.yaml",
                                                 "cluster.placement=colocated"], env={}, notes=[])
    row = rehearse(recipe, tmp_path, engine=ENGINE, timeout_s=300)
    assert not row["passed"] and row["steps"] == 0
    assert "Duplicate GPU detected: rank 0 and rank 1 both on cpu bundle 0" in "\n".join(row["log_tail"]), row


@pytest.mark.bench
@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_rehearses_two_steps_against_strict_engines(name, tmp_path):
    row = rehearse(load_recipe(name, tmp_path / "script"), tmp_path, engine=ENGINE, timeout_s=600)
    assert row["passed"], row.get("error")
