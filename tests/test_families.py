"""Model families (weight_sync.families), each proved against checkpoints transformers writes itself: every family's
name table covers exactly the tensors `save_pretrained` writes, the engine names its weights as the checkpoint does,
`--dry-run` refuses in one line what the trainer would refuse (an unbuilt RoPE type, Mixtral's sliding window) and
passes what it builds (Llama 3.1's scaled RoPE), and a short GRPO run of a scaled-RoPE Llama and of a Mixtral with
routing replay keeps the trainer on the engines' policy at step 1."""
from __future__ import annotations

import importlib
import json
import pkgutil

import pytest
import torch
import transformers
from safetensors import safe_open

import weight_sync.families as families
from glue.metrics.logger import read_metrics
from launch.args.command_line import parse_args
from launch.cli import main
from launch.config import load_config
from launch.run.runner import run
from weight_sync.families import FAMILIES, MoeFamily, family_of, rules

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def write_checkpoint(path, family: str, **fields) -> str:
    """A tiny random checkpoint of `family`, written by transformers from the family's own config class."""
    from glue.embedded_engine.tiny_model import tiny_config

    config = tiny_config(family=family)
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


def test_every_family_module_is_registered_once_and_takes_its_own_model_types():
    modules = {m.name for m in pkgutil.iter_modules(families.__path__)} - {"base", "table"}
    assert {importlib.import_module(f"weight_sync.families.{m}").FAMILY.name for m in modules} == set(FAMILIES)
    taken = [t for f in FAMILIES.values() for t in f.model_types]
    assert len(taken) == len(set(taken)), taken
    with pytest.raises(ValueError, match=r"model_type 'gemma3_text' is not supported by the megatron trainer yet"):
        family_of({"model_type": "gemma3_text"})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_name_table_is_exactly_what_transformers_writes(tmp_path, family, capsys):
    path = write_checkpoint(tmp_path / family, family)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        written = set(f.keys())
    table = {name for rule in rules(json.loads((tmp_path / family / "config.json").read_text())) for name in rule.hf}
    assert table == written, (sorted(table - written)[:4], sorted(written - table)[:4])


def test_the_engine_names_a_mixtral_expert_as_its_checkpoint_does(tmp_path):
    from glue.embedded_engine.checkpoint_names import checkpoint_tensors

    path = write_checkpoint(tmp_path / "mixtral", "mixtral")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    named = checkpoint_tensors(model)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert set(named) == set(f.keys())
        for name in ("model.layers.1.block_sparse_moe.experts.3.w3.weight", "model.layers.0.block_sparse_moe.gate.weight"):
            assert torch.equal(named[name], f.get_tensor(name)), name


def test_the_engine_names_gpt_oss_fused_experts_as_its_checkpoint_does(tmp_path):
    from glue.embedded_engine.checkpoint_names import checkpoint_tensors

    path = write_checkpoint(tmp_path / "gpt_oss", "gpt_oss")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    named = checkpoint_tensors(model)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert set(named) == set(f.keys())
        for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.router.bias",
                     "model.layers.0.self_attn.sinks"):
            assert torch.equal(named[name], f.get_tensor(name)), name


def test_a_moe_family_knows_its_loaded_and_checkpoint_names_both_ways():
    mixtral = FAMILIES["mixtral"]
    assert isinstance(mixtral, MoeFamily)
    pairs = {"model.layers.2.block_sparse_moe.experts.5.w1.weight": "model.layers.2.mlp.experts.5.gate_proj.weight",
             "model.layers.2.block_sparse_moe.experts.5.w3.weight": "model.layers.2.mlp.experts.5.up_proj.weight",
             "model.layers.2.block_sparse_moe.experts.5.w2.weight": "model.layers.2.mlp.experts.5.down_proj.weight",
             "model.layers.2.block_sparse_moe.gate.weight": "model.layers.2.mlp.gate.weight",
             "model.layers.2.self_attn.o_proj.weight": "model.layers.2.self_attn.o_proj.weight"}
    for checkpoint, loaded in pairs.items():
        assert mixtral.loaded_name(checkpoint) == loaded
        assert mixtral.checkpoint_name(loaded) == checkpoint


