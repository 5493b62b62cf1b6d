"""The launcher's pass-through: Megatron flags generated from megatron-core's configs, --sglang-* from sglang's
source, --router-* from sglang_router; values arrive unchanged where they are used; bad ones fail in one line."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.args.command_line import build_parser, parse_args
from launch.cli import main
from launch.config import load_config
from launch.plan.run_plan import resolve
from tests.helpers.slime_scripts import CONFIGS

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "examples/configs/demo.yaml")
GPU_NODE = ["cluster.gpus_per_node=8"]  # a GPU-shaped plan: SGLang server engines (never started by a dry run)


@pytest.fixture(scope="module")
def help_text():
    return build_parser().format_help()


def dry_run(capsys, *argv):
    assert main(["--dry-run", *argv]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


def test_generated_megatron_flags_cover_every_public_field_of_model_parallel_config(help_text):
    from megatron.core.model_parallel_config import ModelParallelConfig

    parser = build_parser()
    options = {s for a in parser._actions for s in a.option_strings}
    fields = [f.name for f in dataclasses.fields(ModelParallelConfig) if not f.name.startswith("_")]
    missing = [name for name in fields if "--" + name.replace("_", "-") not in options]
    assert len(fields) > 60 and not missing, missing


def test_help_groups_megatron_sglang_and_router_flags(help_text):
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--virtual-pipeline-model-parallel-size", "--context-parallel-size", "--expert-model-parallel-size",
                 "--expert-tensor-parallel-size", "--sequence-parallel", "--moe-router-topk-scaling-factor",
                 "--moe-token-dispatcher-type", "--recompute-granularity", "--use-distributed-optimizer",
                 "--sglang-mem-fraction-static", "--sglang-enable-memory-saver", "--router-request-timeout-secs"):
        assert f"  {flag}" in help_text, flag
    titles = [line for line in help_text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert [t.split()[0] for t in titles] == ["sluice:", "slime", "megatron-core", "sglang", "router"], titles


def test_a_megatron_flag_value_arrives_unchanged_in_the_transformer_config(tiny_model_dir):
    from megatron.core.transformer.enums import AttnBackend

    from glue.trainer.model import read_hf_config, transformer_config, with_passthrough

    args, overrides = parse_args(["--config", DEMO, "--hidden-dropout", "0.25", "--recompute-granularity", "selective",
                                  "--attention-backend", "local", "--window-size", "8", "-1",
                                  "--no-attention-softmax-in-fp32", "--init-method-std", "0.125"])
    cfg, _ = resolve(load_config(args.config, overrides, args.flags))
    assert cfg.trainer.megatron == {"hidden_dropout": 0.25, "recompute_granularity": "selective",
                                    "attention_backend": "local", "window_size": [8, -1],
                                    "attention_softmax_in_fp32": False, "init_method_std": 0.125}
    hf = read_hf_config(tiny_model_dir)
    config = with_passthrough(transformer_config(hf, tp_size=1), cfg.trainer.megatron_values())
    assert config.hidden_dropout == 0.25 and config.recompute_granularity == "selective"
    assert config.attention_backend is AttnBackend.local and config.window_size == (8, -1)
    assert config.attention_softmax_in_fp32 is False and config.init_method_std == 0.125
    assert config.num_layers == hf.num_hidden_layers  # the checkpoint-derived fields stay


def test_parallel_size_flags_land_in_the_trainer_section_and_its_megatron_layout():
    args, overrides = parse_args(["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                  "--expert-tensor-parallel-size", "1", "--sequence-parallel", "--clip-grad", "0.5", "--lr", "3e-4"])
    trainer = load_config(None, overrides, args.flags).trainer
    assert (trainer.tensor_model_parallel_size, trainer.expert_model_parallel_size) == (2, 2)
    assert trainer.grad_clip == 0.5 and trainer.lr == pytest.approx(3e-4)
    assert trainer.megatron == {"sequence_parallel": True}
    assert trainer.parallel_state_sizes() == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                                              "context_parallel_size": 1, "expert_model_parallel_size": 2,
                                              "expert_tensor_parallel_size": 1}


def test_sglang_and_router_options_arrive_unchanged_in_every_engine_and_router_command(capsys):
    plan = dry_run(capsys, "--config", DEMO, *GPU_NODE, "cluster.engine_tensor_parallel_size=2",
                   "--sglang-mem-fraction-static", "0.61", "--sglang-enable-memory-saver", "--sglang-ep-size", "2",
                   "--sglang-json-model-override-args", '{"rope_theta": 5}', "--router-request-timeout-secs", "77",
                   "--router-disable-retries")["plan"]
    assert len(plan["engines"]) == 2
    for engine in plan["engines"]:
        options, seed = engine["command"].split(" --port PORT ")[1].rsplit(" ", 1)
        assert options == (
            "--tp-size 2 --return-input-ids --return-output-ids --mem-fraction-static 0.61 --enable-memory-saver --ep-size 2 "
            "--json-model-override-args '{\"rope_theta\": 5}'")
        assert seed.startswith("--random-seed=")  # each engine its own (tests/test_sglang_defaults.py)
        assert "-m sglang.launch_server" in engine["command"]
    assert plan["engines"][1]["devices"] == [2, 3]
    assert plan["router"].endswith("--request-timeout-secs 77 --disable-retries")


def test_the_embedded_engine_gets_the_sglang_options_it_implements_and_refuses_the_rest(capsys):
    plan = dry_run(capsys, "--config", DEMO, "--sglang-max-running-requests", "16")["plan"]
    assert all(e["command"].split(" --random-seed=")[0].endswith("--port PORT --max-running-requests 16")
               for e in plan["engines"])
    assert main(["--dry-run", "--config", DEMO, "--sglang-mem-fraction-static", "0.5"]) == 2
    assert "embedded engine (used on CPU) does not implement" in capsys.readouterr().err


def test_the_plan_places_trainer_ranks_after_the_engines_with_megatron_rank_coordinates(capsys):
    plan = dry_run(capsys, "--config", DEMO, *GPU_NODE, "--tensor-model-parallel-size", "2",
                   "trainer.data_parallel_size=2", "cluster.trainer_gpus=4")["plan"]
    assert plan["placement_group"] == {"bundles": 6, "bundle": {"GPU": 1.0, "CPU": 1.0}}
    assert plan["trainer"] == [f"rank {r}: bundle {r + 2}, node 0, gpu {r + 2}, tp={r % 2} cp=0 dp={r // 2} pp=0"
                               for r in range(4)]
    assert plan["notes"] == []  # a DP=2 layout is runnable
    notes = dry_run(capsys, "--config", DEMO, *GPU_NODE, "--context-parallel-size", "2",
                    "cluster.trainer_gpus=2")["plan"]["notes"]
    assert len(notes) == 1 and "context parallelism" in notes[0]  # valid for megatron, not yet for this trainer
    notes = dry_run(capsys, "--config", DEMO, "loss.kl_reward_coef=0.1")["plan"]["notes"]
    assert len(notes) == 1 and "use loss.kl_loss_coef" in notes[0]


MALFORMED = [
    (["--tensor-model-parallel-size", "2", "cluster.trainer_gpus=3"], "TP x PP x CP x DP = 2 x 1 x 1 x 1 = 2 != cluster.trainer_gpus=3"),
    (["--tensor-model-parallel-size", "two"], "argument --tensor-model-parallel-size: invalid int value: 'two'"),
    (["--expert-model-parallel-size", "3"], "expert layout ETP x EP = 1 x 3 must divide TP x CP x DP"),
    (["run.num_stepz=2"], "unknown config key 'run.num_stepz'; did you mean 'run.num_steps'"),
    (["trainer.megatron.sequence_paralel=true"], "did you mean 'sequence_parallel'"),
    (["--num-layers", "4"], "--num-layers 4 does not match model.tiny's config: num_hidden_layers is 2"),
    (["trainer.megatron.num_layers=4"], "comes from the checkpoint's config.json (num_hidden_layers)"),
    (["--sglang-tp-size", "2"], "--sglang-tp-size (sglang.tp_size) is set by sluice itself; use cluster.engine_tensor_parallel_size"),
    (["--sglang-model-path", "/m"], "use model.path"),
    (["--router-policy", "random"], "use rollout.router_policy"),
    (["--sglang-mem-fraction-statik", "0.5", *GPU_NODE], "did you mean --sglang-mem-fraction-static"),
    ([*GPU_NODE, "cluster.engine_gpus=6", "cluster.engine_tensor_parallel_size=4"], "engine_tensor_parallel_size=4 does not divide cluster.engine_gpus=6"),
    (["cluster.gpus_per_node=4", "cluster.placement=colocated", "rollout.num_engines=8"], "colocated placement asks for 8 GPUs"),
    (["run.mode=async", "cluster.placement=colocated"], "run.mode=async needs cluster.placement=disaggregated"),
    (["sync.max_staleness=2"], "sync.max_staleness=2 with run.mode=sync"),
    (["run.mode=async", "sync.max_staleness=1", "sync.interval=3"], "sync.interval=3 must be in [1, max_staleness + 1 = 2]"),
    (["run.mode=async", *GPU_NODE, "sync.pause_mode=retract"], "sync.pause_mode=retract with SGLang engines in async mode"),
    (["trainer.old_logprobs=snapshot", "loss.old_logprobs_from=rollout"], "trainer.old_logprobs=snapshot needs loss.old_logprobs_from=given"),
    (["sync.partial_rollouts=restart", "sync.pause_mode=retract"], "sync.partial_rollouts=restart needs sync.pause_mode=abort"),
]


@pytest.mark.parametrize("argv, message", MALFORMED, ids=[m[1][:40] for m in MALFORMED])
def test_a_malformed_launch_exits_non_zero_with_one_line_naming_the_problem(capsys, argv, message):
    assert main(["--dry-run", "--config", DEMO, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_without_sglang_the_sglang_options_are_forwarded_verbatim_with_a_warning(capsys, monkeypatch):
    import launch.args.sglang

    monkeypatch.setattr(launch.args.sglang, "sglang_options", lambda: None)
    plan = dry_run(capsys, "--config", DEMO, *GPU_NODE, "--sglang-some-new-option", "3", "--sglang-some-switch",
                   "--sglang-some-list", "1", "2", "run.num_steps=4")
    assert plan["plan"]["engines"][0]["command"].split(" --random-seed=")[0].endswith(
        "--tp-size 1 --some-new-option 3 --some-switch --some-list 1 2")
    assert plan["run"]["num_steps"] == 4
    assert main(["--dry-run", "--config", DEMO, *GPU_NODE, "--sglang-port", "1"]) == 2
    assert "use the placement plan" in capsys.readouterr().err


def test_several_values_of_an_sglang_option_are_parsed_with_sglangs_nargs_and_value_type(capsys):
    shown = dry_run(capsys, "--config", DEMO, *GPU_NODE, "--sglang-cuda-graph-bs-decode", "1", "2", "4",
                    "run.num_steps=3", "--sglang-lora-target-modules", "q_proj", "v_proj", "run.seed=5")
    assert shown["sglang"] == {"cuda_graph_bs_decode": [1, 2, 4], "lora_target_modules": ["q_proj", "v_proj"]}
    assert (shown["run"]["num_steps"], shown["run"]["seed"]) == (3, 5)  # the overrides end the values
    command = shown["plan"]["engines"][0]["command"]
    assert "--cuda-graph-bs-decode 1 2 4 --lora-target-modules q_proj v_proj --random-seed=" in command
    assert main(["--dry-run", "--config", DEMO, *GPU_NODE, "--sglang-cuda-graph-bs-decode", "1", "x"]) == 2
    assert "argument --sglang-cuda-graph-bs-decode: invalid int value: 'x'" in capsys.readouterr().err


RENAMED_NOTE = ("sluice: note: --sglang-cuda-graph-bs is --sglang-cuda-graph-bs-decode in the installed sglang "
                "(renamed, same meaning): passed as that")


@pytest.mark.parametrize("argv, values", [
    (["--sglang-cuda-graph-bs", "4"], [4]), (["--sglang-cuda-graph-bs", "1", "2", "4"], [1, 2, 4]),
    (["--sglang-cuda-graph-bs=4"], [4]),
    (["--sglang-cuda-graph-bs", "1", "2", "run.num_steps=3", "--sglang-enable-memory-saver"], [1, 2]),
    (["sglang.cuda_graph_bs=[1,2,4]"], [1, 2, 4]),
], ids=["one value", "three values", "with =", "then an override and a switch", "as a config key"])
def test_a_spelling_sglang_renamed_with_the_same_meaning_is_passed_as_its_new_name_with_a_note(capsys, argv, values):
    # slime's Qwen3-30B-A3B script passes --sglang-cuda-graph-bs; SGLang 0.5.23 calls decode's batch sizes
    # --cuda-graph-bs-decode (CUDA graphs were captured for decode only before prefill got its own)
    assert main(["--dry-run", "--config", DEMO, *GPU_NODE, *argv]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == RENAMED_NOTE
    shown = yaml.safe_load(out)
    assert shown["sglang"]["cuda_graph_bs_decode"] == values and "cuda_graph_bs" not in shown["sglang"]
    assert f"--cuda-graph-bs-decode {' '.join(map(str, values))}" in shown["plan"]["engines"][0]["command"]
    if "run.num_steps=3" in argv:
        assert shown["run"]["num_steps"] == 3 and shown["sglang"]["enable_memory_saver"] is True


def test_a_renamed_option_whose_meaning_is_not_known_is_named_with_its_successors(capsys):
    assert main(["--dry-run", "--config", DEMO, *GPU_NODE, "--sglang-cuda-graph-backend", "disabled"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sluice: config error: unknown sglang option sglang.cuda_graph_backend (--sglang-cuda-graph-backend): the "
        "installed sglang has --sglang-cuda-graph-backend-decode / --sglang-cuda-graph-backend-prefill in its place "
        "(a renamed option); use those")


def test_enable_deepep_moe_is_one_value_of_the_installed_sglangs_moe_a2a_backend(capsys):
    shown = dry_run(capsys, "--config", DEMO, *GPU_NODE, "--sglang-enable-deepep-moe")
    assert shown["sglang"] == {"moe_a2a_backend": "deepep"}


@pytest.mark.parametrize("argv, successor", [
    (["--sglang-disable-cuda-graph"], "--sglang-cuda-graph-backend-{decode,prefill}=disabled"),
    (["--sglang-enable-dp-attention"], "--sglang-attn-dp-size <dp-size>"),
    (["--sglang-monokernel-backend", "amd"], "--sglang-enable-amd-monokernel"),
])
def test_a_spelling_sglang_deprecates_is_refused_naming_the_successor_sglang_gives(capsys, argv, successor):
    assert main(["--dry-run", "--config", DEMO, *GPU_NODE, *argv]) == 2
    key = argv[0][len("--sglang-"):].replace("-", "_")
    assert capsys.readouterr().err.strip() == (f"sluice: config error: {argv[0]} (sglang.{key}) is deprecated by the "
                                               f"installed sglang: use {successor} instead")


def test_the_sglang_options_read_from_source_are_sglangs_server_arguments():
    from launch.args.sglang import sglang_options

    options = sglang_options()
    assert len(options) > 500  # sglang 0.5.23's ServerArgs.add_cli_args registers 531 options besides --help
    assert options["tp_size"].aliases == ("--tensor-parallel-size",) and options["tp_size"].scalar is int
    assert options["mem_fraction_static"].scalar is float and options["mem_fraction_static"].takes == "one"
    assert options["enable_memory_saver"].takes == "none"
    assert options["dcp_replicate_q_proj"].negatable  # argparse.BooleanOptionalAction
    assert options["reasoning_parser"].takes == "one"  # registered by hand in add_cli_args
    # List[int] fields: nargs "+", each value an int, as SGLang's arg_utils registers them
    assert (options["cuda_graph_bs_decode"].takes, options["cuda_graph_bs_decode"].scalar) == ("many", int)
    assert options["lora_paths"].takes == "any"  # action_kwargs={"nargs": "*"}
    assert options["disable_cuda_graph"].successor == "--cuda-graph-backend-{decode,prefill}=disabled"


# GLM-4.5-Air's config.json (the fields a plan reads), as its authors publish it
GLM45_AIR = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
             "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
             "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128,
             "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
             "routed_scaling_factor": 1.0, "norm_topk_prob": True, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
             "vocab_size": 151552, "attention_bias": True, "use_qk_norm": False, "num_nextn_predict_layers": 1,
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}

MOONLIGHT = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
             "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
             "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
             "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
             "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-05, "rope_theta": 50000.0, "rope_scaling": None, "num_nextn_predict_layers": 0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

DEEPSEEK_V3 = {**MOONLIGHT, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
               "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "n_group": 8, "topk_group": 4,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "max_position_embeddings": 163840,
               "rms_norm_eps": 1e-06, "rope_theta": 10000,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"}}


def test_each_launch_script_dry_runs_and_prints_the_placement_plan(tmp_path):
    """With a model directory holding only a config.json that suits every recipe (a Qwen3-MoE shape the MoE
    recipe's EP and the TP of both recipes divide; the dry run plans from it), the recipes' data files pointed at
    one that exists, and neither sluice nor ray on PATH: the scripts find them in the repository's .venv."""
    from glue.embedded_engine.tiny_model import tiny_config

    model = tmp_path / "model"
    tiny_config(family="qwen3_moe", vocab_size=64, num_kv_heads=4, num_experts=16).save_pretrained(model)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    recipe_data = [f"rollout.task_args.path={data}", f"eval.task_args.path={data}"]  # not /data/math/*.jsonl
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != Path(venv_bin))
    env = {**os.environ, "PATH": path, "PYTHONWARNINGS": "ignore"}
    env.pop("SLUICE", None)
    # the slime-shaped scripts give their checkpoint's shape (MODEL_ARGS), checked against config.json: theirs
    # and the GLM-4.5-Air recipe plans its own checkpoint's shape
    models = {"slime_qwen3_8b_dense.sh": CONFIGS["strands_qwen3_8b.sh"],
              "slime_qwen3_30b_a3b_moe.sh": CONFIGS["run-qwen3-30B-A3B.sh"], "glm45_air_moe.sh": GLM45_AIR,
              "moonlight_moe.sh": MOONLIGHT, "deepseek_v3_moe.sh": DEEPSEEK_V3}
    for script, config in models.items():
        (tmp_path / script).mkdir()
        (tmp_path / script / "config.json").write_text(json.dumps(config))
    scripts = sorted((REPO / "launch/scripts").glob("*.sh"))
    assert len(scripts) >= 6
    procs = [subprocess.Popen(["bash", str(s), "--dry-run",
                               f"model.path={tmp_path / s.name if s.name in models else model}",
                               *(recipe_data if s.name != "single_node.sh" else [])],  # demo.yaml: the echo task
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for s in scripts]
    for script, proc in zip(scripts, procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (script.name, err[-2000:])
        plan = yaml.safe_load(out)["plan"]
        assert plan["trainer"] and plan["engines"] and "--worker-urls" in plan["router"], script.name
        assert plan["weight_sync"]["bytes_per_sync"], script.name  # counted from config.json, no weights needed


@pytest.mark.parametrize("argv, bound, mode", [
    ([], 0, "retract"),  # sync: on-policy; the embedded engine stamps every token, so retract is exact
    (["run.mode=async"], 1, "retract"),
    (["run.mode=async", *GPU_NODE], 1, "abort"),  # SGLang answers one version per request: never let one span a sync
    (["run.mode=async", "sync.max_staleness=4", "sync.partial_rollouts=restart"], 4, "abort"),
])
def test_the_staleness_bound_and_pause_mode_resolve_from_mode_and_engine(capsys, argv, bound, mode):
    sync = dry_run(capsys, "--config", DEMO, *argv)["sync"]
    assert (sync["max_staleness"], sync["pause_mode"]) == (bound, mode)
