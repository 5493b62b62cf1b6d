"""The megatron-core trainer on CPU, for real: gloo process groups across spawned processes (TP=1 vs TP=2), HF
weights loaded through the converter, and the Ray-actor TrainerGroup the loop drives."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from glue.trainer.config import TrainerConfig
from glue.types import TrainBatch
from loss import LossConfig
from helpers.trainer import (BATCH, ENTROPY_COEF, RESPONSE_LEN, _free_port, hf_teacher_forced_logprobs, make_batch,
                             run_trainer_ranks)


@pytest.fixture(scope="module")
def tp_runs(model_dir) -> dict:
    batch = make_batch()
    return {"batch": batch, 1: run_trainer_ranks(model_dir, 1, batch), 2: run_trainer_ranks(model_dir, 2, batch)}


def _real(batch: TrainBatch) -> torch.Tensor:
    """Positions whose target token t+1 is a real (unpadded) token."""
    positions = torch.arange(batch.tokens.shape[1])
    return positions[None, :] < torch.tensor(batch.seq_lens)[:, None] - 1


def test_megatron_logprobs_at_tp1_equal_the_hf_models_teacher_forced_logprobs(model_dir, tp_runs):
    batch = tp_runs["batch"]
    expected, expected_entropy = hf_teacher_forced_logprobs(model_dir, batch.tokens, with_entropy=True)
    got = tp_runs[1]["before"]
    assert got.shape == batch.tokens.shape
    diff = (got - expected)[_real(batch)].abs().max().item()
    assert diff < 1e-4, f"megatron vs HF logprobs differ by {diff}"
    assert (tp_runs[1]["entropy"] - expected_entropy)[_real(batch)].abs().max().item() < 1e-4
    assert expected[_real(batch)].std() > 0.1, "the check needs logprobs that vary"


def test_tp2_logprobs_and_entropy_equal_tp1s(tp_runs):
    diff = (tp_runs[2]["before"] - tp_runs[1]["before"]).abs().max().item()
    assert diff < 1e-5, f"TP=2 vs TP=1 logprobs differ by {diff}"
    assert (tp_runs[2]["entropy"] - tp_runs[1]["entropy"]).abs().max().item() < 1e-5


def test_tp2_train_step_gives_the_same_loss_grad_norm_and_updated_weights_as_tp1(tp_runs):
    m1, m2 = tp_runs[1]["metrics"], tp_runs[2]["metrics"]
    assert m1["weights/version"] == m2["weights/version"] == 1.0
    assert abs(m1["train/loss"] - m2["train/loss"]) < 1e-6
    assert abs(m1["train/grad_norm"] - m2["train/grad_norm"]) < 1e-5 * max(1.0, m1["train/grad_norm"])
    assert (tp_runs[2]["after"] - tp_runs[1]["after"]).abs().max().item() < 1e-5
    # Adam's first step moves each weight by lr * g / (|g| + eps): where g is at rounding-noise level the two
    # layouts' sums can differ in sign, so weights agree to a small fraction of lr = 1e-2, not to float eps (the
    # fused attention kernel sums over a different number of heads per call at TP=1 and TP=2).
    for name, w1 in tp_runs[1]["weights"].items():
        assert (tp_runs[2]["weights"][name] - w1).abs().max().item() < 2e-2 * 1e-2, name


def test_one_train_step_moves_logprobs_toward_positive_advantages(tp_runs):
    # On-policy first step: ratio = 1, so the policy term -sum(mask * A) / num_tokens is 0 (advantages sum to 0)
    # and the loss is the entropy bonus alone: -ENTROPY_COEF * mean entropy over the trained tokens.
    batch, run = tp_runs["batch"], tp_runs[1]
    assert abs(run["metrics"]["train/loss"] + ENTROPY_COEF * run["metrics"]["train/entropy"]) < 1e-6
    assert run["metrics"]["train/clipfrac"] == 0.0
    mask = batch.logprob_mask.bool()
    change = (run["after"] - run["before"])[mask].reshape(BATCH, RESPONSE_LEN).sum(dim=1)
    assert change[-1] > 0 > change[0], f"row logprob changes {change.tolist()} should rise with the advantage"


@pytest.fixture
def ray_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_trainer_group_of_ray_actors_trains_one_step_and_bumps_the_version(model_dir, ray_cluster):
    from glue.trainer.group import TrainerGroup

    batch = make_batch(rollout_logprobs_from=model_dir)
    cfg = TrainerConfig(tensor_model_parallel_size=2, lr=1e-2, old_logprobs="snapshot")
    group = TrainerGroup(model_dir, cfg, LossConfig(entropy_coef=ENTROPY_COEF), keep_versions=2)
    try:
        before = group.compute_logprobs(batch)
        assert group.version == 0
        metrics = group.train_step(batch)
        assert group.version == 1 and metrics["weights/version"] == 1.0
        # rollout logprobs are the HF model's own, so the train-inference discrepancy is float noise only
        assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
        assert 0 < metrics["train/entropy"] < torch.log(torch.tensor(32.0)).item()
        after = group.compute_logprobs(batch)
        assert (after - before)[batch.logprob_mask.bool()].abs().max() > 1e-3
        # the batch's tokens are version 0: each TP rank's snapshot of its shard gives back the logprobs from before
        old = group.compute_old_logprobs(batch)
        assert torch.equal(old[batch.logprob_mask.bool()], before[batch.logprob_mask.bool()])
        specs = group.hf_weight_specs()
        assert specs[0] == ("model.embed_tokens.weight", "float32", (32, 64))
        assert ("model.layers.0.self_attn.k_proj.bias", "float32", (32,)) in specs  # 2 kv heads x head_dim 16
        weights = group.full_hf_state()
        assert [(n, tuple(t.shape)) for n, t in weights.items()] == [(n, s) for n, _, s in specs]
        received = receive_weights_as_engine_rank(group, specs)
        assert [n for n, _ in received] == [n for n, _, _ in specs]
        for name, tensor in received:
            assert torch.equal(tensor, weights[name]), name
    finally:
        group.shutdown()


def test_a_shut_down_trainer_rank_leaves_no_wandb_staging_folder_in_the_temp_dir(model_dir, ray_cluster):
    """megatron-core's import of wandb makes two staging folders per process that only interpreter exit removes;
    Ray kills trainer actors without one, so each rank used to leave both behind (700 had piled up in /tmp)."""
    import tempfile

    from glue.trainer.group import TrainerGroup

    def staging() -> set[str]:
        return {p.name for p in Path(tempfile.gettempdir()).glob("tmp*wandb-*")}

    before = staging()
    group = TrainerGroup(model_dir, TrainerConfig(), LossConfig())
    try:
        made = staging() - before
        assert any(n.endswith("wandb-media") for n in made) and any(n.endswith("wandb-artifacts") for n in made)
    finally:
        group.shutdown()
    assert not made & staging()


def receive_weights_as_engine_rank(group, specs) -> list:
    """What the weight bridge does with a trainer group as its source, the engine's side played here: open a
    broadcast channel (this process joins as rank 1), stage the weights, and receive every bucket rank 0 sends
    (16 KiB buckets, so there are several), checking each against the checksum the trainer reports."""
    from concurrent.futures import ThreadPoolExecutor

    from weight_sync.broadcast import broadcast_bucket
    from weight_sync.buckets import checksum, plan_buckets, unpack_bucket
    from weight_sync.process_group import create_process_group, destroy_process_group

    port, layouts = _free_port(), plan_buckets(specs, 16 << 10)
    assert len(layouts) > 1
    spec = {"kind": "broadcast", "layouts": [b.to_json() for b in layouts], "with_checksum": True,
            "pipeline": False, "master_address": "127.0.0.1", "master_port": port, "world_size": 2,
            "group_name": "test_weights", "backend": "gloo", "timeout_s": 60}
    received = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        opened = pool.submit(group.open_weight_channel, "test_weights", spec)
        engine_side = create_process_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                                           group_name="test_weights", timeout_s=60)
        opened.result(timeout=60)
        try:
            group.stage_weights()
            for layout in layouts:
                sent = pool.submit(group.send_weight_bucket, "test_weights", layout.index)
                flat = torch.empty(layout.nbytes, dtype=torch.uint8)
                broadcast_bucket(engine_side, flat, src=0)
                assert sent.result(timeout=60)["checksum"] == checksum(flat)
                received += [(name, view.clone()) for name, view in unpack_bucket(layout, flat)]
        finally:
            destroy_process_group(engine_side)
            group.close_weight_channel("test_weights")
    return received


def test_trainer_config_names_the_field_and_the_fix():
    with pytest.raises(ValueError, match="trainer.pipeline_model_parallel_size must be an integer >= 1"):
        TrainerConfig(pipeline_model_parallel_size=0)
    with pytest.raises(ValueError, match="trainer.lr must be > 0"):
        TrainerConfig(lr=0.0)
    with pytest.raises(ValueError, match="trainer.micro_batch_size must be an integer >= 1"):
        TrainerConfig(micro_batch_size=0)


def test_a_worker_refuses_a_wrong_world_size_context_parallelism_and_a_kl_reward_penalty():
    from glue.trainer.worker import TrainerWorker

    with pytest.raises(ValueError, match=r"world size 2 != TP x PP x CP x DP = 1"):
        TrainerWorker(model_path="unused", cfg=TrainerConfig(), loss_cfg=LossConfig(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="set trainer.context_parallel_size: 1"):
        TrainerWorker(model_path="unused", cfg=TrainerConfig(context_parallel_size=2), loss_cfg=LossConfig(), rank=0,
                      world_size=2)
    with pytest.raises(ValueError, match="use loss.kl_loss_coef"):
        TrainerWorker(model_path="unused", cfg=TrainerConfig(), loss_cfg=LossConfig(kl_reward_coef=0.1), rank=0,
                      world_size=1)


def test_a_kl_loss_term_is_zero_at_the_reference_then_holds_the_policy_near_it(model_dir):
    # Step 1 trains from the reference weights, so KL = 0 and the loss is the policy term alone; at step 2 the
    # policy has moved, the k3 KL to the frozen reference is positive and enters the loss with its coefficient,
    # and its gradient pulls back: after two steps the policy is closer to where it started than without the term.
    batch = make_batch()
    kl = LossConfig(kl_loss_coef=1.0, kl_estimator="k3")
    with_kl = run_trainer_ranks(model_dir, 1, batch, loss_cfg=kl, steps=2)
    without = run_trainer_ranks(model_dir, 1, batch, loss_cfg=LossConfig(), steps=2)
    first, second = with_kl["all_metrics"]
    assert abs(first["train/kl"]) < 1e-7 and abs(first["train/loss"] - first["train/pg_loss"]) < 1e-7
    assert second["train/kl"] > 1e-5
    assert abs(second["train/loss"] - (second["train/pg_loss"] + 1.0 * second["train/kl"])) < 1e-6
    assert abs(first["train/loss"] - without["all_metrics"][0]["train/loss"]) < 1e-7  # same first step
    mask = batch.logprob_mask.bool()
    drift_with = (with_kl["after"] - with_kl["before"])[mask].abs().mean()
    drift_without = (without["after"] - without["before"])[mask].abs().mean()
    assert drift_with < drift_without, f"KL term should hold the policy back: {drift_with} vs {drift_without}"