def dry_run(capsys, model_dir: str) -> tuple[int, str]:
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={model_dir}"])
    captured = capsys.readouterr()
    return code, captured.err.strip()


def test_dry_run_passes_llama_3_1s_scaled_rope_and_refuses_those_the_trainer_does_not_build(tmp_path, capsys):
    assert dry_run(capsys, write_checkpoint(tmp_path / "llama3", "llama", rope_parameters=LLAMA3_ROPE)) == (0, "")
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    code, err = dry_run(capsys, write_checkpoint(tmp_path / "dynamic", "llama", rope_parameters=dynamic))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "rope_type 'dynamic' is not supported by the megatron trainer yet" in err, err
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    code, err = dry_run(capsys, write_checkpoint(tmp_path / "glm_yarn", "glm4_moe", rope_parameters=yarn))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "rope_type 'yarn' with partial_rotary_factor=0.5" in err, err


def test_a_field_combination_megatron_core_rejects_is_refused_by_the_dry_run_in_one_line(capsys):
    # group-limited routing without the number of groups: megatron-core's config validation raises at every rank's
    # start; the dry run builds the same config
    code = main(["--dry-run", "--config", "examples/configs/demo.yaml", "model.tiny.family=qwen3_moe",
                 "--moe-router-group-topk", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "megatron-core refuses" in err and "moe_router_num_groups must be specified" in err, err


def test_dry_run_refuses_a_mixtral_with_a_sliding_window_in_one_line(tmp_path, capsys):
    code, err = dry_run(capsys, write_checkpoint(tmp_path / "mixtral", "mixtral", sliding_window=8))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "sliding_window=8" in err and "set sliding_window: null" in err, err


def test_gpt_oss_refuses_what_the_trainer_does_not_build_each_in_one_line():
    from glue.embedded_engine.tiny_model import tiny_config

    gpt_oss = FAMILIES["gpt_oss"]
    gpt_oss.check(tiny_config(family="gpt_oss"))  # the tiny one, features on, builds
    refused = {"quantization_config": ({"quant_method": "mxfp4"}, "quant_method='mxfp4'.*dequantized checkpoint"),
               "attention_bias": (False, "attention_bias=false"),
               "layer_types": (["sliding_attention", "chunked_attention"], r"\['chunked_attention'\]"),
               "swiglu_alpha": (1.5, "swiglu_alpha=1.5.*quick_gelu")}
    for field, (value, message) in refused.items():
        config = tiny_config(family="gpt_oss")
        setattr(config, field, value)
        with pytest.raises(ValueError, match=message) as err:
            gpt_oss.check(config)
        assert "\n" not in str(err.value), field


def test_dry_run_plans_a_gpt_oss_and_refuses_its_experts_split_over_tp_in_one_line(tmp_path, capsys):
    model_dir = write_checkpoint(tmp_path / "gpt_oss", "gpt_oss")
    capsys.readouterr()
    assert main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={model_dir}"]) == 0
    assert "attention (auto): sluice core attention with sinks and sliding windows" in capsys.readouterr().out
    code = main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={model_dir}",
                 "trainer.tensor_model_parallel_size=2", "--sequence-parallel"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "trainer.expert_tensor_parallel_size=2" in err and "set trainer.expert_tensor_parallel_size: 1" in err
    for flags in (["--attention-backend", "local"], ["trainer.layer_spec=te"]):
        code = main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={model_dir}", *flags])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "attention sinks and sliding windows (gpt_oss) run on sluice's core attention only" in err, err


def short_run(tmp_path, name: str, overrides: list[str]) -> list[dict]:
    args, rest = parse_args(["--config", "examples/configs/demo.yaml", f"run.output_dir={tmp_path}",
                             f"run.name={name}", "run.num_steps=3", "rollout.prompts_per_step=4",
                             "rollout.samples_per_prompt=4", *overrides])
    return read_metrics(run(load_config(args.config, rest, args.flags)) / "metrics.jsonl")


@pytest.mark.long  # a second variant: tests/test_convert_megatron.py checks llama3 RoPE's logprobs against HF's
def test_a_llama_with_llama3_rope_trains_on_the_engines_policy(tmp_path):
    path = write_checkpoint(tmp_path / "llama3", "llama", rope_parameters=LLAMA3_ROPE)
    records = short_run(tmp_path, "llama3", [f"model.path={path}"])
    print("llama3 |train - rollout| by step:", [r["train/train_rollout_logprob_abs_diff"] for r in records])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5, records[0]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3, records


@pytest.mark.long  # a second variant of the end-to-end run: tests/test_convert_megatron.py checks glm4's logprobs
def test_glm4_with_its_post_norms_and_interleaved_half_rope_trains_on_packed_rows_on_the_engines_policy(tmp_path):
    records = short_run(tmp_path, "glm4", ["model.tiny.family=glm4", "trainer.max_tokens_per_micro_batch=96"])
    print("glm4 |train - rollout| by step:", [r["train/train_rollout_logprob_abs_diff"] for r in records])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5, records[0]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3, records


@pytest.mark.slow
# deepseek_v3's run stays in `make test` (MLA, the sigmoid router, packed rows); the others are second variants of
# it, kept for `make test-long` (their logprobs against HF's are in tests/test_convert_megatron.py)
@pytest.mark.parametrize("family", [pytest.param(name, marks=pytest.mark.long) for name in ("mixtral", "glm4_moe",
                                                                                            "gpt_oss")]
                         + ["deepseek_v3"])
def test_a_moe_family_trains_with_routing_replay_on_the_engines_policy(tmp_path, family):
    # DeepSeek-V3's and gpt-oss's on packed rows: MLA rotates a THD row span by span, and gpt-oss's sinks and window
    # run per span, where the others' padded rows do neither
    packed = ["trainer.max_tokens_per_micro_batch=96"] if family in ("deepseek_v3", "gpt_oss") else []
    records = short_run(tmp_path, family, [f"model.tiny.family={family}", "model.tiny.num_experts=4",
                                           "model.tiny.moe_top_k=2", "rollout.return_routed_experts=true",
                                           "trainer.routing_replay=true", *packed])
    print(f"{family} |train - rollout| by step:", [r["train/train_rollout_logprob_abs_diff"] for r in records],
          "routing agreement:", [r["moe/routing_agreement"] for r in records])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5, records[0]
    assert all(r["moe/routing_agreement"] > 0.9 for r in records), [r.get("moe/routing_agreement") for r in records]


@pytest.mark.slow
@pytest.mark.long  # two trainer ranks; tests/test_convert_megatron.py checks TP 2's logprobs against HF's
def test_a_gpt_oss_at_tp2_trains_its_split_sinks_and_exports_them_from_a_distributed_checkpoint(tmp_path):
    # the run ends by exporting its last distributed checkpoint to HF, which reads each TP rank's sinks as its heads'
    records = short_run(tmp_path, "gpt_oss_tp2", [
        "model.tiny.family=gpt_oss", "rollout.return_routed_experts=true", "trainer.routing_replay=true",
        "trainer.max_tokens_per_micro_batch=96", "trainer.tensor_model_parallel_size=2",
        "trainer.expert_tensor_parallel_size=1", "--sequence-parallel"])
    print("gpt_oss TP 2 |train - rollout| by step:", [r["train/train_rollout_logprob_abs_diff"] for r in records])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5, records[0]
    # its experts are whole on each TP rank (expert TP 1): their copies' gradients summed, so no drift after a sync
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3, records
    assert (tmp_path / "gpt_oss_tp2" / "hf" / "config.json").exists()


# config.json of released checkpoints (the fields a plan reads), written as their authors publish them
RELEASED = {
    "Mixtral-8x7B": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                     "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False,
                     "torch_dtype": "bfloat16"},
    "GLM-4.5": {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120,
                "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
                "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 160,
                "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 1,
                "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
                "rope_theta": 1000000, "vocab_size": 151552, "attention_bias": True, "use_qk_norm": True,
                "num_nextn_predict_layers": 1, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # as published: block-FP8 weights (dequantized at load), YaRN with mscale, one MTP layer
    "DeepSeek-V3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
                    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
                    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
                    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
                    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
                    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
                    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                            "weight_block_size": [128, 128]}},
    # model_type kimi_k2 (transformers has no class of its own for it): DeepSeek-V3's architecture, 384 experts
    "Kimi-K2": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
                "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                "num_hidden_layers": 61, "num_nextn_predict_layers": 0, "num_attention_heads": 64,
                "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
                "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
                "first_k_dense_replace": 1, "norm_topk_prob": True, "hidden_act": "silu",
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 50000.0,
                "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 163584,
                "eos_token_id": 163585,
                "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [128, 128]}},
    "GLM-4-9B-0414": {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "hidden_size": 4096,
                      "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32,
                      "num_key_value_heads": 2, "head_dim": 128, "attention_bias": True, "partial_rotary_factor": 0.5,
                      "rope_theta": 10000.0, "vocab_size": 151552, "rms_norm_eps": 1e-5,
                      "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                      "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]},
    "Moonlight-16B-A3B": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                          "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
                          "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
                          "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None,
                          "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
                          "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1,
                          "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
                          "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
                          "rope_theta": 50000.0, "rope_scaling": None, "tie_word_embeddings": False,
                          "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16", "bos_token_id": 163584,
                          "eos_token_id": 163585},
    # dequantized to bf16 (the release's MXFP4 `quantization_config` dropped, which check() refuses)
    "gpt-oss-20b": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
                    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
                    "vocab_size": 201088, "sliding_window": 128, "attention_bias": True, "swiglu_limit": 7.0,
                    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
                    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096},
                    "rope_theta": 150000, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
                    "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "bfloat16"},
    "Llama-3.1-8B": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
                     "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "torch_dtype": "bfloat16"},
}
# gpt-oss-120b: gpt-oss-20b's architecture with 36 layers and 128 experts
RELEASED["gpt-oss-120b"] = {**RELEASED["gpt-oss-20b"], "num_hidden_layers": 36, "num_local_experts": 128,
                            "layer_types": ["sliding_attention", "full_attention"] * 18}
