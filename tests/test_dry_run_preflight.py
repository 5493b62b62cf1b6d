"""`--dry-run` catches what step 1 would have: a missing data file, MoE with TP and no sequence parallelism, empty or
cut-short weight files, no tokenizer for a text task; each is one line and exit 2, and a real start refuses the same
before it starts anything. A directory with config.json alone plans a run (bytes per sync, weight group) without
its weights; the tiny MoE's experts and top-k are config keys."""
import json

import pytest
import yaml

from launch.cli import main

DEMO = "examples/configs/demo.yaml"
TEXT_TASK = ["rollout.task=rollout_fns.text_data:TextDataTask", "rollout.task_args.prompt_key=problem"]
TINY_TEXT = ["model.tiny.tokenizer=true", "model.tiny.vocab_size=272"]


def one_line_error(capsys, argv: list[str], *, dry_run: bool = True) -> str:
    assert main([*(["--dry-run"] if dry_run else []), "--config", DEMO, *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice: config error: "), captured.err
    assert captured.out == ""
    return lines[0]


def passes(capsys, argv: list[str]) -> dict:
    assert main(["--dry-run", "--config", DEMO, *argv]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
    return str(path)


@pytest.fixture
def tiny_dir(tmp_path, capsys):
    from glue.embedded_engine.tiny_model import save_tiny_model

    path = save_tiny_model(str(tmp_path / "tiny"))
    capsys.readouterr()  # save_pretrained's progress bar
    return path


def test_dry_run_refuses_a_data_file_that_does_not_exist_for_the_task_or_the_eval(capsys, tmp_path, rows):
    missing = str(tmp_path / "train.jsonl")
    line = one_line_error(capsys, [*TEXT_TASK, *TINY_TEXT, f"rollout.task_args.path={missing}"])
    assert line == (f"sluice: config error: rollout.task_args.path={missing!r}: no such file; "
                    "rollout_fns.text_data:TextDataTask reads it at start-up, so point it at an existing local data "
                    "file")
    line = one_line_error(capsys, [*TEXT_TASK, *TINY_TEXT, f"rollout.task_args.path={rows}", "eval.interval=5",
                                   f"eval.task_args.path={tmp_path / 'test.jsonl'}"])
    assert f"eval.task_args.path={str(tmp_path / 'test.jsonl')!r}: no such file" in line
    checked = passes(capsys, [*TEXT_TASK, *TINY_TEXT, f"rollout.task_args.path={rows}", "eval.interval=5"])["checked"]
    assert f"data: {rows} found" in checked


def test_a_task_that_writes_its_data_file_is_not_refused_for_its_absence(capsys, tmp_path):
    assert main(["--dry-run", "--config", "examples/configs/text_arith.yaml", f"run.output_dir={tmp_path}",
                 f"rollout.task_args.path={tmp_path / 'new.jsonl'}"]) == 0, capsys.readouterr().err
    assert not (tmp_path / "new.jsonl").exists()  # the dry run wrote nothing


def test_dry_run_refuses_moe_with_tensor_parallelism_and_no_sequence_parallelism(capsys):
    moe_tp2 = ["model.tiny.family=qwen3_moe", "--tensor-model-parallel-size", "2"]
    line = one_line_error(capsys, moe_tp2)
    assert line == ("sluice: config error: trainer.tensor_model_parallel_size=2 with a mixture-of-experts model (4 "
                    "experts) needs sequence parallelism, which megatron-core requires to train MoE layers with "
                    "TP > 1: add --sequence-parallel (trainer.megatron.sequence_parallel: true)")
    passes(capsys, [*moe_tp2, "--sequence-parallel"])
    passes(capsys, ["--tensor-model-parallel-size", "2"])  # a dense model needs no sequence parallelism


def test_the_moe_rule_is_still_megatron_cores():
    """The check mirrors megatron-core 0.16's MoELayer.forward; when megatron drops its rule, drop ours."""
    import inspect

    from megatron.core.transformer.moe.moe_layer import MoELayer

    source = inspect.getsource(MoELayer.forward)
    assert "self.attn_tp_group.size() > 1 and not self.config.sequence_parallel" in source


def test_dry_run_refuses_an_expert_parallel_size_the_experts_do_not_split_into(capsys):
    line = one_line_error(capsys, ["model.tiny.family=qwen3_moe", "model.tiny.num_experts=6",
                                   "--expert-model-parallel-size", "4", "trainer.data_parallel_size=4"])
    assert "trainer.expert_model_parallel_size=4 must divide the model's 6 experts" in line


def test_dry_run_refuses_an_empty_or_cut_short_weight_file(capsys, tiny_dir):
    weights = f"{tiny_dir}/model.safetensors"
    passes(capsys, [f"model.path={tiny_dir}"])
    with open(weights, "rb") as f:
        whole = f.read()
    open(weights, "wb").close()
    line = one_line_error(capsys, [f"model.path={tiny_dir}"])
    assert line == (f"sluice: config error: model.path {tiny_dir!r}: weight file model.safetensors is 0 bytes: a "
                    "download or copy that did not finish; fetch the checkpoint's weights again")
    with open(weights, "wb") as f:
        f.write(whole[: len(whole) // 2])
    line = one_line_error(capsys, [f"model.path={tiny_dir}"])
    assert f"model.safetensors is cut short ({len(whole) // 2} bytes; its header describes {len(whole)})" in line


def test_dry_run_refuses_a_shard_the_index_names_but_the_directory_lacks(capsys, tiny_dir):
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
                                            "model.norm.weight": "model.safetensors"}}
    with open(f"{tiny_dir}/model.safetensors.index.json", "w") as f:
        json.dump(index, f)
    line = one_line_error(capsys, [f"model.path={tiny_dir}"])
    assert ("model.safetensors.index.json names 2 weight files and 1 of them are not there "
            "(model-00002-of-00002.safetensors, ...): copy the whole checkpoint") in line


def test_dry_run_refuses_a_text_task_whose_model_has_no_tokenizer(capsys, tiny_dir, rows, text_model_dir):
    line = one_line_error(capsys, [*TEXT_TASK, f"rollout.task_args.path={rows}", f"model.path={tiny_dir}"])
    assert line == (f"sluice: config error: rollout.task rollout_fns.text_data:TextDataTask loads a tokenizer from "
                    f"{tiny_dir!r}, which holds none of tokenizer.json, tokenizer.model, vocab.json, vocab.txt: copy "
                    "the checkpoint's tokenizer files there")
    line = one_line_error(capsys, [*TEXT_TASK, f"rollout.task_args.path={rows}"])  # the demo's tiny model
    assert line == ("sluice: config error: rollout.task rollout_fns.text_data:TextDataTask loads the model's "
                    "tokenizer, but the tiny model has none: set model.tiny.tokenizer: true (with "
                    "model.tiny.vocab_size >= 260)")
    checked = passes(capsys, [*TEXT_TASK, f"rollout.task_args.path={rows}", f"model.path={text_model_dir}"])["checked"]
    assert f"tokenizer: {text_model_dir} (for rollout.task rollout_fns.text_data:TextDataTask)" in checked


PROBLEMS = {  # what a real start is given -> what its one line says
    "no data file": ([*TEXT_TASK, *TINY_TEXT, "rollout.task_args.path={tmp}/nope.jsonl"], "no such file"),
    "moe tp": (["model.tiny.family=qwen3_moe", "--tensor-model-parallel-size", "2"], "needs sequence parallelism"),
    "empty weights": (["model.path={tiny}"], "weight file model.safetensors is 0 bytes"),
    "no tokenizer": ([*TEXT_TASK, "rollout.task_args.path={rows}", "model.path={tiny}"], "which holds none of"),
    "plan-only": (["model.path={tiny}"], "holds no *.safetensors or *.bin weight files"),
}


@pytest.mark.parametrize("problem", PROBLEMS)
def test_a_real_start_refuses_the_same_before_it_starts_anything(capsys, monkeypatch, tmp_path, tiny_dir, rows,
                                                                    problem):
    import launch.run.runner

    def started(*args, **kwargs):
        raise AssertionError("start-up began: preflight let the problem through")

    monkeypatch.setattr(launch.run.runner, "prepare_model", started)
    monkeypatch.setattr(launch.run.runner, "start_cluster", started)
    if problem == "empty weights":
        open(f"{tiny_dir}/model.safetensors", "wb").close()
    if problem == "plan-only":
        (tmp_path / "tiny" / "model.safetensors").unlink()
    argv, says = PROBLEMS[problem]
    argv = [a.format(tmp=tmp_path, tiny=tiny_dir, rows=rows) for a in argv]
    line = one_line_error(capsys, [*argv, f"run.output_dir={tmp_path / 'runs'}"], dry_run=False)
    assert says in line
    assert not (tmp_path / "runs").exists()


def qwen3_235b_a22b_config() -> dict:
    """Qwen3-235B-A22B's config.json shape numbers."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
            "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
            "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "torch_dtype": "bfloat16", "attention_bias": False}


def test_a_directory_with_config_json_alone_plans_a_235b_run_with_bytes_per_sync_and_weight_groups(capsys, tmp_path):
    c = qwen3_235b_a22b_config()
    (tmp_path / "config.json").write_text(json.dumps(c))
    h, hd, experts = c["hidden_size"], c["head_dim"], c["num_experts"]
    attention = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + 2 * hd  # q, k, v, o, q/k norms
    moe = h * experts + experts * 3 * h * c["moe_intermediate_size"]  # router + gate/up/down of every expert
    count = 2 * c["vocab_size"] * h + h + c["num_hidden_layers"] * (attention + moe + 2 * h)
    assert count == 235_093_634_560  # the "235B" in the name
    layout = ["cluster.gpus_per_node=8", "cluster.num_nodes=4", "cluster.engine_tensor_parallel_size=8",
              "run.ray_address=auto", "--tensor-model-parallel-size", "4", "--sequence-parallel",
              "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
              "trainer.data_parallel_size=4", f"model.path={tmp_path}"]
    # 16 trainer GPUs cannot hold 235B parameters' training state (launch.plan.memory_lines); the refusal names the
    # fewest GPUs that would (32, with the optimizer state in host memory); 64 GPUs hold it without offload
    line = one_line_error(capsys, layout)
    assert "would hold 359 GB of training state" in line, line
    assert line.endswith("--pipeline-model-parallel-size 2 --expert-model-parallel-size 16 --optimizer-cpu-offload "
                         "would fit (TP4 x PP2 x DP4, EP16 x ETP1 on 32 GPUs: 48.69 GB per rank)"), line
    layout += ["cluster.num_nodes=10", "trainer.data_parallel_size=16", "--expert-model-parallel-size", "64"]
    shown = passes(capsys, layout)
    sync = shown["plan"]["weight_sync"]
    assert sync["parameters"].startswith(f"{count:,} (qwen3_moe")
    # a bf16 checkpoint trains in bf16 (trainer.precision: auto), so the bridge sends bf16
    assert sync["bytes_per_sync"].startswith(f"{count * 2:,} = 470.2 GB (2 bytes per parameter: bfloat16")
    assert "470.2 GB at the checkpoint's bfloat16" in sync["bytes_per_sync"]
    # TP 4 x DP 16, EP 64 with expert TP 1: expert-parallel rank e is trainer rank e, so the dense TP group {0-3}
    # holds the leaders of EP ranks 0-3 (one source) and EP ranks 4-63 are sources of their own
    assert sync["sources"].startswith("parallel: 61 sources")
    groups = sync["groups"]
    assert [g["source"] for g in groups] == [f"trainer rank {r}" for r in (0, *range(4, 64))]
    assert [g["group"] for g in groups] == [f"sluice_w_s{k}_<pid>_<n>" for k in range(61)]
    assert [g["producers"] for g in groups] == ["trainer ranks 0-3"] + [f"trainer rank {r}" for r in range(4, 64)]
    # per layer 9 dense tensors (q, k, v, o, q/k norms, router, two norms) and 128 x 3 expert tensors, 2 experts
    # per EP rank; embedding, final norm and output layer once
    dense, per_ep_rank = 94 * 9 + 3, 94 * 2 * 3
    assert [g["tensors"].split(" ")[0] for g in groups] == [f"{dense + 4 * per_ep_rank:,}"] + [f"{per_ep_rank:,}"] * 60
    # engines fill nodes 0-1 first, the trainer nodes 2-9; every engine TP rank is in every group
    assert all(g["world_size"] == 17 for g in groups)
    assert groups[1]["members"] == ["rank 0: trainer rank 4 (node 2 gpu 4)",
                                    "ranks 1-8: engine 0, rank_offset 1 (node 0 gpus 0-7)",
                                    "ranks 9-16: engine 1, rank_offset 9 (node 1 gpus 0-7)"]
    assert "weight groups: 61 (gloo), no two members on one device" in shown["checked"]
    assert len(shown["plan"]["trainer"]) == 64 and len(shown["plan"]["engines"]) == 2
    assert any(line.startswith(f"model: {tmp_path} holds config.json and no weight files: a plan-only directory")
               for line in shown["checked"])
    fp32 = passes(capsys, [*layout, "trainer.precision=fp32"])["plan"]["weight_sync"]
    assert fp32["bytes_per_sync"].startswith(f"{count * 4:,} = 940.4 GB (4 bytes per parameter: float32")


def test_the_planned_sync_bytes_follow_trainer_precision_not_only_the_megatron_flags(capsys):
    """The demo's tiny model is float32: trainer.precision=bf16 trains (and sends) bf16, 2 bytes per parameter."""
    fp32 = passes(capsys, [])["plan"]["weight_sync"]["bytes_per_sync"]
    bf16 = passes(capsys, ["trainer.precision=bf16"])["plan"]["weight_sync"]["bytes_per_sync"]
    assert "(4 bytes per parameter: float32" in fp32 and "(2 bytes per parameter: bfloat16" in bf16
    assert int(fp32.split(" ")[0].replace(",", "")) == 2 * int(bf16.split(" ")[0].replace(",", ""))


def test_help_lists_every_tiny_family_and_the_tiny_moe_keys(capsys):
    from weight_sync.families import FAMILIES

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    family = next(line for line in text.splitlines() if line.startswith("  model.tiny.family  ("))
    assert all(repr(name) in family for name in FAMILIES), family
    assert "  model.tiny.num_experts  (int, default: 4)\n      MoE families: routed experts" in text
    assert "  model.tiny.moe_top_k  (int, default: 2)\n      MoE families: experts each token is routed to" in text


def test_a_tiny_moe_built_with_other_experts_and_top_k_has_them(tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoConfig

    from launch.config import load_config
    from launch.run.folder import prepare_model

    cfg = load_config(DEMO, ["model.tiny.family=qwen3_moe", "model.tiny.num_experts=6", "model.tiny.moe_top_k=3"])
    model = prepare_model(cfg, tmp_path)
    config = AutoConfig.from_pretrained(model)  # transformers 5 writes num_experts as num_local_experts
    assert (config.num_experts, config.num_experts_per_tok) == (6, 3)
    with safe_open(f"{model}/model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.mlp.gate.weight").get_shape() == [6, 64]  # one router row per expert
    capsys.readouterr()
    line = one_line_error(capsys, ["model.tiny.family=qwen3_moe", "model.tiny.moe_top_k=5"])
    assert "model.tiny.moe_top_k in [1, num_experts], got 4 and 5" in line
