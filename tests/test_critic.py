"""The critic behind `loss.advantage_estimator: gae`: GAE targets and the clipped value loss worked by hand, then the
value model in a real trainer actor (megatron-core on gloo, Ray) trained on a fixed batch and carried through a
checkpoint, then a short PPO run through every seam (engines behind sgl-router, the trainer, the bridge)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from glue.trainer.config import TrainerConfig
from glue.types import Sample, TrainBatch
from loss import LossConfig
from loss.value import clipped_value_loss, explained_variance, gae_targets

# ---- (a) the math, by hand ----


def test_gae_targets_by_hand_with_gamma_lambda_and_masked_positions():
    # one row, valid positions 1 and 2; the 9s are masked and must not leak in
    cfg = LossConfig(advantage_estimator="gae", gamma=0.9, gae_lambda=0.8)
    values = torch.tensor([[9.0, 0.5, 0.25, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv, ret = gae_targets(cfg, rewards=torch.tensor([1.0]), values=values, mask=mask)
    # t=2 (last): delta = 1 - 0.25 = 0.75 = A, R = 1.0
    # t=1: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275, A = -0.275 + 0.9 * 0.8 * 0.75 = 0.265, R = 0.265 + 0.5 = 0.765
    assert torch.allclose(adv, torch.tensor([[0.0, 0.265, 0.75, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.0, 0.765, 1.0, 0.0]]))
    # whitened advantages (unbiased std over the 2 valid tokens: 0.485 / sqrt 2); returns stay the critic's targets
    whitening = LossConfig(advantage_estimator="gae", gamma=0.9, gae_lambda=0.8, whiten_advantages=True)
    adv_w, ret_w = gae_targets(whitening, rewards=torch.tensor([1.0]), values=values, mask=mask)
    assert torch.allclose(adv_w, torch.tensor([[0.0, -2 ** -0.5, 2 ** -0.5, 0.0]]), atol=1e-6)
    assert torch.equal(ret_w, ret)


def test_with_lambda_one_the_returns_are_the_reward_whatever_the_values():
    cfg = LossConfig(advantage_estimator="gae", gamma=1.0, gae_lambda=1.0)
    values = torch.tensor([[0.3, -2.0, 0.7], [5.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae_targets(cfg, rewards=torch.tensor([2.0, -1.0]), values=values, mask=mask)
    assert torch.equal(ret, torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]))
    assert torch.allclose(adv, (ret - values) * mask)


def test_the_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 0.5, 1.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.4, 0.0]])
    returns = torch.tensor([[2.0, -1.0, 0.0, 0.1]])
    mask = torch.ones(1, 4)
    loss, metrics = clipped_value_loss(values, old_values=old, returns=returns, mask=mask, clip=0.2)
    # t0: V moved 1.0 from 0, clipped to 0.2: max((1-2)^2, (0.2-2)^2) = 3.24 -> 1.62, the clipped error wins
    # t1: V = V_old: 0.5 * 1 = 0.5.  t2: moved 0.1 < clip: 0.5 * 0.25 = 0.125
    # t3: moved 1.0, clipped to 0.2: max(0.81, 0.01) = 0.81 -> 0.405, the unclipped error wins (pessimistic max)
    assert loss.item() == pytest.approx((1.62 + 0.5 + 0.125 + 0.405) / 4)
    assert metrics["value_clipfrac"].item() == pytest.approx(0.25)
    loss.backward()
    # no gradient where the clipped error won; (V - R) / 4 elsewhere
    assert torch.allclose(values.grad, torch.tensor([[0.0, 1.0, 0.5, 0.9]]) / 4)
    plain, _ = clipped_value_loss(values.detach(), old_values=old, returns=returns, mask=mask, clip=None,
                                  num_global_tokens=8)
    assert plain.item() == pytest.approx(0.5 * (1 + 1 + 0.25 + 0.81) / 8)  # normalised by the global count


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)


def test_the_critics_settings_name_the_field_when_wrong():
    with pytest.raises(ValueError, match="loss.value_clip"):
        LossConfig(advantage_estimator="gae", value_clip=0.0)
    with pytest.raises(ValueError, match="trainer.critic_lr"):
        TrainerConfig(critic_lr=-1.0)
    assert LossConfig(advantage_estimator="gae").uses_critic and not LossConfig().uses_critic


# ---- (b) the value model in a real trainer actor, on a fixed batch, and through a checkpoint ----

PROMPT_LEN, RESPONSE_LEN, BATCH, STEPS = 5, 6, 6, 4


def fixed_batch() -> TrainBatch:
    """Six samples of random tokens with rewards 0, 0.2, ..., 1.0 (GAE fills the advantages in the trainer)."""
    gen = torch.Generator().manual_seed(5)
    samples = []
    for i in range(BATCH):
        tokens = torch.randint(2, 32, (PROMPT_LEN + RESPONSE_LEN,), generator=gen).tolist()
        s = Sample(prompt_tokens=tokens[:PROMPT_LEN], reward=i / 5, index=i)
        s.append_response(tokens[PROMPT_LEN:], [-3.0] * RESPONSE_LEN, version=0)
        samples.append(s)
    return TrainBatch.from_samples(samples, [0.0] * BATCH)


@pytest.fixture(scope="module")
def critic_runs(tiny_model_dir, tmp_path_factory) -> dict:
    """One trainer trains STEPS steps on the fixed batch (checkpoint after step 2); a second one resumes that
    checkpoint and trains step 3 again; a third trains steps 1-2 at TP=2 (sequence parallel) x DP=2. Values after
    every step and the step metrics are kept."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from glue.trainer.group import TrainerGroup

    batch, ckpt = fixed_batch(), str(tmp_path_factory.mktemp("ckpt"))
    loss_cfg = LossConfig(advantage_estimator="gae", gamma=1.0, gae_lambda=1.0, value_clip=0.05)  # binds in epoch 2
    cfg = TrainerConfig(lr=1e-3, critic_lr=1e-3, num_epochs=2)  # the 2nd epoch's steps meet the value clip
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out: dict = {"batch": batch, "values": [], "metrics": []}
    try:
        group = TrainerGroup(tiny_model_dir, cfg, loss_cfg)
        try:
            out["values"].append(group.compute_values(batch))
            for step in range(1, STEPS + 1):
                out["metrics"].append(group.train_step(batch))
                out["values"].append(group.compute_values(batch))
                if step == 2:
                    group.save_checkpoint(ckpt)
        finally:
            group.shutdown()
        resumed = TrainerGroup(tiny_model_dir, cfg, loss_cfg)
        try:
            out["resumed_version"] = resumed.load_checkpoint(ckpt)
            out["resumed_values"] = resumed.compute_values(batch)
            out["resumed_metrics"] = resumed.train_step(batch)
            out["resumed_values_3"] = resumed.compute_values(batch)
        finally:
            resumed.shutdown()
        layout = dict(tensor_model_parallel_size=2, data_parallel_size=2, megatron={"sequence_parallel": True})
        split = TrainerGroup(tiny_model_dir, dataclasses.replace(cfg, **layout), loss_cfg)
        try:  # the same two steps on 4 ranks: every layer split over 2 TP ranks (the sequence too), the rows over 2 DP
            for _ in range(2):
                split.train_step(batch)
            out["split_values_2"] = split.compute_values(batch)
        finally:
            split.shutdown()
    finally:
        ray.shutdown()
    out["ckpt"] = ckpt
    return out