# engines and trainer on 8-GPU nodes, the trainer's optimizer state offloaded; the MoE experts over EP 8
LAYOUT = ["cluster.gpus_per_node=8", "run.ray_address=auto", "--sequence-parallel", "--optimizer-cpu-offload",
          "--tensor-model-parallel-size", "4", "trainer.data_parallel_size=2"]
LAYOUTS = {  # 2 engines x TP4 + trainer TP4 x DP2 on two nodes; GLM-4.5 (705 GB of bf16 weights): one engine of
    # TP8 on a node of 141 GB GPUs, the trainer TP4 x PP4 x DP2 on four more
    "Mixtral-8x7B": ["cluster.num_nodes=2", "cluster.engine_tensor_parallel_size=4", "--expert-model-parallel-size",
                     "8", "--expert-tensor-parallel-size", "1"],
    "Llama-3.1-8B": ["cluster.num_nodes=2", "cluster.engine_tensor_parallel_size=4"],
    # DeepSeek-V3 (1.34 TB of bf16 weights): one engine of TP 16 over two nodes, the trainer TP8 x PP4 x DP4 with
    # EP32 over 16 more, its 61 layers split 13 / 16 / 16 / 16 as slime's DeepSeek scripts split them
    "DeepSeek-V3": ["cluster.num_nodes=18", "cluster.gpu_memory_gb=141", "cluster.engine_tensor_parallel_size=16",
                    "rollout.num_engines=1", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size",
                    "4", "--decoder-first-pipeline-num-layers", "13", "--decoder-last-pipeline-num-layers", "16",
                    "trainer.data_parallel_size=4", "--expert-model-parallel-size", "32",
                    "--expert-tensor-parallel-size", "1"],
    # Kimi-K2 (2.05 TB): one engine of TP 32 over four nodes, the trainer as DeepSeek-V3's
    "Kimi-K2": ["cluster.num_nodes=20", "cluster.gpu_memory_gb=141", "cluster.engine_tensor_parallel_size=32",
                "rollout.num_engines=1", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
                "--decoder-first-pipeline-num-layers", "13", "--decoder-last-pipeline-num-layers", "16",
                "trainer.data_parallel_size=4", "--expert-model-parallel-size", "32",
                "--expert-tensor-parallel-size", "1"],
    "GLM-4-9B-0414": ["cluster.num_nodes=2", "cluster.engine_tensor_parallel_size=2", "--tensor-model-parallel-size", "2",
                      "trainer.data_parallel_size=4"],
    "gpt-oss-20b": ["cluster.num_nodes=2", "cluster.engine_tensor_parallel_size=4", "--expert-model-parallel-size",
                    "8", "--expert-tensor-parallel-size", "1"],
    # gpt-oss-120b (117B, 234 GB in bf16): engines of TP 4, the trainer TP4 x DP4 with EP 16 (8 experts a rank) on
    # two more nodes
    "gpt-oss-120b": ["cluster.num_nodes=3", "cluster.engine_tensor_parallel_size=4", "trainer.data_parallel_size=4",
                     "--expert-model-parallel-size", "16", "--expert-tensor-parallel-size", "1"],
    "Moonlight-16B-A3B": ["cluster.num_nodes=2", "cluster.engine_tensor_parallel_size=4",
                          "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1"],
    "GLM-4.5": ["cluster.num_nodes=5", "cluster.gpu_memory_gb=141", "cluster.engine_tensor_parallel_size=8",
                "rollout.num_engines=1", "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                "--expert-tensor-parallel-size", "1"],
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n == "Kimi-K2" else n  # as DeepSeek-V3
                                  for n in sorted(RELEASED)])
