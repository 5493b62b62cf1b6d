"""Memory per GPU in the plan (launch.plan.memory, launch.plan.memory_lines): a trainer rank's training state as `--dry-run`
counts it from config.json matches what a real trainer worker holds (`training_state_bytes`, megatron-core on gloo)
within 5 % at two layouts; the Qwen3-30B-A3B recipe's figure worked by hand; a layout whose training state exceeds
cluster.gpu_memory_gb refused with one that fits; the engines' weights and KV pool."""
from __future__ import annotations

import json
import pickle

import pytest
import yaml

from glue.trainer.config import TrainerConfig
from helpers.trainer import _free_port, make_batch, results_of_ranks
from launch.cli import main
from launch.config import ModelConfig, SluiceConfig
from launch.plan.memory import trainer_memory
from loss import LossConfig
from helpers.forkserver import rank_context

DEMO = "examples/configs/demo.yaml"


def _state_main(rank: int, world: int, port: int, model: str, cfg: TrainerConfig, loss_cfg: LossConfig,
                results) -> None:
    """One trainer rank: built, one step trained (Adam's moments exist from the first step on), its state counted."""
    from glue.trainer.worker import TrainerWorker

    worker = TrainerWorker(model_path=model, cfg=cfg, loss_cfg=loss_cfg, rank=rank, world_size=world)
    worker.initialize("127.0.0.1", port)
    worker.train_step(make_batch())
    counted = worker.training_state_bytes()
    worker.shutdown()
    results.put(pickle.dumps((rank, counted)))


def measured_state_bytes(model: str, cfg: TrainerConfig, loss_cfg: LossConfig) -> dict[int, int]:
    """`training_state_bytes()` of every rank of a real trainer of `cfg`'s layout, in spawned processes."""
    ctx = rank_context()
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_state_main, args=(r, cfg.world_size, port, model, cfg, loss_cfg, results))
             for r in range(cfg.world_size)]
    return {rank: out[0] for rank, out in results_of_ranks(procs, results).items()}


@pytest.mark.parametrize("family, layout, loss", [
    # one rank, bf16: weights, gradient buffer, main weights, moments, and a critic with all of its own
    ("qwen3", {"data_parallel_size": 1}, {"advantage_estimator": "gae"}),
    # two ranks, bf16, experts over EP=2: the distributed optimizer shards the dense state over DP=2 and leaves the
    # experts' whole (expert-DP = 1); a reference model for the KL term
    ("qwen3_moe", {"data_parallel_size": 2, "expert_model_parallel_size": 2}, {"kl_loss_coef": 0.1}),
    # one rank, bf16, --optimizer-cpu-offload: main weights and moments in host memory, out of the device state
    ("qwen3", {"data_parallel_size": 1, "megatron": {"optimizer_cpu_offload": True}}, {}),
], ids=["tp1-dp1-critic", "dp2-ep2-reference", "tp1-dp1-offload"])
def test_the_planned_training_state_matches_the_trainers_own_count(tmp_path, family, layout, loss):
    from glue.embedded_engine.tiny_model import save_tiny_model

    # wide enough that megatron's buffer padding (64 elements per parameter) stays far below 5 %
    shape = dict(vocab_size=512, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512) \
        if family == "qwen3" else dict(vocab_size=256, hidden_size=128, num_heads=4, num_kv_heads=2,
                                       intermediate_size=256)
    model = save_tiny_model(str(tmp_path / family), family=family, **shape)
    trainer = TrainerConfig(precision="bf16", micro_batch_size=3, lr=1e-3, num_cpus_per_worker=1, **layout)
    loss_cfg = LossConfig(**loss)
    planned = trainer_memory(SluiceConfig(model=ModelConfig(path=model), trainer=trainer, loss=loss_cfg))
    assert len(planned) == 1  # one pipeline stage
    measured = measured_state_bytes(model, trainer, loss_cfg)
    for rank, counted in measured.items():
        assert abs(planned[0].total - counted) <= 0.05 * counted, (rank, planned[0], counted)
    assert (planned[0].critic is not None) == (loss == {"advantage_estimator": "gae"})
    assert (planned[0].reference > 0) == ("kl_loss_coef" in loss)
    policy = planned[0].policy
    assert (policy.main_weights + policy.adam_moments == 0) == ("megatron" in layout)