def _squared_error(values: torch.Tensor, batch: TrainBatch) -> float:
    """Mean (V - R)^2 over trained positions; with gamma = lambda = 1 the return R is the sample's reward."""
    mask = batch.logprob_mask.bool()
    returns = torch.tensor(batch.rewards)[:, None].expand_as(values)
    return float(((values - returns)[mask] ** 2).mean())


@pytest.mark.slow
def test_the_critics_values_move_toward_the_returns_on_a_fixed_batch(critic_runs):
    batch, values = critic_runs["batch"], critic_runs["values"]
    mask = batch.logprob_mask.bool()
    assert torch.equal(values[0][mask], torch.zeros(int(mask.sum())))  # the value head starts at 0
    errors = [_squared_error(v, batch) for v in values]
    assert errors[0] == pytest.approx(sum((i / 5) ** 2 for i in range(BATCH)) / BATCH, rel=1e-5)
    assert errors[-1] < 0.5 * errors[0], errors  # a critic that did not train would stay at errors[0]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    first, last = critic_runs["metrics"][0], critic_runs["metrics"][-1]
    # step 1: values 0, returns = the rewards: their token mean is the rewards' mean, 0.5
    assert first["critic/returns_mean"] == pytest.approx(0.5, abs=1e-6)
    assert first["critic/values_mean"] == 0.0 and first["critic/explained_variance"] == pytest.approx(0.0)
    assert last["critic/value_loss"] < 0.5 * first["critic/value_loss"]
    # the clip acted: a second epoch's step met values already moved more than value_clip (0.05) in the first
    assert max(m["critic/value_clipfrac"] for m in critic_runs["metrics"]) > 0
    assert first["critic/grad_norm"] > 0 and "train/loss" in first and first["weights/version"] == 1.0