def test_a_released_shape_plans_from_config_json_alone_with_transformers_parameter_count(tmp_path, capsys, name):
    import yaml

    from glue.trainer.model import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(RELEASED[name]))
    config = read_hf_config(str(tmp_path))  # transformers' own class (Kimi-K2's kimi_k2: DeepSeek-V3's)
    with torch.device("meta"):
        count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={tmp_path}", *LAYOUT,
                 *LAYOUTS[name]]) == 0, capsys.readouterr().err
    plan = yaml.safe_load(capsys.readouterr().out)["plan"]
    sync = plan["weight_sync"]
    family = family_of(config).name
    assert sync["parameters"].startswith(f"{count:,} ({family}, counted from config.json"), sync["parameters"]
    buffers = RELEASED[name].get("n_routed_experts", 0) * (  # the expert bias of every MoE layer is sent too
        RELEASED[name]["num_hidden_layers"] - RELEASED[name].get("first_k_dense_replace", 0))
    assert sync["bytes_per_sync"].startswith(f"{2 * (count + buffers):,} = "), sync["bytes_per_sync"]  # bf16
    if RELEASED[name].get("num_nextn_predict_layers"):  # MTP: transformers builds none; the plan adds and says it
        config.num_hidden_layers += 1  # one more MoE decoder layer, plus the MTP layer's own embedding and head
        with torch.device("meta"):  # copies, its [embedding; hidden] projection and three norms
            layer = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()) - count
        hidden, vocab = config.hidden_size, config.vocab_size
        mtp = layer + 2 * vocab * hidden + 2 * hidden * hidden + 3 * hidden
        assert f"; + {mtp:,} in 1 multi-token-prediction layer(s), kept frozen" in sync["parameters"], sync


