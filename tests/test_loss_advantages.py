"""Advantage estimators against hand-computed values (loss.ADVANTAGE_ESTIMATORS)."""
import math
import statistics

import pytest
import torch

import loss
from loss import LossConfig, compute_advantages


def adv(cfg, rewards, group_ids, mask, **kw):
    return compute_advantages(
        cfg, rewards=torch.tensor(rewards, dtype=torch.float64), group_ids=torch.tensor(group_ids),
        mask=torch.tensor(mask, dtype=torch.float64), **kw,
    )


def test_grpo_divides_the_group_centred_reward_by_the_unbiased_group_std():
    out = adv(LossConfig(), [1.0, 0.0, 1.0, 0.0], [7, 7, 7, 7], [[1, 1, 0]] * 4)
    std = math.sqrt(4 * 0.5**2 / 3)  # unbiased std of [1, 0, 1, 0]
    expected = torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=torch.float64) / std
    assert torch.allclose(out[:, 0], expected)
    assert torch.allclose(out[:, 1], expected)
    assert (out[:, 2] == 0).all()


def test_a_group_whose_rewards_are_all_equal_gets_exactly_zero_advantage_under_every_group_estimator():
    rewards = [0.1, 0.1, 0.1, 0.7, 0.7]  # 0.1 * 3 / 3 != 0.1 in floating point; the estimators must still give 0
    mask = [[1, 1]] * 5
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        out = adv(LossConfig(advantage_estimator=name), rewards, [0, 0, 0, 1, 1], mask)
        assert torch.isfinite(out).all(), name
        assert (out == 0).all(), f"{name}: {out}"
    # reinforce_pp has no group baseline: only a batch whose rewards are all equal whitens to exactly 0
    out = adv(LossConfig(advantage_estimator="reinforce_pp"), [0.1] * 3, [0, 1, 2], [[1, 1]] * 3)
    assert (out == 0).all()


def test_grpo_std_floor_bounds_the_division_for_a_nearly_flat_group():
    out = adv(LossConfig(std_floor=1e-6), [0.0, 2e-7], [0, 0], [[1], [1]])
    # mean 1e-7, unbiased std = sqrt(2 * (1e-7)^2) = 1.41e-7 < floor, so divide by the floor
    assert torch.allclose(out[:, 0], torch.tensor([-0.1, 0.1], dtype=torch.float64))


def test_dr_grpo_and_grpo_without_std_subtract_only_the_group_mean():
    for cfg in (LossConfig(advantage_estimator="dr_grpo"), LossConfig(normalize_std=False)):
        out = adv(cfg, [3.0, 1.0, 2.0, 5.0], [0, 0, 1, 1], [[1]] * 4)
        assert torch.allclose(out[:, 0], torch.tensor([1.0, -1.0, -1.5, 1.5], dtype=torch.float64))


def test_rloo_uses_the_mean_of_the_other_samples_as_baseline_and_zero_for_a_lone_sample():
    out = adv(LossConfig(advantage_estimator="rloo"), [1.0, 0.0, 0.0, 0.0, 5.0], [0, 0, 0, 0, 1], [[1]] * 5)
    expected = [1.0 - 0.0, 0.0 - 1 / 3, 0.0 - 1 / 3, 0.0 - 1 / 3, 0.0]
    assert torch.allclose(out[:, 0], torch.tensor(expected, dtype=torch.float64))


def _whitened(values):
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(v - mean) / std for v in values]


def test_reinforce_pp_whitens_the_returns_over_every_valid_token_of_the_batch():
    mask = [[1, 1, 0], [1, 1, 1]]
    out = adv(LossConfig(advantage_estimator="reinforce_pp"), [1.0, 0.0], [0, 1], mask)
    # gamma = 1: every token's return is its row's reward -> tokens [1, 1, 0, 0, 0]
    w = _whitened([1, 1, 0, 0, 0])
    expected = torch.tensor([[w[0], w[1], 0], [w[2], w[3], w[4]]], dtype=torch.float64)
    assert torch.allclose(out, expected)


def test_reinforce_pp_discounts_over_valid_tokens_and_skips_masked_tool_tokens():
    mask = [[1, 0, 1, 1], [1, 1, 1, 1]]
    out = adv(LossConfig(advantage_estimator="reinforce_pp", gamma=0.5), [1.0, 2.0], [0, 1], mask)
    # row 0: the valid tokens are 0, 2, 3; the reward sits on token 3 -> returns 0.25, 0.5, 1 (token 1 skipped)
    # row 1: returns 2 * [0.125, 0.25, 0.5, 1]
    returns = [0.25, 0.5, 1.0, 0.25, 0.5, 1.0, 2.0]
    w = _whitened(returns)
    expected = torch.tensor([[w[0], 0, w[1], w[2]], [w[3], w[4], w[5], w[6]]], dtype=torch.float64)
    assert torch.allclose(out, expected)


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_global_whitening():
    mask = [[1, 1], [1, 0], [1, 1], [1, 1]]
    out = adv(LossConfig(advantage_estimator="reinforce_pp_baseline"), [1.0, 0.0, 3.0, 1.0], [0, 0, 1, 1], mask)
    centred = [0.5, -0.5, 1.0, -1.0]
    tokens = [centred[0]] * 2 + [centred[1]] + [centred[2]] * 2 + [centred[3]] * 2
    w = _whitened(tokens)
    expected = torch.tensor([[w[0], w[1]], [w[2], 0], [w[3], w[4]], [w[5], w[6]]], dtype=torch.float64)
    assert torch.allclose(out, expected)


