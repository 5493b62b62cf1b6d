"""slime's launch arguments run as written: slime's own Qwen3 scripts (tests/helpers/slime_scripts.py) plan with
`sluice --dry-run` into the config they mean, slime's defaults where sluice's differ, model-shape flags checked
against config.json, and every refusal one line naming what to use instead."""
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from launch.args.command_line import parse_args
from launch.cli import main
from launch.config import SluiceConfig, compose, load_config
from launch.slime import args as slime_args
from launch.slime.namespace import run_values
from launch.slime.table import SLIME_ROLLOUT
from tests.helpers.slime_scripts import CONFIGS, SCRIPTS

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "examples/configs/demo.yaml")
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, text_model_dir):
    """Per script: a directory with its checkpoint's config.json and a (tiny) tokenizer, data and eval files."""
    root = tmp_path_factory.mktemp("slime")
    (root / "data.jsonl").write_text(json.dumps({"prompt": "What is 2 + 3?", "label": "5"}) + "\n")
    (root / "strands_user.py").write_text(STRANDS_USER)
    dirs = {}
    for name, config in CONFIGS.items():
        folder = root / name.removesuffix(".sh")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        for file in Path(text_model_dir).glob("tokenizer*"):
            shutil.copy(file, folder / file.name)
        dirs[name] = folder
    return root, dirs


def script_argv(name: str, checkpoints) -> list[str]:
    root, dirs = checkpoints
    paths = {"model": str(dirs[name]), "data": str(root / "data.jsonl"), "eval_data": str(root / "data.jsonl"),
             "save": str(root / "runs" / name.removesuffix(".sh")), "user_module": str(root / "strands_user.py")}
    return [arg.format(**paths) if arg.startswith("{") else arg for arg in SCRIPTS[name]]


# the strands example's own generate and reward functions stand in for slime's examples.strands_sglang module
STRANDS_USER = """
async def generate(args, sample, sampling_params):
    return sample


async def reward_func(args, sample, **kwargs):
    return 0.0
"""


def dry_run(capsys, argv: list[str]) -> tuple[dict, str]:
    code = main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return yaml.safe_load(out), err


def subset(shown: dict, expected: dict) -> dict:
    """The values of `shown` at the dotted keys of `expected`."""
    out = {}
    for key in expected:
        node = shown
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