def test_a_deepseek_v3_layout_that_cannot_fit_is_refused_with_its_figures_and_one_that_does(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED["DeepSeek-V3"]))
    # TP8 x DP1 with EP8 and no pipeline: 32 experts of every MoE layer on each of 8 GPUs
    small = ["cluster.num_nodes=3", "cluster.gpu_memory_gb=141", "cluster.engine_tensor_parallel_size=16",
             "rollout.num_engines=1", "--tensor-model-parallel-size", "8", "trainer.data_parallel_size=1",
             "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1"]
    assert main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={tmp_path}", *LAYOUT,
                 *small]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "more than cluster.gpu_memory_gb=141" in err and "would fit" in err, err


# slime's MODEL_ARGS for GLM-4.5 (scripts/models/glm4.5-355B-A32B.sh), flag by flag as its scripts pass them
SLIME_GLM45 = ("--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 96 "
               "--num-query-groups 8 --kv-channels 128 --num-layers 92 --hidden-size 5120 --ffn-hidden-size 12288 "
               "--add-qkv-bias --normalization RMSNorm --position-embedding-type rope --rotary-percent 0.5 --swiglu "
               "--untie-embeddings-and-output-weights --vocab-size 151552 --rotary-base 1000000 "
               "--moe-ffn-hidden-size 1536 --moe-shared-expert-intermediate-size 1536 --moe-router-pre-softmax "
               "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0 "
               "--moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall "
               "--moe-router-topk 8 --moe-router-topk-scaling-factor 2.5 --moe-layer-freq [0]*3+[1]*89 "
               "--num-experts 160 --moe-grouped-gemm --moe-router-dtype fp32 --moe-permute-fusion "
               "--moe-aux-loss-coeff 0").split()


