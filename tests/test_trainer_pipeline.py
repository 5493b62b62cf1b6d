"""Pipeline parallelism on CPU/gloo, for real (spawned ranks): the layers split into stages, activations passed
between them by megatron's 1F1B schedule, must give the same train step as one rank — the same loss, gradient
norm, logprobs before and after, and gathered HF weights (every stage's, assembled on rank 0)."""
from __future__ import annotations

import json
import os

import pytest

from glue.embedded_engine.tiny_model import save_tiny_model
from glue.trainer.config import TrainerConfig
from helpers.trainer import ADAM, assert_same_step, make_batch, run_trainer_ranks


def test_pipeline_parallelism_is_accepted_but_context_parallelism_says_what_it_would_take():
    assert TrainerConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2).world_size == 4
    assert TrainerConfig(pipeline_model_parallel_size=2).unsupported() == []
    (note,) = TrainerConfig(context_parallel_size=2).unsupported()
    assert "Transformer-Engine" in note and "2 x CP" in note and "--context-parallel-size 1" in note
    (note,) = TrainerConfig(pipeline_model_parallel_size=2,
                            megatron={"virtual_pipeline_model_parallel_size": 2}).unsupported()
    assert "non-interleaved" in note


def save_tied_model(path: str) -> str:
    """The tiny Qwen2 with its output layer tied to the embedding (as Qwen2-0.5B): under PP the last stage holds a
    copy of the embedding whose gradient must be summed with the first stage's."""
    save_tiny_model(path, family="qwen2", seed=3)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["tie_word_embeddings"] = True  # the saved lm_head is ignored: the converter takes the embedding
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.slow
def test_two_pipeline_stages_with_tied_embeddings_and_packed_rows_train_exactly_like_one_rank(tmp_path):
    # one layer per stage; packed rows of at most 48 tokens give micro-batches of 48 and 24 tokens, whose shapes
    # the stages exchange before each activation
    model = save_tied_model(str(tmp_path / "tied"))
    batch = make_batch()
    one = run_trainer_ranks(model, 1, batch, **ADAM, max_tokens_per_micro_batch=48)
    two = run_trainer_ranks(model, 1, batch, **ADAM, max_tokens_per_micro_batch=48, pipeline_model_parallel_size=2)
    assert "lm_head.weight" not in one["weights"], "the check needs a tied model"
    assert_same_step(one, two, "PP=2, tied embeddings, packed")


@pytest.mark.slow
def test_pipeline_tensor_and_expert_parallelism_together_train_exactly_like_one_rank(tmp_path):
    # PP=2 x TP=2 (sequence parallel) with the experts over EP=2 (expert TP=1) inside each stage: the dense shards,
    # the expert shards and the two stages all come back to rank 0 when the HF weights are gathered
    model = save_tiny_model(str(tmp_path / "moe"), family="qwen3_moe", seed=3)
    batch = make_batch()
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    four = run_trainer_ranks(model, 2, batch, **ADAM, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                             expert_tensor_parallel_size=1, megatron={"sequence_parallel": True})
    assert_same_step(one, four, "PP=2 x TP=2 x EP=2")


@pytest.mark.slow
def test_an_uneven_split_of_one_and_two_layers_trains_exactly_like_one_rank(tmp_path):
    # --decoder-first-pipeline-num-layers 1 on a 3-layer model: stage 0 holds layer 0, stage 1 layers 1-2; the
    # gathered HF weights put each stage's layers back at their global numbers
    model = save_tiny_model(str(tmp_path / "three"), family="qwen3", num_layers=3, seed=5)
    batch = make_batch()
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    two = run_trainer_ranks(model, 1, batch, **ADAM, pipeline_model_parallel_size=2,
                            megatron={"num_layers_in_first_pipeline_stage": 1})
    assert "model.layers.2.mlp.down_proj.weight" in one["weights"]
    assert_same_step(one, two, "PP=2 as 1 + 2 layers")
