"""Policy losses (loss.POLICY_LOSSES) against hand-computed losses and gradients."""
import math

import pytest
import torch

import loss
from loss import LossConfig, compute_policy_loss

F64 = torch.float64


def run(cfg, ratios, adv, mask=None, **kw):
    """Loss, metrics and d loss / d logprobs for tokens whose staleness ratio pi_theta / pi_old is `ratios`."""
    ratios = torch.tensor(ratios, dtype=F64)
    old = torch.full_like(ratios, -1.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else torch.tensor(mask, dtype=F64)
    out, metrics = compute_policy_loss(cfg, logprobs=logprobs, old_logprobs=old, rollout_logprobs=old.clone(),
                                       advantages=torch.tensor(adv, dtype=F64), mask=mask, **kw)
    out.backward()
    return out.detach(), metrics, logprobs.grad


def test_ppo_clip_takes_the_pessimistic_term_for_each_sign_of_the_advantage():
    out, m, grad = run(LossConfig(), [[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]], [[1.0] * 3, [-1.0] * 3])
    # A=+1: max(-r, -clip(r)) = -0.5 (unclipped), -1, -1.2 (clipped at 1.2)
    # A=-1: max(r, clip(r)) = 0.8 (clipped at 0.8), 1, 1.5 (unclipped)
    per_token = [-0.5, -1.0, -1.2, 0.8, 1.0, 1.5]
    assert out.item() == pytest.approx(sum(per_token) / 6)
    assert m["clipfrac"].item() == pytest.approx(2 / 6)
    # d/dlogp of -A r is -A r where unclipped, 0 where clipped; token-mean divides by 6
    expected = torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]], dtype=F64) / 6
    assert torch.allclose(grad, expected)


def test_ratios_exactly_on_the_clip_bounds_are_not_clipped_and_keep_their_gradient():
    assert math.exp(math.log(1.2)) == 1.2 and math.exp(math.log(0.8)) == 0.8  # the ratios below are exact
    out, m, grad = run(LossConfig(), [[0.8, 1.2], [0.8, 1.2]], [[1.0, 1.0], [-1.0, -1.0]])
    assert m["clipfrac"].item() == 0.0
    assert torch.allclose(grad, torch.tensor([[-0.8, -1.2], [0.8, 1.2]], dtype=F64) / 4)


def test_clip_higher_uses_separate_lower_and_upper_bounds():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    out, m, grad = run(cfg, [[1.25, 1.3, 0.75]], [[1.0, 1.0, -1.0]])
    # 1.25 < 1.28 unclipped; 1.3 clipped to 1.28; A<0 with 0.75 < 0.8 clipped to 0.8
    assert out.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3)
    assert torch.allclose(grad, torch.tensor([[-1.25 / 3, 0.0, 0.0]], dtype=F64))
    assert m["clipfrac"].item() == pytest.approx(2 / 3)


def test_dual_clip_caps_the_loss_of_negative_advantage_tokens_with_huge_ratios():
    cfg = LossConfig(dual_clip=3.0)
    out, m, grad = run(cfg, [[5.0, 2.0, 5.0]], [[-1.0, -1.0, 1.0]])
    # A=-1, r=5: PPO gives max(5, 1.2) = 5, dual-clip caps it at 3 (no gradient); r=2: 2 < 3 stays
    # A=+1, r=5: clipped to -1.2 as usual, dual-clip does not touch positive advantages
    assert out.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert torch.allclose(grad, torch.tensor([[0.0, 2.0 / 3, 0.0]], dtype=F64))
    assert m["dual_clipfrac"].item() == pytest.approx(1 / 3)
    assert m["clipfrac"].item() == pytest.approx(2 / 3)


def test_gspo_clips_whole_sequences_on_the_geometric_mean_ratio():
    cfg = LossConfig(policy_loss="gspo", gspo_clip_low=0.2, gspo_clip_high=0.2, aggregation="seq_mean_token_mean")
    lr = [[0.1, 0.3, 0.0], [-0.1, 0.0, 0.1]]
    out, m, grad = run(cfg, [[math.exp(x) for x in row] for row in lr], [[1.0] * 3, [-1.0] * 3], mask=[[1, 1, 0], [1, 1, 1]])
    s0 = math.exp((0.1 + 0.3) / 2)  # 1.2214 > 1.2: sequence 0 is clipped, all its tokens lose their gradient
    s1 = math.exp(0.0)  # 1.0
    assert s0 > 1.2
    assert out.item() == pytest.approx((-1.2 + 1.0 * s1) / 2)
    # GSPO's gradient: d(-A s_i)/dlogp_t = -A s_i / |y_i|, times 1/G for the sequence mean
    assert torch.allclose(grad, torch.tensor([[0, 0, 0], [s1 / 3 / 2] * 3], dtype=F64))
    assert m["clipfrac"].item() == pytest.approx(2 / 5)


