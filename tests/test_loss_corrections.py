"""Off-policy corrections (loss.CORRECTIONS), the decoupled discrepancy x staleness split and PPO-EWMA."""
import math

import pytest
import torch

import loss
from loss import LossConfig, compute_policy_loss

F64 = torch.float64


def weights(cfg, rho, mask=None, seq_ids=None):
    """Per-token correction weights, read back through the gradient of a ratio-1 REINFORCE-like PPO loss.

    With pi_theta == pi_old the clip is inactive and d loss / d logp_t = -A w_t / N; A = -1 and N = 1 via
    num_global_tokens makes the gradient equal w_t.
    """
    rho = torch.tensor(rho, dtype=F64)
    logprobs = torch.zeros_like(rho, requires_grad=True)  # old = 0, so old - rollout = log rho exactly
    old = logprobs.detach().clone()
    rollout = old - rho.log()  # old - rollout = log rho
    mask = torch.ones_like(rho) if mask is None else torch.tensor(mask, dtype=F64)
    out, metrics = compute_policy_loss(cfg, logprobs=logprobs, old_logprobs=old, rollout_logprobs=rollout,
                                       advantages=-torch.ones_like(rho), mask=mask, num_global_tokens=1, seq_ids=seq_ids)
    out.backward()
    return logprobs.grad * mask, metrics


def test_token_tis_truncates_the_ratio_at_the_upper_threshold_and_keeps_every_token():
    w, m = weights(LossConfig(correction="tis", correction_high=2.0), [[0.25, 1.0, 3.0]])
    assert torch.allclose(w, torch.tensor([[0.25, 1.0, 2.0]], dtype=F64))
    assert m["correction/kept_frac"].item() == 1.0
    assert m["correction/clipped_frac"].item() == pytest.approx(1 / 3)


def test_token_mis_masks_tokens_above_the_upper_threshold_and_keeps_the_ratio_as_weight():
    w, m = weights(LossConfig(correction="mis", correction_high=2.0), [[0.25, 1.0, 2.0, 3.0]])
    assert torch.allclose(w, torch.tensor([[0.25, 1.0, 2.0, 0.0]], dtype=F64))
    assert m["correction/kept_frac"].item() == pytest.approx(3 / 4)


def test_icepop_zeroes_tokens_outside_the_ratio_band_and_keeps_the_band_edges():
    w, m = weights(LossConfig(correction="icepop"), [[0.25, 0.5, 1.0, 2.0, 3.0]])
    # default band [0.5, 2.0]; inside it the weight is the ratio itself
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0]], dtype=F64))
    assert m["correction/kept_frac"].item() == pytest.approx(3 / 5)
    assert m["correction/clipped_frac"].item() == pytest.approx(2 / 5)


# Two sequences: A has token ratios [2, 2]; B has [0.5, 0.5, 4].
#   product:    A = 4,   B = 1
#   arithmetic: A = 2,   B = 5/3
#   geometric:  A = 2,   B = (0.5 * 0.5 * 4)^(1/3) = 1
# thresholds [0.5, 1.5]: TIS truncates at 1.5, MIS zeroes sequences outside the band
SEQ_RHO = [[2.0, 2.0, 1.0], [0.5, 0.5, 4.0]]
SEQ_MASK = [[1, 1, 0], [1, 1, 1]]
SEQ_CASES = {
    "seq_tis": (1.5, 1.0),
    "seq_mis": (0.0, 1.0),
    "seq_tis_arith": (1.5, 1.5),
    "seq_mis_arith": (0.0, 0.0),
    "seq_tis_geo": (1.5, 1.0),
    "seq_mis_geo": (0.0, 1.0),
}


@pytest.mark.parametrize("name", list(SEQ_CASES))
def test_sequence_level_corrections_weight_every_token_by_its_sequences_corrected_ratio(name):
    w, m = weights(LossConfig(correction=name, correction_low=0.5, correction_high=1.5), SEQ_RHO, mask=SEQ_MASK)
    wa, wb = SEQ_CASES[name]
    assert torch.allclose(w, torch.tensor([[wa, wa, 0.0], [wb, wb, wb]], dtype=F64), atol=1e-12)
    kept = (2 * (wa != 0) + 3 * (wb != 0)) / 5
    assert m["correction/kept_frac"].item() == pytest.approx(kept)


def test_every_correction_in_the_registry_has_a_value_test():
    assert set(loss.CORRECTIONS) == {"none", "tis", "mis", "icepop"} | set(SEQ_CASES)


def test_no_correction_still_reports_the_discrepancy_ratio():
    w, m = weights(LossConfig(), [[0.5, 2.0]])
    assert torch.allclose(w, torch.ones(1, 2, dtype=F64))
    assert m["discrepancy/ratio_max"].item() == pytest.approx(2.0)
    assert m["discrepancy/ratio_min"].item() == pytest.approx(0.5)
    assert m["discrepancy/abs_log_ratio_mean"].item() == pytest.approx(math.log(2.0))


def test_sequence_correction_follows_packed_sequence_ids_not_rows():
    seq_ids = torch.tensor([[0, 0, 1, 1]])
    w, _ = weights(LossConfig(correction="seq_mis", correction_high=1.5), [[2.0, 2.0, 1.0, 1.0]], seq_ids=seq_ids)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=F64))