# slime's MODEL_ARGS for Moonlight-16B-A3B (scripts/models/moonlight.sh), with its shell variables expanded
SLIME_MOONLIGHT = ("--disable-bias-linear --num-layers 27 --hidden-size 2048 --ffn-hidden-size 11264 "
                   "--num-attention-heads 16 --kv-channels 128 --normalization RMSNorm --position-embedding-type rope "
                   "--norm-epsilon 1e-5 --rotary-percent 1.0 --swiglu --untie-embeddings-and-output-weights "
                   "--no-masked-softmax-fusion --vocab-size 163840 --multi-latent-attention --kv-lora-rank 512 "
                   "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
                   "--rotary-scaling-factor 1 --rotary-base 50000 --mscale 1.0 --mscale-all-dim 1.0 "
                   "--attention-softmax-in-fp32 --no-rope-fusion --num-experts 64 "
                   f"--moe-layer-freq [{','.join(['0'] + ['1'] * 26)}] --moe-ffn-hidden-size 1408 --moe-router-topk 6 "
                   "--moe-shared-expert-intermediate-size 2816 --moe-router-pre-softmax --moe-router-score-function "
                   "sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss "
                   "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 "
                   "--moe-router-group-topk 1 --moe-router-num-groups 1 --moe-grouped-gemm "
                   "--moe-router-topk-scaling-factor 2.446 --moe-token-drop-policy probs --moe-router-dtype fp32 "
                   "--moe-permute-fusion").split()


SLIME_MODEL_ARGS = {"GLM-4.5": SLIME_GLM45, "Moonlight-16B-A3B": SLIME_MOONLIGHT}


