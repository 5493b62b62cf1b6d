"""KL estimators, entropy bonus and aggregation modes, including micro-batch gradient invariance."""
import math

import pytest
import torch

import loss
from loss import LossConfig, compute_policy_loss, count_tokens_and_seqs
from loss.aggregation import Sequences

F64 = torch.float64


def test_k1_k2_k3_match_their_formulas_for_one_token():
    logp, ref = torch.tensor([math.log(0.5)], dtype=F64), torch.tensor([math.log(0.25)], dtype=F64)
    d = math.log(0.25 / 0.5)  # log pi_ref / pi
    assert loss.KL_ESTIMATORS["k1"](logp, ref).item() == pytest.approx(-d)  # log 2
    assert loss.KL_ESTIMATORS["k2"](logp, ref).item() == pytest.approx(0.5 * d * d)
    assert loss.KL_ESTIMATORS["k3"](logp, ref).item() == pytest.approx(math.exp(d) - d - 1)  # 0.5 + log 2 - 1
    assert set(loss.KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_k3_is_non_negative_and_finite_even_for_huge_log_ratio_gaps():
    torch.manual_seed(0)
    logp, ref = 5 * torch.randn(1000, dtype=F64), 5 * torch.randn(1000, dtype=F64)
    assert (loss.KL_ESTIMATORS["k3"](logp, ref) >= 0).all()
    extreme = loss.KL_ESTIMATORS["k3"](torch.tensor([-1e4, 0.0, -float("inf")]), torch.tensor([0.0, -1e4, 0.0]))
    assert torch.isfinite(extreme).all()  # guard: the log-ratio is clamped to +-20 before exp()


def test_kl_loss_term_adds_coef_times_token_mean_k3_with_its_gradient():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    cfg = LossConfig(kl_loss_coef=0.1, policy_loss="reinforce")
    out, m = compute_policy_loss(cfg, logprobs=logp, old_logprobs=logp.detach(), rollout_logprobs=logp.detach(),
                                 advantages=torch.zeros(1, 2, dtype=F64), mask=torch.ones(1, 2), ref_logprobs=ref)
    out.backward()
    d = (ref - logp.detach())[0].tolist()
    k3 = [math.exp(x) - x - 1 for x in d]
    assert out.item() == pytest.approx(0.1 * sum(k3) / 2)
    assert m["kl"].item() == pytest.approx(sum(k3) / 2)
    # d k3 / d logp = 1 - exp(ref - logp)
    assert torch.allclose(logp.grad, torch.tensor([[0.1 * (1 - math.exp(x)) / 2 for x in d]], dtype=F64))


def test_missing_reference_logprobs_with_a_kl_coefficient_says_what_to_pass():
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(LossConfig(kl_loss_coef=0.1), logprobs=torch.zeros(1, 1), old_logprobs=torch.zeros(1, 1),
                            rollout_logprobs=torch.zeros(1, 1), advantages=torch.ones(1, 1), mask=torch.ones(1, 1))


def test_entropy_from_logits_is_log_v_for_uniform_and_near_zero_for_peaked():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]], dtype=F64)
    ent = loss.token_entropy(logits)
    assert ent[0, 0].item() == pytest.approx(math.log(4))
    assert 0 <= ent[0, 1].item() < 1e-40


def test_entropy_bonus_subtracts_coef_times_mean_entropy_from_the_loss():
    torch.manual_seed(0)
    logits = torch.randn(1, 2, 4, dtype=F64, requires_grad=True)
    zeros = torch.zeros(1, 2, dtype=F64)
    cfg = LossConfig(entropy_coef=0.01, policy_loss="reinforce")
    out, m = compute_policy_loss(cfg, logprobs=zeros, old_logprobs=zeros, rollout_logprobs=zeros,
                                 advantages=zeros, mask=torch.tensor([[1.0, 0.0]]), logits=logits)
    p = torch.softmax(logits.detach()[0, 0], -1)
    h = -(p * p.log()).sum().item()  # only token 0 is valid
    assert out.item() == pytest.approx(-0.01 * h)
    assert m["entropy"].item() == pytest.approx(h)
    out.backward()
    assert logits.grad[0, 0].abs().sum() > 0
    assert logits.grad[0, 1].abs().sum() == 0  # the masked token's logits get no gradient


# x = [[1, 2, 3], [4, 0, 0], [9, 9, 9]], mask = [[1, 1, 1], [1, 0, 0], [0, 0, 0]] (third sequence all masked)
AGG_X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]]
AGG_MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
AGG_EXPECTED = {
    "token_mean": (1 + 2 + 3 + 4) / 4,
    "seq_mean_token_mean": (2.0 + 4.0) / 2,  # the all-masked sequence does not count
    "seq_mean_token_sum": (6.0 + 4.0) / 2,
    "seq_mean_token_sum_norm": (6.0 + 4.0) / 2 / 10,  # norm_length = 10
}