def test_decoupled_correction_applies_each_factor_with_its_own_thresholds_and_metrics():
    # token 0: discrepancy 1.5 (inside IcePop's band), staleness 1.5 (outside the 0.2 clip)
    # token 1: discrepancy 3.0 (masked by IcePop),    staleness 1.1 (inside the clip)
    rollout = torch.tensor([[-2.0, -2.0]], dtype=F64)
    old = rollout + torch.tensor([[math.log(1.5), math.log(3.0)]], dtype=F64)
    logprobs = (old + torch.tensor([[math.log(1.5), math.log(1.1)]], dtype=F64)).requires_grad_(True)
    out, m = compute_policy_loss(LossConfig(correction="icepop"), logprobs=logprobs, old_logprobs=old,
                                 rollout_logprobs=rollout, advantages=torch.ones(1, 2, dtype=F64), mask=torch.ones(1, 2))
    out.backward()
    # token 0: weight 1.5 * clipped PPO loss -1.2 (no gradient); token 1: weight 0
    assert out.item() == pytest.approx(1.5 * -1.2 / 2)
    assert torch.allclose(logprobs.grad, torch.zeros(1, 2, dtype=F64))
    assert m["discrepancy/ratio_max"].item() == pytest.approx(3.0)
    assert m["staleness/ratio_max"].item() == pytest.approx(1.5)
    assert m["correction/kept_frac"].item() == pytest.approx(0.5)
    assert m["staleness/clipfrac"].item() == pytest.approx(0.5)


def test_old_logprobs_from_rollout_puts_the_whole_ratio_into_the_staleness_factor():
    rollout = torch.tensor([[-1.0, -1.0]], dtype=F64)
    logprobs = rollout + torch.tensor([[math.log(1.5), 0.0]], dtype=F64)
    _, m = compute_policy_loss(LossConfig(old_logprobs_from="rollout"), logprobs=logprobs, old_logprobs=None,
                               rollout_logprobs=rollout, advantages=torch.ones(1, 2), mask=torch.ones(1, 2))
    assert m["discrepancy/ratio_max"].item() == 1.0
    assert m["staleness/ratio_max"].item() == pytest.approx(1.5)


def test_missing_old_logprobs_with_the_given_source_says_how_to_fix_it():
    with pytest.raises(ValueError, match="old_logprobs_from"):
        compute_policy_loss(LossConfig(), logprobs=torch.zeros(1, 2), old_logprobs=None,
                            rollout_logprobs=torch.zeros(1, 2), advantages=torch.ones(1, 2), mask=torch.ones(1, 2))


def test_ppo_ewma_proximal_policy_is_the_running_average_of_the_policies_a_sample_was_evaluated_under():
    """Three evaluations of one sample at decay 0.5: rollout logprobs r, then three known policies l_1, l_2, l_3. At
    evaluation n the loss trains against log pi_prox_n = 0.5^n r + 0.5 * sum_k 0.5^(n - k) l_k, and that is the state
    carried to evaluation n + 1."""
    r = torch.tensor([[-2.0, -1.0]], dtype=F64)
    policies = [torch.tensor(lp, dtype=F64) for lp in ([[-1.0, -2.0]], [[-0.5, -1.5]], [[-0.25, -3.0]])]
    expected = [0.5 ** n * r + 0.5 * sum(0.5 ** (n - k) * policies[k - 1] for k in range(1, n + 1)) for n in (1, 2, 3)]
    # token 0 by hand: -1.5, then 0.25 * -2 + 0.25 * -1 + 0.5 * -0.5 = -1.0, then -0.25 - 0.125 - 0.125 - 0.125
    assert [e[0, 0].item() for e in expected] == [-1.5, -1.0, -0.625]
    # no clip (ratio bounds [0, 101]), A = -1, N = 1: d loss / d logp_t = pi_theta / pi_prox gives pi_prox back
    cfg = LossConfig(old_logprobs_from="ewma", ewma_beta=0.5, clip_low=1.0, clip_high=100.0)
    state = None  # the first evaluation starts from the rollout logprobs
    for n, (policy, want) in enumerate(zip(policies, expected), start=1):
        logprobs = policy.clone().requires_grad_(True)
        out, _ = compute_policy_loss(cfg, logprobs=logprobs, old_logprobs=None, rollout_logprobs=r,
                                     advantages=-torch.ones_like(r), mask=torch.ones_like(r), num_global_tokens=1,
                                     ewma_logprobs=state)
        out.backward()
        assert torch.allclose(policy - logprobs.grad.log(), want), f"proximal policy of evaluation {n}"
        state = loss.ewma_proximal_logprobs(state=r if state is None else state, logprobs=logprobs, beta=0.5)
        assert torch.allclose(state, want), f"state after evaluation {n}"
        assert not state.requires_grad


def test_ppo_ewma_in_the_loss_splits_the_total_ratio_into_its_two_factors():
    rollout = torch.tensor([[-2.0, -2.0]], dtype=F64)
    logprobs = torch.tensor([[-1.0, -1.5]], dtype=F64, requires_grad=True)
    cfg = LossConfig(old_logprobs_from="ewma", ewma_beta=0.25)
    _, m = compute_policy_loss(cfg, logprobs=logprobs, old_logprobs=None, rollout_logprobs=rollout,
                               advantages=torch.ones(1, 2, dtype=F64), mask=torch.ones(1, 2))
    # first evaluation: log prox = b * rollout + (1 - b) * logp; staleness log-ratio = b (logp - rollout),
    # discrepancy log-ratio = (1 - b)(logp - rollout): their product is the total ratio
    gap = [1.0, 0.5]
    stale = [0.25 * g for g in gap]
    disc = [0.75 * g for g in gap]
    assert m["staleness/ratio_max"].item() == pytest.approx(math.exp(max(stale)))
    assert m["staleness/ratio_min"].item() == pytest.approx(math.exp(min(stale)))
    assert m["discrepancy/ratio_max"].item() == pytest.approx(math.exp(max(disc)))
    assert m["discrepancy/ratio_min"].item() == pytest.approx(math.exp(min(disc)))