def qwen3_30b_a3b(tmp_path) -> str:
    """A plan-only directory: Qwen3-30B-A3B's config.json and nothing else."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
              "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 151936,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "torch_dtype": "bfloat16", "attention_bias": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


# the recipe (examples/configs/qwen3_30b_a3b.yaml): two nodes of 8, engines 2 x TP4, trainer TP4 x DP2 x EP8, ETP1
RECIPE = ["cluster.gpus_per_node=8", "cluster.num_nodes=2", "cluster.engine_tensor_parallel_size=4",
          "run.ray_address=auto", "--tensor-model-parallel-size", "4", "--sequence-parallel",
          "--expert-tensor-parallel-size", "1", "trainer.data_parallel_size=2"]


def test_the_30b_a3b_recipe_holds_70_gb_per_trainer_rank_worked_by_hand(capsys, tmp_path):
    h, layers, vocab, experts = 2048, 48, 151936, 128
    attention = h * 128 * (2 * 32 + 2 * 4)  # q, k, v, o: split over TP
    whole = 2 * 128 + 2 * h + experts * h  # q/k norms, two layer norms, the router: whole on every TP rank
    expert_mlp = experts * 3 * h * 768  # gate, up, down of every expert: split over EP x ETP = 8
    dense = layers * attention // 4 + layers * whole + 2 * vocab * h // 4 + h  # + embedding, lm_head, final norm
    sharded = layers * expert_mlp // 8
    assert dense + sharded == 4_018_747_392  # the "~4.0 B per rank" of slime's recipe
    # bf16 weights + fp32 gradients; fp32 main weights and moments sharded over DP=2 (dense), expert-DP=1 (experts)
    total = 2 * (dense + sharded) + 4 * (dense + sharded) + 12 * (dense // 2 + sharded)
    assert total == 69_968_240_640
    assert main(["--dry-run", "--config", DEMO, f"model.path={qwen3_30b_a3b(tmp_path)}", *RECIPE,
                 "--expert-model-parallel-size", "8"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    memory = shown["plan"]["memory"]
    assert memory["trainer"] == [
        "every rank: 4,018,747,392 parameters (TP4 x PP1 x DP2, EP8 x ETP1): weights 8.037 GB (bf16) + gradients "
        "16.07 GB (fp32) + main weights 15.29 GB + Adam moments 30.57 GB (fp32, sharded over DP x CP = 2 and "
        "expert-DP = 1) = 69.97 GB of 80 GB"]
    # trainer.max_tokens_per_micro_batch auto: per 1k tokens, and what the trainer's own sizing would pick
    assert memory["activations"].startswith("about 1.381 GB per 1k tokens of a micro-batch (no recompute")
    assert "auto: sized at start from the memory left: about 3,584 tokens in the 10.03 GB" in memory["activations"]
    # the check counts one micro-batch of the longest sample on top: the demo task's 4 tokens x 1.381 MB
    assert ("memory: a trainer rank holds 69.97 GB of training state + about 5.523 MB of activations for a "
            "micro-batch of 4 tokens of 80 GB per GPU") in " ".join(shown["checked"])


def test_an_uneven_pipeline_split_plans_each_stages_own_layers_and_the_larger_one_sets_the_memory(capsys, tmp_path):
    # the recipe at PP=2 on 3 nodes with --decoder-first-pipeline-num-layers 20: stage 0 holds layers 0-19 and the
    # embedding, stage 1 layers 20-47, the final norm and lm_head
    h, vocab = 2048, 151936
    dense_layer = h * 128 * (2 * 32 + 2 * 4) // 4 + (2 * 128 + 2 * h + 128 * h)  # attention over TP 4; norms, router
    experts_layer = 128 * 3 * h * 768 // 8  # over EP x ETP = 8
    first = (20 * dense_layer + vocab * h // 4, 20 * experts_layer)
    last = (28 * dense_layer + vocab * h // 4 + h, 28 * experts_layer)
    assert sum(first) == 1_687_442_432 and sum(last) == 2_331_304_960
    # bf16 weights, fp32 gradients; main weights and moments sharded over DP=2 (dense) and expert-DP=1 (experts)
    state = [6 * (d + e) + 12 * (d // 2 + e) for d, e in (first, last)]
    assert state == [29_309_005_824, 40_659_234_816]
    assert main(["--dry-run", "--config", DEMO, f"model.path={qwen3_30b_a3b(tmp_path)}", *RECIPE,
                 "cluster.num_nodes=3", "--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
                 "--decoder-first-pipeline-num-layers", "20"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    stage0, stage1 = shown["plan"]["memory"]["trainer"]
    assert stage0.startswith("stage 0 (layers 0-19) ranks 0-7: 1,687,442,432 parameters (TP4 x PP2 x DP2, EP8 x ETP1)")
    assert stage0.endswith("= 29.31 GB of 80 GB")
    assert stage1.startswith("stage 1 (layers 20-47) ranks 8-15: 2,331,304,960 parameters")
    assert stage1.endswith("= 40.66 GB of 80 GB")
    assert "memory: a trainer rank holds 40.66 GB of training state" in " ".join(shown["checked"])
    # the activations are counted over the larger stage's 28 layers
    assert "the largest stage's 28 layers" in shown["plan"]["memory"]["activations"]
    # 4 stages of 48 layers with 20 on the first leave 28 for 3: refused in one line
    assert main(["--dry-run", "--config", DEMO, f"model.path={qwen3_30b_a3b(tmp_path)}", *RECIPE,
                 "cluster.num_nodes=5", "--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
                 "--decoder-first-pipeline-num-layers", "20"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sluice: config error: num_layers_in_first_pipeline_stage=20 leaves 28 of num_layers=48 for 3 middle "
        "pipeline stages, which megatron-core splits evenly and 28 does not divide by 3; choose values that leave a "
        "multiple of 3")


def test_optimizer_offload_puts_the_30b_a3b_recipes_main_weights_and_moments_in_host_memory(capsys, tmp_path):
    dense, experts = 394_868_736, 3_623_878_656  # a rank's parameters (worked in the test above)
    owned = dense // 2 + experts  # what its optimizer state covers: dense sharded over DP=2, experts over expert-DP=1
    # on the GPU bf16 weights + fp32 gradients, in host memory fp32 main weights + two fp32 moments
    assert 6 * (dense + experts) == 24_112_484_352 and 12 * owned == 45_855_756_288
    assert main(["--dry-run", "--config", DEMO, f"model.path={qwen3_30b_a3b(tmp_path)}", *RECIPE,
                 "--expert-model-parallel-size", "8", "--optimizer-cpu-offload"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["plan"]["memory"]["trainer"] == [
        "every rank: 4,018,747,392 parameters (TP4 x PP1 x DP2, EP8 x ETP1): weights 8.037 GB (bf16) + gradients "
        "16.07 GB (fp32) + main weights 0 B + Adam moments 0 B (fp32, sharded over DP x CP = 2 and expert-DP = 1) = "
        "24.11 GB of 80 GB; in host memory besides: 100% of the main weights and Adam moments, 45.86 GB "
        "(--optimizer-cpu-offload)"]
    assert "memory: a trainer rank holds 24.11 GB of training state" in " ".join(shown["checked"])


def test_a_layout_whose_training_state_exceeds_the_gpu_is_refused_with_one_that_fits(capsys, tmp_path):
    model = f"model.path={qwen3_30b_a3b(tmp_path)}"
    # EP=4 at DP=2: each rank holds twice the experts, whose state expert-DP = 2 then shards
    assert main(["--dry-run", "--config", DEMO, model, *RECIPE, "--expert-model-parallel-size", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "sluice: config error: a trainer rank (TP4 x PP1 x DP2, EP4 x ETP1) would hold 91.71 GB of training state "
        "for its 7,642,626,048 parameters (weights 15.29 GB + gradients 30.57 GB + main weights 15.29 GB + Adam "
        "moments 30.57 GB), more than cluster.gpu_memory_gb=80 before any activations; --expert-model-parallel-size 8 "
        "would fit (TP4 x PP1 x DP2, EP8 x ETP1 on 8 GPUs: 69.97 GB per rank)")
    # the recipe's layout on 40 GB GPUs: no layout of 8 GPUs holds it on the GPUs, the optimizer state offloaded
    # to host memory does (weights 2 + gradients 4 bytes per parameter = 24.11 GB)
    assert main(["--dry-run", "--config", DEMO, model, *RECIPE, "--expert-model-parallel-size", "8",
                 "cluster.gpu_memory_gb=40"]) == 2
    line = capsys.readouterr().err.strip()
    assert "would hold 69.97 GB of training state" in line and "more than cluster.gpu_memory_gb=40" in line
    assert line.endswith("; --optimizer-cpu-offload would fit (TP4 x PP1 x DP2, EP8 x ETP1 on 8 GPUs: 24.11 GB per "
                         "rank)"), line
    # half of it offloaded is not enough there; all of it is
    assert main(["--dry-run", "--config", DEMO, model, *RECIPE, "--expert-model-parallel-size", "8",
                 "cluster.gpu_memory_gb=40", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]) == 2
    line = capsys.readouterr().err.strip()
    assert "would hold 47.04 GB of training state" in line
    assert line.endswith("; --optimizer-offload-fraction 1 would fit (TP4 x PP1 x DP2, EP8 x ETP1 on 8 GPUs: 24.11 GB "
                         "per rank)"), line
    # on 20 GB GPUs more GPUs are needed as well: the fewest that hold it are named
    assert main(["--dry-run", "--config", DEMO, model, *RECIPE, "--expert-model-parallel-size", "8",
                 "cluster.gpu_memory_gb=20"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "; --pipeline-model-parallel-size 2 --optimizer-cpu-offload would fit (TP4 x PP2 x DP2, EP8 x ETP1 on 16 GPUs: "
        "12.06 GB per rank)")
    # a CPU run is not checked: there is no GPU to exceed
    assert main(["--dry-run", "--config", DEMO, model]) == 0
    assert "(a CPU run: not checked)" in " ".join(yaml.safe_load(capsys.readouterr().out)["checked"])


def test_each_engine_holds_its_weights_over_engine_tp_and_the_kv_pool_the_fraction_leaves(capsys, tmp_path):
    model = f"model.path={qwen3_30b_a3b(tmp_path)}"
    argv = ["--dry-run", "--config", DEMO, model, *RECIPE, "--expert-model-parallel-size", "8"]
    assert main([*argv, "--sglang-mem-fraction-static", "0.8"]) == 0
    weights = 30_532_122_624 * 2 // 4  # every parameter at bf16, over engine TP 4: 15.27 GB
    assert round(0.8 * 80e9 - weights) == 48_733_938_688  # 0.8 x the GPU - the weights
    assert yaml.safe_load(capsys.readouterr().out)["plan"]["memory"]["engines"] == (
        "each of 2 engines, on each of its 4 GPUs: weights 15.27 GB (30,532,122,624 parameters / TP 4) + KV pool "
        "48.73 GB (mem_fraction_static x 80 GB - weights; sglang.mem_fraction_static 0.8)")
    # unset, SGLang sizes it at start and keeps at least 10 GiB of a GPU over 60 GiB back: the pool's ceiling
    assert main(argv) == 0
    engines = yaml.safe_load(capsys.readouterr().out)["plan"]["memory"]["engines"]
    assert "KV pool 54 GB" in engines and "keeping at least 10.74 GB back, so at most 0.866" in engines
    # engine TP 1: the 61 GB of weights leave 0.8 x 80 GB - 61 GB = 2.9 GB; at a fraction of 0.7 nothing: refused
    assert main([*argv, "cluster.engine_tensor_parallel_size=1", "rollout.num_engines=8",
                 "--sglang-mem-fraction-static", "0.7"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sluice: config error: an engine's weights take 61.06 GB per GPU (engine TP 1), which leaves no KV pool "
        "(sglang.mem_fraction_static 0.7, x cluster.gpu_memory_gb=80); raise cluster.engine_tensor_parallel_size "
        "or sglang.mem_fraction_static")


def qwen3_8b(tmp_path) -> str:
    """A plan-only directory: Qwen3-8B's config.json (the released shape) and a one-row data file for the recipe."""
    from helpers.slime_scripts import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["strands_qwen3_8b.sh"]))
    (tmp_path / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    return str(tmp_path)


def test_qwen3_8b_at_tp1_dp4_is_refused_because_its_longest_sample_cannot_fit_beside_the_training_state(capsys, tmp_path):
    # the qwen3_8b recipe (samples up to 1,024 prompt + 1,024 response tokens) at TP1 x DP4 on 80 GB GPUs
    model = qwen3_8b(tmp_path)
    recipe = ["--config", "examples/configs/qwen3_8b.yaml", f"model.path={model}",
              f"rollout.task_args.path={model}/train.jsonl", f"eval.task_args.path={model}/train.jsonl"]
    tp1 = ["--tensor-model-parallel-size", "1", "trainer.data_parallel_size=4"]
    # per token and layer 2 x (10 x 4096 + 5 x 12288) bytes over 36 layers, + 4 x 151,936 for the logits and their
    # gradient: 7,980,544 bytes; a 2,048-token sample 16.34 GB beside 73.72 GB of state is more than 80 GB
    per_token = 36 * 2 * (10 * 4096 + 5 * 12288) + 4 * 151936
    assert per_token == 7_980_544 and 2048 * per_token == 16_344_154_112
    assert main(["--dry-run", *recipe, *tp1]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "sluice: config error: trainer.max_tokens_per_micro_batch auto cannot fit the longest sample at all: 2,048 "
        "tokens (rollout.task_args.max_prompt_tokens 1024 + rollout.sampling.max_new_tokens 1024) needs about 16.34 GB "
        "of activations on a trainer rank (TP1 x PP1 x DP4; 7.981 GB per 1k tokens, no recompute: every layer's "
        "activations), and its training state takes 73.72 GB: 90.06 GB, more than the 80 GB of "
        "cluster.gpu_memory_gb=80; --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
        "would fit (about 2.268 GB of activations); or shorter samples, or a larger TP / PP (or "
        "--optimizer-cpu-offload) to leave more of the GPU")
    # a fixed budget wider than the sample is refused with its own figures
    assert main(["--dry-run", *recipe, *tp1, "trainer.max_tokens_per_micro_batch=4096"]) == 2
    assert "a micro-batch of 4,096 tokens (trainer.max_tokens_per_micro_batch=4096) needs about 32.69 GB" in \
        capsys.readouterr().err
    # with full recompute it fits, and auto goes below 1,024 tokens: 6.283 GB free x 0.5 / 7,980,544 = 393 -> 256
    assert main(["--dry-run", *recipe, *tp1, "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["plan"]["memory"]["activations"].endswith(
        "about 256 tokens in the 6.283 GB the training state leaves; a longer sample (up to 2,048 tokens) gets a row "
        "of its own")
    # the recipe's own layout (TP4) fits with room to spare
    assert main(["--dry-run", *recipe]) == 0
    assert "training state + about 4.086 GB of activations for a micro-batch of 2,048 tokens" in \
        " ".join(yaml.safe_load(capsys.readouterr().out)["checked"])
