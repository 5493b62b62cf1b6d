"""LossConfig defaults and validation, registry coverage, and the import-hygiene rule for `loss`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loss
from loss import LossConfig

REPO = Path(__file__).resolve().parents[1]


def test_default_config_is_grpo_with_ppo_clip_02_02_and_token_mean_and_no_correction():
    cfg = LossConfig()
    assert (cfg.advantage_estimator, cfg.normalize_std) == ("grpo", True)
    assert (cfg.policy_loss, cfg.clip_low, cfg.clip_high, cfg.dual_clip) == ("ppo_clip", 0.2, 0.2, None)
    assert (cfg.aggregation, cfg.correction, cfg.old_logprobs_from) == ("token_mean", "none", "given")
    assert (cfg.kl_loss_coef, cfg.kl_reward_coef, cfg.entropy_coef) == (0.0, 0.0, 0.0)
    assert cfg.needs_old_logprobs


@pytest.mark.parametrize("field,typo,suggestion", [
    ("advantage_estimator", "rlo", "rloo"),
    ("policy_loss", "ppo_clp", "ppo_clip"),
    ("correction", "icepopp", "icepop"),
    ("old_logprobs_from", "ewm", "ewma"),
    ("kl_estimator", "k_3", "k3"),
    ("aggregation", "seq_mean_tokn_mean", "seq_mean_token_mean"),
])
def test_an_unknown_method_name_raises_naming_the_field_and_the_closest_name(field, typo, suggestion):
    with pytest.raises(ValueError) as err:
        LossConfig(**{field: typo})
    msg = str(err.value)
    assert f"loss.{field}" in msg and "did you mean" in msg and suggestion in msg


@pytest.mark.parametrize("field,value", [
    ("clip_low", 1.5), ("clip_high", -0.1), ("dual_clip", 1.0), ("correction_low", 0.0), ("correction_high", 0.9),
    ("gamma", 1.1), ("gae_lambda", -0.1), ("ewma_beta", 1.0), ("std_floor", 0.0), ("kl_loss_coef", -1.0),
    ("entropy_coef", -1.0), ("cispo_clip_low", 2.0), ("mu_clip_high", -1.0), ("gspo_clip_low", 1.5),
    ("veto_ratio", 0.0), ("norm_length", 0),
])
def test_out_of_range_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"loss.{field} must be"):
        LossConfig(**{field: value})


def test_seq_mean_token_sum_norm_needs_a_constant_length():
    with pytest.raises(ValueError, match="norm_length"):
        LossConfig(aggregation="seq_mean_token_sum_norm")
    assert LossConfig(aggregation="seq_mean_token_sum_norm", norm_length=512).norm_length == 512


def test_every_registry_name_is_accepted_by_the_config_and_runs_end_to_end():
    rewards, groups, mask = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), torch.ones(3, 4)
    for name in loss.ADVANTAGE_ESTIMATORS:
        adv = loss.compute_advantages(LossConfig(advantage_estimator=name), rewards=rewards, group_ids=groups,
                                      mask=mask, values=torch.zeros(3, 4))
        assert adv.shape == (3, 4), name
    lp = torch.full((3, 4), -1.0, requires_grad=True)
    for key, names in (("policy_loss", loss.POLICY_LOSSES), ("correction", loss.CORRECTIONS),
                       ("kl_estimator", loss.KL_ESTIMATORS), ("aggregation", loss.AGGREGATIONS),
                       ("old_logprobs_from", loss.OLD_LOGPROB_SOURCES)):
        for name in names:
            cfg = LossConfig(**{key: name}, norm_length=4, kl_loss_coef=0.1)
            out, metrics = loss.compute_policy_loss(cfg, logprobs=lp, old_logprobs=lp.detach() - 0.1,
                                                    rollout_logprobs=lp.detach() - 0.2, advantages=adv, mask=mask,
                                                    ref_logprobs=lp.detach() + 0.1)
            assert out.shape == () and "clipfrac" in metrics, (key, name)


def test_importing_loss_imports_no_ray_sglang_or_megatron():
    code = ("import sys, loss; bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'sglang', 'megatron'));"
            " print(bad); sys.exit(1 if bad else 0)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