@pytest.mark.slow
def test_a_resumed_trainer_continues_the_critic_with_its_weights_and_adam_state(critic_runs):
    assert os.path.isdir(os.path.join(critic_runs["ckpt"], "critic", "dist"))
    assert os.path.exists(os.path.join(critic_runs["ckpt"], "critic", "rank_00000.pt"))
    assert critic_runs["resumed_version"] == 2
    # the critic's weights came back exactly as they were at the checkpoint (not re-initialised: those are 0)
    assert torch.equal(critic_runs["resumed_values"], critic_runs["values"][2])
    # and its optimizer state too: step 3 after the resume is step 3 of the run that never stopped (with Adam's
    # moments restarted, the same gradient would take a different step)
    assert torch.allclose(critic_runs["resumed_values_3"], critic_runs["values"][3], atol=1e-6)
    for key in ("critic/value_loss", "critic/grad_norm", "train/loss"):
        assert critic_runs["resumed_metrics"][key] == pytest.approx(critic_runs["metrics"][2][key], rel=1e-5), key


@pytest.mark.slow
def test_the_critic_split_over_tensor_and_data_parallel_ranks_trains_like_one(critic_runs):
    """The value head is whole on every TP rank, after the sequence-parallel hidden states are gathered; its
    gradient is each rank's own; each DP rank values and trains its share of the rows (Adam state sharded over DP).
    Two steps at TP=2 x DP=2 (the trunk moves from the second optimizer step, once the head is no longer 0) give
    the values of one rank."""
    mask = critic_runs["batch"].logprob_mask.bool()
    one, two = critic_runs["values"][2][mask], critic_runs["split_values_2"][mask]
    assert one.abs().max() > 0.05  # they moved
    assert torch.allclose(two, one, atol=2e-4), (two - one).abs().max()


# ---- (c) PPO with the critic through every seam: engines behind sgl-router, the trainer on Ray, the bridge ----

@pytest.mark.slow
@pytest.mark.long  # 33 s; in CI the critic trains through the real trainer actors on the fixed batch (above)
def test_a_short_ppo_critic_run_learns_and_its_critic_explains_the_returns(tmp_path):
    from glue.metrics.logger import read_metrics
    from launch.args.command_line import parse_args
    from launch.config import load_config
    from launch.run.runner import run

    args, overrides = parse_args(["--config", "examples/configs/ppo_critic.yaml", f"run.output_dir={tmp_path}",
                                  "run.name=ppo", "run.num_steps=16", "run.loggers=[jsonl]"])
    run_dir = run(load_config(args.config, overrides, args.flags))
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 17))
    rewards = [r["rollout/reward_mean"] for r in records]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.08, rewards
    first, last = records[0], records[-1]
    assert first["critic/values_mean"] == 0.0  # the value head starts at 0 ...
    # ... and follows the returns as the policy improves (a critic that did not train would stay at 0, with an
    # explained variance of exactly 0)
    late = records[-8:]
    gap = sum(abs(r["critic/values_mean"] - r["critic/returns_mean"]) for r in late) / len(late)
    assert gap < 0.5 * sum(r["critic/returns_mean"] for r in late) / len(late), [
        (r["critic/values_mean"], r["critic/returns_mean"]) for r in records]
    assert max(r["critic/explained_variance"] for r in records[-5:]) > 0.01
    assert all(r["critic/grad_norm"] > 0 and r["train/grad_norm"] > 0 for r in records)
    assert os.path.isdir(run_dir / "checkpoints" / "step_00000016" / "critic" / "dist")