def test_cispo_clips_the_stop_gradient_weight_so_every_token_keeps_a_gradient():
    cfg = LossConfig(policy_loss="cispo", cispo_clip_low=0.2, cispo_clip_high=0.2)
    out, m, grad = run(cfg, [[0.5, 1.1, 6.0]], [[1.0, 1.0, -1.0]])
    # weights clip(r, 0.8, 1.2) = 0.8, 1.1, 1.2; loss = -w A logp; d/dlogp = -w A (then / 3)
    logp = [-1 + math.log(0.5), -1 + math.log(1.1), -1 + math.log(6.0)]
    w, a = [0.8, 1.1, 1.2], [1.0, 1.0, -1.0]
    assert out.item() == pytest.approx(sum(-wi * ai * li for wi, ai, li in zip(w, a, logp)) / 3)
    assert torch.allclose(grad, torch.tensor([[-0.8 / 3, -1.1 / 3, 1.2 / 3]], dtype=F64))
    assert m["clipfrac"].item() == pytest.approx(2 / 3)


def test_mu_grpo_relaxed_clip_keeps_gradients_that_ppo_would_clip():
    out, m, grad = run(LossConfig(policy_loss="mu_grpo"), [[4.0, 0.1]], [[1.0, -1.0]])
    # relaxed interval [0, 5]: neither token is clipped, and A<0 with r=0.1 triggers no veto
    assert out.item() == pytest.approx((-4.0 + 0.1) / 2)
    assert torch.allclose(grad, torch.tensor([[-2.0, 0.05]], dtype=F64))
    assert m["clipfrac"].item() == 0.0 and m["mu_grpo/veto_frac"].item() == 0.0


def test_mu_grpo_vetoes_the_suffix_of_a_negative_advantage_response_from_its_first_trigger_token():
    ratios = [[1.0, 2.5, 1.0, 3.0], [1.0, 2.5, 1.0, 3.0]]
    out, m, grad = run(LossConfig(policy_loss="mu_grpo", veto_ratio=2.0), ratios, [[-1.0] * 4, [1.0] * 4])
    # row 0 (A<0): token 1 is the first with r > 2, so tokens 1..3 are vetoed; token 0 stays (loss r = 1)
    # row 1 (A>0): no veto: losses -1, -2.5, -1, -3
    assert out.item() == pytest.approx((1.0 - 1.0 - 2.5 - 1.0 - 3.0) / 8)
    assert torch.allclose(grad, torch.tensor([[1.0, 0, 0, 0], [-1.0, -2.5, -1.0, -3.0]], dtype=F64) / 8)
    assert m["mu_grpo/veto_frac"].item() == pytest.approx(3 / 8)


def test_mu_grpo_veto_stays_inside_its_own_sequence_in_a_packed_row():
    seq_ids = torch.tensor([[0, 0, 1, 1]])
    out, m, grad = run(LossConfig(policy_loss="mu_grpo"), [[3.0, 1.0, 1.0, 1.0]], [[-1.0, -1.0, -1.0, -1.0]], seq_ids=seq_ids)
    assert torch.allclose(grad, torch.tensor([[0, 0, 0.25, 0.25]], dtype=F64))
    assert m["mu_grpo/veto_frac"].item() == pytest.approx(2 / 4)


def test_reinforce_is_minus_advantage_times_logprob():
    out, m, grad = run(LossConfig(policy_loss="reinforce"), [[1.0, 3.0]], [[2.0, -1.0]])
    assert out.item() == pytest.approx((-2.0 * -1.0 + 1.0 * (-1 + math.log(3.0))) / 2)
    assert torch.allclose(grad, torch.tensor([[-1.0, 0.5]], dtype=F64))
    assert m["clipfrac"].item() == 0.0


@pytest.mark.parametrize("policy", list(loss.POLICY_LOSSES))
@pytest.mark.parametrize("correction", list(loss.CORRECTIONS))
def test_huge_log_ratio_gaps_and_garbage_in_padding_give_finite_loss_and_gradients(policy, correction):
    # guard: log-ratios are clamped to +-20 before exp() and padded positions are zeroed before any arithmetic
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-900.0, -1.0, -2.0, -3.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1000.0, -1.0, 500.0, float("nan")], [-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    rollout = torch.tensor([[-1.0, -800.0, -1.0, -float("inf")], [-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, -1.0, float("nan")], [-2.0, -2.0, -2.0, -2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=F64)
    cfg = LossConfig(policy_loss=policy, correction=correction, kl_loss_coef=0.1)
    out, metrics = compute_policy_loss(cfg, logprobs=logprobs, old_logprobs=old, rollout_logprobs=rollout,
                                       advantages=adv, mask=mask, ref_logprobs=torch.full((2, 4), -1.0, dtype=F64))
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values()), metrics


def test_default_config_matches_the_placeholder_contract_ppo_clip_token_mean():
    torch.manual_seed(0)
    logprobs = torch.randn(3, 5, dtype=F64)
    old = logprobs + 0.3 * torch.randn(3, 5, dtype=F64)
    adv = torch.randn(3, 5, dtype=F64)
    mask = (torch.rand(3, 5) > 0.3).to(F64)
    out, m = compute_policy_loss(LossConfig(), logprobs=logprobs, old_logprobs=old, rollout_logprobs=old,
                                 advantages=adv, mask=mask, num_global_tokens=20)
    r = (logprobs - old).exp()
    expected = (-torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv) * mask).sum() / 20
    assert out.item() == pytest.approx(expected.item())
    assert set(m) >= {"clipfrac", "pg_loss", "staleness/clipfrac", "discrepancy/ratio_mean", "correction/kept_frac"}