COMMON = {  # what every one of the four scripts means alike
    "rollout.task": "rollout_fns.text_data:TextDataTask", "rollout.task_args.prompt_key": "prompt",
    "rollout.task_args.label_key": "label", "rollout.task_args.shuffle": True,
    "rollout.sampling.temperature": 1.0, "trainer.temperature": 1.0, "loss.advantage_estimator": "grpo",
    "loss.policy_loss": "ppo_clip", "loss.clip_low": 0.2, "loss.clip_high": 0.28, "loss.kl_estimator": "k3",
    "loss.kl_loss_coef": 0.0, "loss.entropy_coef": 0.0, "loss.aggregation": "seq_mean_token_mean",
    "trainer.lr": 1e-6, "trainer.lr_decay_style": "constant", "trainer.weight_decay": 0.1, "trainer.adam_beta2": 0.98,
    "trainer.num_mini_batches": 1, "trainer.dp_balance": "tokens", "trainer.megatron.grad_reduce_in_fp32": True,
    "trainer.megatron.attention_backend": "flash", "trainer.megatron.hidden_dropout": 0.0,
}
EXPECTED = {
    "run-qwen3-4B.sh": {
        "cluster.placement": "colocated", "cluster.num_nodes": 1, "cluster.gpus_per_node": 8, "cluster.trainer_gpus": 8,
        "cluster.engine_gpus": 8, "cluster.engine_tensor_parallel_size": 2, "rollout.num_engines": 4,
        "trainer.tensor_model_parallel_size": 2, "trainer.data_parallel_size": 4, "sync.transport": "ipc",
        "trainer.max_tokens_per_micro_batch": 9216, "rollout.prompts_per_step": 32, "rollout.samples_per_prompt": 8,
        "rollout.sampling.max_new_tokens": 8192, "rollout.task_args.apply_chat_template": True,
        "rollout.task_args.reward": "rollout_fns.slime_rewards:rm_hub_reward",
        "rollout.task_args.reward_args": {"rm_type": "deepscaler"}, "run.num_steps": 3000,
        "run.save_interval": 20, "run.name": "run-qwen3-4B", "run.resume": "auto", "eval.interval": 20,
        "eval.samples_per_prompt": 16, "eval.sampling.temperature": None, "eval.sampling.max_new_tokens": 16384,
        "eval.sampling.top_p": 1.0, "model.shape.num_layers": 36, "trainer.megatron.sequence_parallel": True,
        "sglang.mem_fraction_static": 0.7, "run.mode": "sync",
    },
    "run-qwen3-30B-A3B.sh": {
        "cluster.placement": "colocated", "cluster.trainer_gpus": 8, "rollout.num_engines": 1,
        "cluster.engine_tensor_parallel_size": 8, "trainer.tensor_model_parallel_size": 4,
        "trainer.expert_model_parallel_size": 8, "trainer.expert_tensor_parallel_size": 1,
        "trainer.data_parallel_size": 2, "sync.transport": "ipc", "trainer.max_tokens_per_micro_batch": 20480,
        "trainer.megatron.optimizer_cpu_offload": True, "trainer.megatron.use_precision_aware_optimizer": True,
        "trainer.megatron.moe_router_dtype": "fp32", "model.shape.num_experts": 128,
        "model.shape.moe_layer_freq": [1] * 48, "sglang.cuda_graph_bs_decode": [1, 2, 4, 8, *range(16, 257, 8)],
    },
    "strands_qwen3_8b.sh": {
        "cluster.placement": "colocated", "rollout.num_engines": 4, "trainer.data_parallel_size": 4,
        "rollout.prompts_per_step": 16, "rollout.sampling.max_new_tokens": 16384,
        "rollout.task_args.apply_chat_template": False, "run.loggers": ["jsonl", "tensorboard", "wandb"],
        "run.wandb.mode": "online", "run.wandb.project": "strands-slime", "run.wandb.group": "Qwen3-8B-strands-dapo",
        "model.shape.untie_embeddings_and_output_weights": True, "sglang.mem_fraction_static": 0.4,
    },
    "run-qwen2.5-0.5B-fully_async.sh": {
        "run.mode": "async", "cluster.placement": "disaggregated", "cluster.num_nodes": 1, "cluster.trainer_gpus": 1,
        "cluster.engine_gpus": 3, "rollout.num_engines": 3, "trainer.tensor_model_parallel_size": 1,
        "trainer.data_parallel_size": 1, "sync.transport": "broadcast", "run.num_steps": 3, "run.save_interval": 9999,
        "rollout.prompts_per_step": 8, "rollout.samples_per_prompt": 4, "trainer.max_tokens_per_micro_batch": 4096,
        "model.shape.add_qkv_bias": True, "eval.interval": None,
    },
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_slimes_own_qwen3_scripts_plan_as_written_with_the_config_they_mean(name, checkpoints, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "unset")  # --wandb-key sets it; monkeypatch puts it back
    shown, err = dry_run(capsys, script_argv(name, checkpoints))
    expected = {**COMMON, **EXPECTED[name]}
    assert subset(shown, expected) == expected
    assert shown["plan"]["notes"] == []
    assert shown["run"]["output_dir"] == str(checkpoints[0] / "runs")
    if name == "strands_qwen3_8b.sh":
        assert os.environ["WANDB_API_KEY"] == "test-key" and "test-key" not in json.dumps(shown)
        user_module = str(checkpoints[0] / "strands_user.py")
        assert shown["rollout"]["slime"]["generate_function"] == f"{user_module}:generate"
        assert shown["reward"]["slime"]["function"] == f"{user_module}:reward_func"
        assert shown["rollout"]["function"] == "rollout_fns.slime_functions:generate_group"
    if name == "run-qwen3-4B.sh":  # --colocate, 4 engines of TP 2: each engine rank reads the copy on its own GPU
        sync = shown["plan"]["weight_sync"]
        assert sync["sources"].startswith("one per GPU: trainer rank 0 gathers each bucket and broadcasts it to "
                                          "ranks 1-7") and "disk" not in err + json.dumps(sync)
        assert sync["ipc_handles"][3] == ("engine 3: TP rank 0 <- trainer rank 6 (node 0 gpu 6), TP rank 1 <- "
                                          "trainer rank 7 (node 0 gpu 7)")
    if name == "run-qwen2.5-0.5B-fully_async.sh":  # slime's own async example passes --sequence-parallel at TP=1
        assert "sequence_parallel" not in shown["trainer"]["megatron"]
        assert "--sequence-parallel is turned off at --tensor-model-parallel-size 1, as Megatron-LM does" in err


def test_the_table_maps_the_rollout_reward_and_reference_flags_to_their_keys():
    translated = slime_args.translate({"custom_generate_function_path": "my.gen:generate",
                                       "rollout_function_path": "my.rollout:generate_rollout",
                                       "custom_rm_path": "my.rm:reward", "ref_load": "/ckpt/ref"}, {})
    assert translated.values == {"rollout.slime.generate_function": "my.gen:generate",
                                 "rollout.slime.rollout_function": "my.rollout:generate_rollout",
                                 "reward.slime.function": "my.rm:reward", "trainer.ref_load": "/ckpt/ref"}
    assert slime_args.translate({"rollout_function_path": SLIME_ROLLOUT}, {}).values == {}


def test_rm_type_and_the_context_length_reach_the_functions_args_with_slimes_prompt_limit():
    translated = slime_args.translate({"rm_type": "deepscaler", "rollout_max_context_len": 4096}, {})
    assert translated.values == {"rollout.slime.rm_type": "deepscaler", "rollout.slime.max_context_len": 4096,
                                 "rollout.task_args.max_prompt_tokens": 4095,
                                 "rollout.task_args.reward": "rollout_fns.slime_rewards:rm_hub_reward",
                                 "rollout.task_args.reward_args": {"rm_type": "deepscaler"}}
    own_limit = slime_args.translate({"rollout_max_context_len": 4096, "rollout_max_prompt_len": 1000}, {}).values
    assert own_limit["rollout.task_args.max_prompt_tokens"] == 1000
    custom = slime_args.translate({"rm_type": "search_r1", "custom_rm_path": "my.rm:reward"}, {}).values
    assert custom == {"rollout.slime.rm_type": "search_r1", "reward.slime.function": "my.rm:reward"}
    with pytest.raises(ValueError, match="^--rollout-max-prompt-len 4096 must be at most --rollout-max-context-len "
                                         "4096 - 1"):
        slime_args.translate({"rollout_max_context_len": 4096, "rollout_max_prompt_len": 4096}, {})


def test_slime_scripts_reward_key_score_and_over_sampling_batch_size_are_accepted_with_slimes_meaning():
    translated = slime_args.translate({"reward_key": "score", "eval_reward_key": "score",
                                       "over_sampling_batch_size": 64}, {})
    assert translated.values == {"rollout.slime.over_sampling_batch_size": 64}
    cfg = load_config(DEMO, [], None, {"over_sampling_batch_size": 64})
    assert run_values(cfg)["over_sampling_batch_size"] == 64


def test_a_colocated_script_on_one_gpu_plans_its_ipc_sync_with_no_other_copy(text_model_dir, capsys):
    shown, _ = dry_run(capsys, ["--hf-checkpoint", text_model_dir, "--actor-num-nodes", "1",
                                "--actor-num-gpus-per-node", "1", "--colocate"])
    assert shown["plan"]["weight_sync"]["sources"].startswith("one per GPU: trainer rank 0 gathers each bucket, and "
                                                              "every engine TP rank reads"), shown["plan"]["weight_sync"]


def test_a_model_shape_flag_that_config_json_contradicts_is_refused_naming_both_values(checkpoints, capsys):
    argv = script_argv("run-qwen3-4B.sh", checkpoints)
    for extra, says in ((["--num-layers", "28"], "--num-layers 28 does not match {}/config.json: num_hidden_layers is 36"),
                        (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights does not "
                                                                    "match {}/config.json: tie_word_embeddings is True"),
                        (["--moe-layer-freq", "[1,1]"], "--moe-layer-freq [1, 1] does not match {}/config.json")):
        assert main(["--dry-run", *argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert says.format(checkpoints[1]["run-qwen3-4B.sh"]) in err, err


@pytest.mark.parametrize("argv, line", [
    (["--num-epoch", "3"], "sluice: config error: --num-epoch (slime) has no sluice equivalent: run.num_steps "
                           "(--num-rollout): epochs x rows / --rollout-batch-size"),
    (["--rm-type", "remote_rm"], "sluice: config error: --rm-type remote_rm: no sluice equivalent (sluice has "
                                 "deepscaler, dapo, math, f1, gpqa, ifbench, random, each also as boxed_<name>); use "
                                 "--custom-rm-path, reward_model: for a served reward model, or rollout.task_args.reward"),
    (["--global-batch-size", "48"], "sluice: config error: --global-batch-size 48 must divide the 16 x 8 = 128 samples "
                                    "of a rollout (--rollout-batch-size x --n-samples-per-prompt)"),
    (["--use-dynamic-batch-size"], "sluice: config error: --use-dynamic-batch-size needs --max-tokens-per-gpu"),
    (["--prompt-data", "x.jsonl"], "sluice: config error: --prompt-data needs --label-key"),
    (["--rollout-batch", "4"], "sluice: error: unrecognised option '--rollout-batch': not a sluice, slime, megatron, "
                               "--sglang-* or --router-* flag; did you mean --rollout-batch-size?"),
    (["--eval-promt-data", "x"], "did you mean --eval-prompt-data?"),
    (["--reward-key", "acc"], "sluice: config error: --reward-key acc: sluice trains the 'score' of a reward "
                              "function's dict; return the value to train under 'score' (or give --reward-key score)"),
], ids=["num-epoch", "rm-type", "global-batch-size", "dynamic batch", "label key", "did you mean",
        "did you mean eval", "reward key"])
def test_a_slime_argument_sluice_cannot_run_is_refused_in_one_line_saying_what_to_use(capsys, argv, line):
    assert main(["--dry-run", "--config", DEMO, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert line in err and "\n" not in err, err


def test_slimes_defaults_fill_only_what_the_run_config_leaves_unset(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump({"eval": {"sampling": {"temperature": 0.6}},
                                      "rollout": {"task_args": {"shuffle": True, "label_key": "answer"}}}))
    given = ["--prompt-data", "d.jsonl", "--eval-interval", "5", "--eps-clip", "0.3"]
    args, overrides = parse_args([*given, "--label-key", "label"])
    raw = compose(None, overrides, args.flags, args.slime)
    assert raw["eval"]["sampling"]["temperature"] is None  # slime's eval runs at the rollout temperature
    assert raw["rollout"]["task_args"] == {"path": "d.jsonl", "label_key": "label", "prompt_key": "input",
                                           "apply_chat_template": False, "shuffle": False}
    assert (raw["loss"]["clip_low"], raw["loss"]["clip_high"], raw["loss"]["aggregation"]) == \
        (0.3, 0.3, "seq_mean_token_mean")
    args, overrides = parse_args(["--config", str(recipe), *given, "loss.aggregation=token_mean"])
    raw = compose(recipe, overrides, args.flags, args.slime)
    assert raw["eval"]["sampling"]["temperature"] == 0.6 and raw["rollout"]["task_args"]["shuffle"] is True
    assert raw["rollout"]["task_args"]["label_key"] == "answer" and raw["loss"]["aggregation"] == "token_mean"


def test_gspo_takes_the_clip_range_into_its_own_fields_and_kl_counts_only_with_use_kl_loss():
    args, overrides = parse_args(["--advantage-estimator", "gspo", "--eps-clip", "3e-4", "--eps-clip-high", "4e-4",
                                  "--kl-loss-coef", "0.1"])
    loss = compose(None, overrides, args.flags, args.slime)["loss"]
    assert loss == {"advantage_estimator": "grpo", "policy_loss": "gspo", "gspo_clip_low": 3e-4,
                    "gspo_clip_high": 4e-4, "aggregation": "seq_mean_token_mean"}


def test_help_slime_lists_every_row_with_its_sluice_key_and_the_main_help_points_at_it(capsys):
    assert main(["--help", "slime"]) == 0
    out = capsys.readouterr().out
    for row in slime_args.ROWS:
        assert f"  {row.flag:<44} {row.key}" in out, row.flag
    assert len(slime_args.ROWS) > 200
    assert main(["--help"]) == 0
    assert "slime's launch arguments: sluice --help slime" in capsys.readouterr().out


def test_docs_from_slime_lists_the_table_as_the_code_has_it():
    text = (REPO / "docs/from_slime.md").read_text()
    assert slime_args.markdown_table() in text


@pytest.mark.parametrize("recipe", ["qwen3_8b_dense", "qwen3_30b_a3b_moe"])
def test_a_slime_shaped_launch_script_is_the_same_run_as_the_recipe_it_rewrites(recipe, tmp_path):
    """launch/scripts/slime_<recipe>.sh, in slime's argument groups, resolves to the config of <recipe>.sh (which
    `make rehearse` runs like every other script); only the model-shape flags it adds, checked against config.json,
    and spellings of the same values differ."""
    from launch.config import build, to_dict
    from launch.tools.rehearse import load_recipe, raw_config

    def resolved(name):
        return to_dict(build(SluiceConfig, raw_config(load_recipe(f"launch/scripts/{name}.sh", tmp_path / name).argv),
                             prefix=""))

    original, slime = resolved(recipe), resolved(f"slime_{recipe}")
    assert slime["model"].pop("shape")["num_layers"] == {"qwen3_8b_dense": 36, "qwen3_30b_a3b_moe": 48}[recipe]
    assert original["model"].pop("shape") == {}
    # the same engine GPUs, given (slime's --rollout-num-gpus) or left to num_engines x TP
    assert slime["cluster"]["engine_gpus"] == original["rollout"]["num_engines"] * \
        original["cluster"]["engine_tensor_parallel_size"]
    original["cluster"]["engine_gpus"] = slime["cluster"]["engine_gpus"]
    # TextDataTask's own defaults, written out by the slime arguments (--apply-chat-template, --rollout-shuffle)
    original["rollout"]["task_args"].update(apply_chat_template=True, shuffle=True)
    # --bf16 alone is bf16 weights (trainer.precision: auto); megatron's --optimizer adam is what the trainer runs
    original["trainer"]["megatron"].pop("params_dtype", None)
    slime["trainer"]["megatron"].pop("optimizer")
    # --rm-type is also kept as slime functions' args.rm_type; this run has no slime function to read it
    assert slime["rollout"]["slime"].pop("rm_type") == "math" and original["rollout"]["slime"].pop("rm_type") is None
    # --rm-type math grades the boxed answer by slime's own rule (rm_hub), the recipe by Math-Verify on the boxed answer
    task, recipe_task = slime["rollout"]["task_args"], original["rollout"]["task_args"]
    assert (task.pop("reward"), task.pop("reward_args")) == ("rollout_fns.slime_rewards:rm_hub_reward", {"rm_type": "math"})
    assert recipe_task.pop("reward") == "rollout_fns.verifiers:math_reward"
    assert recipe_task.pop("reward_args") == {"require_boxed": True}
    assert slime == original