def test_gae_matches_the_recursion_written_out_by_hand():
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    cfg = LossConfig(advantage_estimator="gae", gamma=0.9, gae_lambda=0.8)
    out = adv(cfg, [1.0], [0], [[1, 1, 1]], values=values)
    d2 = 1.0 - 0.7
    d1 = 0.9 * 0.7 - 0.6
    d0 = 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert torch.allclose(out, torch.tensor([[a0, a1, a2]], dtype=torch.float64))
    _, returns = loss.gae(torch.tensor([[0, 0, 1.0]], dtype=torch.float64), values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert torch.allclose(returns, torch.tensor([[a0 + 0.5, a1 + 0.6, a2 + 0.7]], dtype=torch.float64))


def test_gae_skips_masked_tokens_and_gives_zero_for_a_perfect_critic():
    cfg = LossConfig(advantage_estimator="gae", gamma=1.0, gae_lambda=1.0)
    values = torch.tensor([[1.0, 99.0, 1.0]], dtype=torch.float64)  # the masked token's value must be ignored
    out = adv(cfg, [1.0], [0], [[1, 0, 1]], values=values)
    assert (out == 0).all()


def test_gae_without_values_says_what_to_pass():
    with pytest.raises(ValueError, match="values="):
        adv(LossConfig(advantage_estimator="gae"), [1.0], [0], [[1]])


def test_all_masked_rows_get_zero_advantage_and_no_nan_under_every_estimator():
    mask = [[1, 1], [0, 0], [1, 1], [0, 0]]
    for name in loss.ADVANTAGE_ESTIMATORS:
        kw = {"values": torch.zeros(4, 2, dtype=torch.float64)} if name == "gae" else {}
        out = adv(LossConfig(advantage_estimator=name), [1.0, 5.0, 0.0, 2.0], [0, 0, 0, 0], mask, **kw)
        assert torch.isfinite(out).all(), name
        assert (out[1] == 0).all() and (out[3] == 0).all(), name
    every_row_masked = adv(LossConfig(advantage_estimator="reinforce_pp"), [1.0, 0.0], [0, 1], [[0, 0], [0, 0]])
    assert (every_row_masked == 0).all()


def test_batch_whitening_option_whitens_the_estimator_output_over_valid_tokens():
    cfg = LossConfig(advantage_estimator="dr_grpo", whiten_advantages=True)
    out = adv(cfg, [3.0, 1.0, 2.0, 6.0], [0, 0, 1, 1], [[1, 1], [1, 0], [1, 1], [1, 1]])
    tokens = [1.0, 1.0, -1.0, -2.0, -2.0, 2.0, 2.0]
    w = _whitened(tokens)
    expected = torch.tensor([[w[0], w[1]], [w[2], 0], [w[3], w[4]], [w[5], w[6]]], dtype=torch.float64)
    assert torch.allclose(out, expected)


def test_kl_reward_penalty_subtracts_coef_times_the_summed_token_kl_from_each_reward():
    cfg = LossConfig(advantage_estimator="dr_grpo", kl_reward_coef=0.1, kl_estimator="k1")
    logprobs = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -2.5], [-1.0, -9.0]], dtype=torch.float64)
    mask = [[1, 1], [1, 0]]  # row 1's second token is masked: its KL must not count
    out = adv(cfg, [1.0, 1.0], [0, 0], mask, logprobs=logprobs, ref_logprobs=ref)
    r0 = 1.0 - 0.1 * (0.5 + 0.5)  # k1 = logp - ref
    r1 = 1.0 - 0.1 * 0.0
    mean = (r0 + r1) / 2
    assert torch.allclose(out[:, 0], torch.tensor([r0 - mean, r1 - mean], dtype=torch.float64))
    with pytest.raises(ValueError, match="ref_logprobs"):
        adv(cfg, [1.0, 1.0], [0, 0], mask)


def test_advantages_come_back_in_the_mask_dtype_or_float32():
    out = compute_advantages(LossConfig(), rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]),
                             mask=torch.ones(2, 3, dtype=torch.long))
    assert out.dtype == torch.float32 and out.shape == (2, 3)