@pytest.mark.parametrize("name", list(AGG_EXPECTED))
def test_aggregation_modes_match_their_formulas_and_ignore_all_masked_sequences(name):
    x, mask = torch.tensor(AGG_X, dtype=F64), torch.tensor(AGG_MASK, dtype=F64)
    got = loss.AGGREGATIONS[name](x, mask, Sequences.from_mask(mask), norm_length=10)
    assert got.item() == pytest.approx(AGG_EXPECTED[name])
    assert set(loss.AGGREGATIONS) == set(AGG_EXPECTED)


def test_aggregation_over_packed_sequences_uses_seq_ids():
    x = torch.tensor([[1.0, 3.0, 10.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    seqs = Sequences.from_mask(mask, torch.tensor([[0, 0, 1, 1]]))
    assert loss.AGGREGATIONS["seq_mean_token_mean"](x, mask, seqs).item() == pytest.approx((2.0 + 10.0) / 2)
    assert count_tokens_and_seqs(mask, torch.tensor([[0, 0, 1, 1]])) == (3, 2)


def test_an_entirely_masked_micro_batch_gives_zero_loss_and_zero_gradient_for_every_aggregation():
    for name in loss.AGGREGATIONS:
        logp = torch.zeros(2, 3, requires_grad=True)
        out, m = compute_policy_loss(LossConfig(aggregation=name, norm_length=4), logprobs=logp, old_logprobs=torch.zeros(2, 3),
                                     rollout_logprobs=torch.zeros(2, 3), advantages=torch.ones(2, 3), mask=torch.zeros(2, 3),
                                     num_global_tokens=0, num_global_seqs=0)
        out.backward()
        assert out.item() == 0.0 and (logp.grad == 0).all(), name
        assert all(torch.isfinite(torch.as_tensor(v)) for v in m.values()), name


def _batch():
    torch.manual_seed(1)
    B, T = 5, 6
    lengths = [6, 2, 4, 0, 5]  # row 3 is all masked
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=F64)
    mask[0, 2] = 0  # a tool token in the middle of row 0
    logprobs = -torch.rand(B, T, dtype=F64) * 3
    old = logprobs + 0.3 * torch.randn(B, T, dtype=F64)
    rollout = old + 0.3 * torch.randn(B, T, dtype=F64)
    adv = torch.randn(B, 1, dtype=F64).expand(B, T).clone()
    ref = logprobs + 0.2 * torch.randn(B, T, dtype=F64)
    return logprobs, old, rollout, adv, mask, ref


def _grad(cfg, logprobs, rows, counts, old, rollout, adv, mask, ref):
    lp = logprobs.detach().clone().requires_grad_(True)
    out, _ = compute_policy_loss(cfg, logprobs=lp[rows], old_logprobs=old[rows], rollout_logprobs=rollout[rows],
                                 advantages=adv[rows], mask=mask[rows], ref_logprobs=ref[rows], **counts)
    out.backward()
    return out.detach(), lp.grad


@pytest.mark.parametrize("aggregation", list(loss.AGGREGATIONS))
@pytest.mark.parametrize("policy,correction", [("ppo_clip", "icepop"), ("gspo", "seq_tis_geo"), ("cispo", "tis"),
                                               ("mu_grpo", "seq_mis"), ("reinforce", "none")])
def test_summed_micro_batch_gradients_equal_the_full_batch_gradient_with_global_counts(aggregation, policy, correction):
    logprobs, old, rollout, adv, mask, ref = _batch()
    cfg = LossConfig(aggregation=aggregation, norm_length=8, policy_loss=policy, correction=correction,
                     gspo_clip_low=0.05, gspo_clip_high=0.05, kl_loss_coef=0.05)
    tokens, seqs = count_tokens_and_seqs(mask)
    counts = {"num_global_tokens": tokens, "num_global_seqs": seqs}
    full_loss, full_grad = _grad(cfg, logprobs, slice(0, 5), counts, old, rollout, adv, mask, ref)
    split_loss, split_grad = 0.0, torch.zeros_like(logprobs)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 5)):
        part_loss, part_grad = _grad(cfg, logprobs, rows, counts, old, rollout, adv, mask, ref)
        split_loss, split_grad = split_loss + part_loss, split_grad + part_grad
    assert full_grad.abs().sum() > 0
    assert torch.allclose(split_grad, full_grad, atol=1e-12)
    assert split_loss.item() == pytest.approx(full_loss.item(), abs=1e-12)


def test_without_global_counts_micro_batch_token_means_differ_from_the_full_batch():
    # the reason the counts exist: local token-mean weights a token by 1/(its micro-batch's tokens)
    logprobs, old, rollout, adv, mask, ref = _batch()
    cfg = LossConfig()
    _, full = _grad(cfg, logprobs, slice(0, 5), {}, old, rollout, adv, mask, ref)
    _, a = _grad(cfg, logprobs, slice(0, 1), {}, old, rollout, adv, mask, ref)
    _, b = _grad(cfg, logprobs, slice(1, 5), {}, old, rollout, adv, mask, ref)
    assert not torch.allclose(a + b, full)
