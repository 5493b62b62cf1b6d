"""The trainer's data and expert parallelism on CPU/gloo, for real (spawned ranks): splitting the batch over DP ranks,
the experts over EP ranks, or Qwen3's q/k-norm heads over TP ranks must give the same train step as one rank — the
same loss, gradient norm, updated logprobs and gathered HF weights."""
from __future__ import annotations

import pytest
import torch

from glue.embedded_engine.tiny_model import save_tiny_model
from helpers.trainer import ADAM, assert_same_step, make_batch, run_trainer_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def batch():
    return make_batch()


def test_two_data_parallel_ranks_train_exactly_like_one(tmp_path_factory, batch):
    model = save_tiny_model(str(tmp_path_factory.mktemp("qwen2")), family="qwen2", seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    # micro_batch_size 4 on 6 rows: one rank runs 4 + 2 rows, each DP rank a single micro-batch of 3
    two = run_trainer_ranks(model, 1, batch, **ADAM, data_parallel_size=2)
    assert_same_step(one, two, "DP=2")


def test_qwen3_q_and_k_norm_gradients_are_summed_over_tensor_parallel_heads(tmp_path_factory, batch):
    # Each TP rank normalises only its own heads with the shared q/k norm weights: without the TP sum the ranks'
    # copies drift apart and the gradient norm misses half of those weights' gradient.
    model = save_tiny_model(str(tmp_path_factory.mktemp("qwen3")), family="qwen3", seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    two = run_trainer_ranks(model, 2, batch, **ADAM)
    assert any("q_norm" in n for n in one["weights"]), "the check needs a model with q/k norms"
    assert_same_step(one, two, "Qwen3 TP=2")


@pytest.mark.long  # 14 s; expert parallelism stays in CI through the TP x EP and PP x TP x EP tests
def test_experts_split_over_two_expert_parallel_ranks_train_exactly_like_one_rank(tmp_path_factory, batch):
    model = save_tiny_model(str(tmp_path_factory.mktemp("moe")), family="qwen3_moe", seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    # EP=2 over DP=2: each rank holds 2 of the 4 experts, sees half the rows, and the allgather dispatcher moves
    # tokens between the ranks in every forward
    two = run_trainer_ranks(model, 1, batch, **ADAM, data_parallel_size=2, expert_model_parallel_size=2)
    experts = [n for n in one["weights"] if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 3, "every layer's 4 experts (gate, up, down) come back from the EP ranks"
    assert_same_step(one, two, "EP=2 x DP=2")


def test_expert_replicas_sum_their_gradients_and_uneven_shares_keep_every_rank_in_step(tmp_path_factory, batch):
    # 6 rows, micro-batch 1, 4 DP ranks: shares of 1-2 rows, so ranks with one row run a masked padding micro-batch
    # while the others run their second (every forward is a collective across the EP group). EP=2 over DP=4: each
    # expert has two replicas, whose gradients must be summed over the expert-data-parallel group.
    model = save_tiny_model(str(tmp_path_factory.mktemp("moe4")), family="qwen3_moe", seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM, micro_batch_size=1)
    four = run_trainer_ranks(model, 1, batch, **ADAM, micro_batch_size=1, data_parallel_size=4,
                             expert_model_parallel_size=2)
    assert_same_step(one, four, "EP=2 x DP=4, uneven shares")
    assert torch.isfinite(four["after"]).all()


def test_sequence_parallel_splits_an_odd_length_sequence_over_tp_ranks_and_trains_like_one_rank(tmp_path_factory):
    # 11 tokens per row: padded to 12 for TP=2, the padding stripped again; the norms' scale gradients are partial
    # per rank (each normalises half of the sequence) and must be summed over TP.
    batch = make_batch(response_len=6)
    assert batch.tokens.shape[1] % 2 == 1
    model = save_tiny_model(str(tmp_path_factory.mktemp("qwen2_sp")), family="qwen2", seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    two = run_trainer_ranks(model, 2, batch, **ADAM, megatron={"sequence_parallel": True})
    assert_same_step(one, two, "TP=2 with sequence parallelism")


def test_moe_with_tensor_and_expert_parallelism_and_untensored_experts_trains_like_one_rank(tmp_path_factory, batch):
    # The MoE recipe's shape in small: dense layers TP=2 with sequence parallelism (megatron requires it for MoE
    # with TP and EP > 1), experts EP=2 with expert TP=1, so expert shards and dense shards come from different
    # groups when the trainer gathers the HF weights.
    model = save_tiny_model(str(tmp_path_factory.mktemp("moe_tp_ep")), family="qwen3_moe", seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    two = run_trainer_ranks(model, 2, batch, **ADAM, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                            megatron={"sequence_parallel": True})
    assert_same_step(one, two, "TP=2 x EP=2 (ETP=1) with sequence parallelism")


def test_moe_experts_whole_on_each_tp_rank_under_sequence_parallelism_train_like_one_rank(tmp_path_factory, batch):
    # EP=1 with expert TP=1 below TP=2: each TP rank holds every expert whole and routes only its half of the
    # sequence, so the two copies' gradients are partial and must be summed over the expert-data-parallel group
    # (megatron-core marks them for it only at EP > 1); left alone the copies drift apart from the first step
    model = save_tiny_model(str(tmp_path_factory.mktemp("moe_etp1")), family="mixtral", seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    two = run_trainer_ranks(model, 2, batch, **ADAM, expert_tensor_parallel_size=1,
                            megatron={"sequence_parallel": True})
    assert_same_step(one, two, "TP=2 (sequence parallel) with every expert whole on each rank")


def test_packed_rows_under_sequence_parallelism_go_as_thd_and_train_like_one_padded_rank(tmp_path_factory):
    # rows of three 11-token samples (33 tokens, padded to 34 for TP=2 with a trailing padding span of its own) go
    # to the core attention as THD while each TP rank holds half of the row's hidden states
    batch = make_batch(response_len=6)
    model = save_tiny_model(str(tmp_path_factory.mktemp("qwen3_sp_thd")), family="qwen3", seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    two = run_trainer_ranks(model, 2, batch, **ADAM, max_tokens_per_micro_batch=40,
                            megatron={"sequence_parallel": True})
    assert_same_step(one, two, "packed rows, TP=2 with sequence parallelism")


@pytest.mark.long  # two ranks compile at once on two cores; CI keeps the one-rank compile test (test_trainer_attention)
@pytest.mark.parametrize("family, layout", [
    ("qwen3", {"tensor_model_parallel_size": 2, "megatron": {"sequence_parallel": True}}),
    ("qwen3_moe", {"data_parallel_size": 2, "expert_model_parallel_size": 2}),
], ids=["tp2_sequence_parallel", "ep2_moe"])
def test_trainer_compile_over_two_ranks_trains_like_one_eager_rank(tmp_path_factory, family, layout):
    batch = make_batch(response_len=6)
    model = save_tiny_model(str(tmp_path_factory.mktemp(f"{family}_compiled")), family=family, seed=3)
    one = run_trainer_ranks(model, 1, batch, **ADAM)
    layout = {"max_tokens_per_micro_batch": 40, **layout}
    two = run_trainer_ranks(model, layout.pop("tensor_model_parallel_size", 1), batch, **ADAM, **layout, compile=True)
    assert_same_step(one, two, f"trainer.compile, packed rows, {family} {layout}")