def slime_dry_run(capsys, tmp_path, name: str, model_args: list[str]) -> tuple[int, str]:
    """--dry-run of the released shape `name` (config.json alone) with slime's MODEL_ARGS `model_args`."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[name]))
    code = main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={tmp_path}", *LAYOUT,
                 *LAYOUTS[name], *model_args])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("name", sorted(SLIME_MODEL_ARGS))
def test_slimes_model_flags_as_written_plan_against_their_config_json(tmp_path, capsys, name):
    assert slime_dry_run(capsys, tmp_path, name, SLIME_MODEL_ARGS[name]) == (0, "")


@pytest.mark.parametrize("name, flag, value, field, implied", [
    ("GLM-4.5", "--moe-router-topk-scaling-factor", "1.0", "moe_router_topk_scaling_factor", "2.5"),
    ("GLM-4.5", "--moe-shared-expert-intermediate-size", "3072", "moe_shared_expert_intermediate_size", "1536"),
    ("GLM-4.5", "--rotary-percent", "1.0", "partial_rotary_factor", "0.5"),
    ("Moonlight-16B-A3B", "--kv-lora-rank", "256", "kv_lora_rank", "512"),
    ("Moonlight-16B-A3B", "--qk-pos-emb-head-dim", "32", "qk_pos_emb_head_dim", "64"),
    ("Moonlight-16B-A3B", "--moe-router-topk-scaling-factor", "2.5", "moe_router_topk_scaling_factor", "2.446"),
])
def test_a_slime_model_flag_that_config_json_contradicts_is_refused_naming_both(tmp_path, capsys, name, flag, value,
                                                                                  field, implied):
    args = list(SLIME_MODEL_ARGS[name])
    args[args.index(flag) + 1] = value
    code, err = slime_dry_run(capsys, tmp_path, name, args)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{flag} {value}" in err and field in err and implied in err, err


def test_an_mla_flag_given_for_a_model_without_mla_is_refused(tmp_path, capsys):
    code, err = slime_dry_run(capsys, tmp_path, "GLM-4.5", [*SLIME_GLM45, "--q-lora-rank", "1536"])
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--q-lora-rank is a field of multi-latent attention" in err and "glm4_moe" in err, err


def test_a_tp_size_that_splits_mlas_latent_widths_unevenly_is_refused_by_the_dry_run(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "ds", "deepseek_v3", kv_lora_rank=15)  # 15 + qk_rope_head_dim 8 = 23
    capsys.readouterr()
    code = main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={path}",
                 "--tensor-model-parallel-size", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "must divide multi-latent attention's kv_lora_rank + qk_rope_head_dim=23" in err, err


# slime's MODEL_ARGS for GLM-4-9B (scripts/models/glm4-9B.sh), its layer spec plugin included
SLIME_GLM4_9B = ("--spec slime_plugins.models.glm4 get_glm_spec --swiglu --num-layers 40 --hidden-size 4096 "
                 "--ffn-hidden-size 13696 --num-attention-heads 32 --group-query-attention --num-query-groups 2 "
                 "--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm "
                 "--norm-epsilon 1e-5 --rotary-base 10000 --vocab-size 151552 --post-self-attn-layernorm "
                 "--post-mlp-layernorm --rotary-interleaved --rotary-percent 0.5 --no-rope-fusion "
                 "--untie-embeddings-and-output-weights").split()


def test_slimes_glm4_9b_flags_as_written_plan_and_post_norms_on_another_family_are_refused(tmp_path, capsys):
    (tmp_path / "glm4").mkdir()
    (tmp_path / "glm4" / "config.json").write_text(json.dumps(RELEASED["GLM-4-9B-0414"]))
    common = ["--dry-run", "--config", "examples/configs/demo.yaml", *LAYOUT, *LAYOUTS["GLM-4-9B-0414"]]
    assert main([*common, f"model.path={tmp_path / 'glm4'}", *SLIME_GLM4_9B]) == 0, capsys.readouterr().err
    capsys.readouterr()
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(RELEASED["Llama-3.1-8B"]))
    assert main([*common, f"model.path={tmp_path / 'llama'}", "--post-mlp-layernorm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--post-mlp-layernorm does not match" in err and len(err.splitlines()) == 1, err


def test_a_kimi_k2_config_json_reads_as_deepseek_v3_though_transformers_has_no_kimi_k2_class(tmp_path):
    from glue.trainer.model import read_hf_config

    kimi = {**RELEASED["Moonlight-16B-A3B"], "model_type": "kimi_k2", "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(kimi))
    config = read_hf_config(str(tmp_path))
    assert family_of(config).name == "deepseek_v3"
    assert (config.n_routed_experts, config.kv_lora_rank, config.q_lora_rank) == (64, 512, None)


@pytest.mark.slow
@pytest.mark.long  # a whole run and export (~30 s); the plan's MTP line and count stay in CI (released shapes)
def test_glm45s_mtp_layer_is_kept_frozen_said_in_the_plan_and_copied_into_the_export(tmp_path, capsys):
    """A GLM-4.5-shaped checkpoint with one MTP layer after its decoder layers (num_nextn_predict_layers: 1, as
    GLM-4.5 ships): --dry-run says it is kept frozen; a run trains the rest, and its exported HF directory holds the
    MTP tensors bit for bit as loaded, beside trained weights that changed."""
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(tmp_path / "glm", "glm4_moe", num_nextn_predict_layers=1)
    config = json.loads((tmp_path / "glm" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
    state = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(3)
    mtp = {f"model.layers.2.{name}": torch.randn(shape, generator=gen) for name, shape in (
        ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
        ("self_attn.q_proj.weight", (64, 64)), ("shared_head.norm.weight", (64,)))}
    save_file({**state, **mtp}, f"{path}/model.safetensors", metadata={"format": "pt"})

    capsys.readouterr()
    assert main(["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={path}"]) == 0
    assert ("1 multi-token-prediction layer(s) (model.layers.2) kept frozen: not trained or synced, copied unchanged "
            "into every export") in capsys.readouterr().out
    records = short_run(tmp_path, "glm_mtp", [f"model.path={path}"])
    assert [r["step"] for r in records] == [1, 2, 3]
    exported = load_file(str(tmp_path / "glm_mtp" / "hf" / "model.safetensors"))
    assert set(exported) == set(state) | set(mtp)
    assert all(torch.equal(exported[name], t) for name, t in mtp.items())
    assert not torch.equal(exported["model.layers.1.self_attn.q_proj.weight"], state["model.layers.1.self_attn.q_proj.weight"])
