"""The two entry points of the loss math: `compute_advantages` (the controller, once per step) and
`compute_policy_loss` / `compute_loss` (the trainer, once per micro-batch), each picking its methods by name from the
registries through `LossConfig`."""
from __future__ import annotations

import torch

from loss.advantages import ADVANTAGE_ESTIMATORS, gae, whiten
from loss.aggregation import AGGREGATIONS, Sequences, count_tokens_and_seqs
from loss.config import LossConfig
from loss.corrections import (CLIP_REFERENCES, CORRECTIONS, OLD_LOGPROB_SOURCES, apply_correction,
                              ewma_proximal_logprobs, masked_log_ratio, ratio_metrics, resolve_old_logprobs,
                              staleness_weight)
from loss.kl import KL_ESTIMATORS, token_entropy
from loss.policy import POLICY_LOSSES
from loss.presets import PRESETS, IncoherentLossWarning
from loss.sft import SftLossConfig, sft_loss


def compute_loss(cfg: LossConfig | SftLossConfig, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's per-micro-batch loss, by the kind of its config: `compute_policy_loss` for an RL run's
    LossConfig, `sft_loss` (masked cross-entropy) for a `run.mode: sft` run's SftLossConfig."""
    return sft_loss(cfg, **inputs) if isinstance(cfg, SftLossConfig) else compute_policy_loss(cfg, **inputs)


def compute_advantages(cfg: LossConfig, *, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                       values: torch.Tensor | None = None, token_rewards: torch.Tensor | None = None,
                       logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """rewards [N], group_ids [N] (long), mask [N, T] (one row per sample) -> per-token advantages [N, T], 0 where
    mask is 0. Optional: values [N, T] (gae's critic), token_rewards [N, T] (dense per-token rewards added to the
    scalar one), logprobs / ref_logprobs [N, T] (KL reward penalty when cfg.kl_reward_coef > 0).
    """
    extra = token_rewards.to(torch.float64) if token_rewards is not None else None
    if cfg.kl_reward_coef > 0:
        if logprobs is None or ref_logprobs is None:
            raise ValueError("loss.kl_reward_coef > 0 needs logprobs= and ref_logprobs= in compute_advantages "
                             "(or set kl_reward_coef: 0)")
        kl = KL_ESTIMATORS[cfg.kl_estimator](logprobs.detach().to(torch.float64), ref_logprobs.detach().to(torch.float64))
        penalty = -cfg.kl_reward_coef * torch.where(mask > 0, kl, 0.0)
        extra = penalty if extra is None else extra + penalty
    adv = ADVANTAGE_ESTIMATORS[cfg.advantage_estimator](
        cfg, rewards=rewards, group_ids=group_ids, mask=mask, extra_token_rewards=extra, values=values
    )
    if cfg.whiten_advantages:
        adv = whiten(adv, mask, std_floor=cfg.std_floor)
    out_dtype = mask.dtype if mask.is_floating_point() else torch.float32
    return (adv * (mask > 0)).to(out_dtype)


def compute_policy_loss(
    cfg: LossConfig,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_global_tokens: float | None = None,
    num_global_seqs: float | None = None,
    seq_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ewma_logprobs: torch.Tensor | None = None,
    proximal_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss. All per-token inputs are [B, T]; returns (scalar loss, metrics incl. "clipfrac").

    Total ratio pi_theta / pi_rollout = rho (old / rollout: cfg.correction, thresholds correction_low/high) times
    r (pi_theta / old: cfg.policy_loss's clip). Pass num_global_tokens / num_global_seqs (see
    count_tokens_and_seqs, summed over micro-batches and ranks) to make summed micro-batch gradients equal the full
    batch's. Metrics: ratios and fractions are means over this micro-batch's valid tokens; "pg_loss" is this
    micro-batch's share of the policy term (shares sum to the batch's). seq_ids [B, T] marks packed sequences (default:
    one per row). ewma_logprobs [B, T] is PPO-EWMA's state before this evaluation (default: the rollout logprobs); the
    proximal policy used, which is the state to carry to the sample's next evaluation, is
    `ewma_proximal_logprobs(state=ewma_logprobs, logprobs=logprobs, beta=cfg.ewma_beta)`.

    Which policy the clip is against (docs/async.md, "The objective of each combination"): `old_logprobs` from
    `trainer.old_logprobs: recompute` are the proximal policy (the weights before this update), so r = pi_theta /
    pi_prox and rho = pi_prox / pi_rollout is decoupled PPO's behaviour weight. `snapshot` old logprobs are the
    behaviour policy itself at each token's version; pass the proximal ones beside them as `proximal_logprobs` [B, T]
    and, with cfg.clip_against "proximal" (the default), the loss is decoupled in three factors:
    pi_theta / pi_rollout = r (pi_theta / pi_prox, clipped) x s (pi_prox / pi_snapshot, truncated at
    cfg.stale_weight_high) x rho (pi_snapshot / pi_rollout, cfg.correction). Without them (or with clip_against
    "behaviour") the clip is against the snapshot: coupled PPO against the stale policy.
    """
    mask = mask.to(logprobs.dtype)
    valid = mask > 0
    advantages = torch.where(valid, advantages.to(logprobs.dtype), 0.0)
    seqs = Sequences.from_mask(mask, seq_ids)
    old = resolve_old_logprobs(cfg, logprobs=logprobs, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
                               mask=mask, ewma_logprobs=ewma_logprobs)
    weight, metrics = apply_correction(cfg, old_logprobs=old, rollout_logprobs=rollout_logprobs, mask=mask, seqs=seqs)
    clip_ref = old
    if proximal_logprobs is not None:
        if cfg.old_logprobs_from != "given":
            raise ValueError(f"proximal_logprobs were passed with loss.old_logprobs_from={cfg.old_logprobs_from!r}, "
                             "whose proximal policy is its own; pass them only beside given (snapshot) old logprobs")
        if cfg.clip_against == "proximal":
            clip_ref = proximal_logprobs.detach()
            stale, stale_metrics = staleness_weight(clip_ref, old, mask, high=cfg.stale_weight_high)
            weight = weight * stale
            metrics.update(stale_metrics)
    per_token, policy_metrics = POLICY_LOSSES[cfg.policy_loss](
        cfg, logprobs=logprobs, old_logprobs=clip_ref, advantages=advantages, mask=mask, seqs=seqs
    )
    metrics.update(policy_metrics)
    metrics["staleness/clipfrac"] = policy_metrics["clipfrac"]
    metrics.update(ratio_metrics("staleness", masked_log_ratio(logprobs.detach(), clip_ref, mask), mask))
    aggregate = AGGREGATIONS[cfg.aggregation]
    counts = dict(num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs, norm_length=cfg.norm_length)
    loss = aggregate(per_token * weight.to(per_token.dtype), mask, seqs, **counts)
    metrics["pg_loss"] = loss.detach()
    loss = loss + _kl_term(cfg, logprobs, ref_logprobs, mask, seqs, counts, metrics)
    loss = loss - _entropy_term(cfg, logits, entropy, mask, seqs, counts, metrics)
    return loss, metrics


def _local_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def _kl_term(cfg, logprobs, ref_logprobs, mask, seqs, counts, metrics) -> torch.Tensor | float:
    """cfg.kl_loss_coef * aggregated KL(pi_theta || pi_ref); the "kl" metric whenever ref_logprobs is given."""
    if ref_logprobs is None:
        if cfg.kl_loss_coef > 0:
            raise ValueError("loss.kl_loss_coef > 0 needs ref_logprobs= (reference-model logprobs) in compute_policy_loss")
        return 0.0
    with torch.set_grad_enabled(cfg.kl_loss_coef > 0 and torch.is_grad_enabled()):
        kl = torch.where(mask > 0, KL_ESTIMATORS[cfg.kl_estimator](logprobs, ref_logprobs.detach()), 0.0)
    metrics["kl"] = _local_mean(kl, mask)
    return cfg.kl_loss_coef * AGGREGATIONS[cfg.aggregation](kl, mask, seqs, **counts) if cfg.kl_loss_coef > 0 else 0.0


def _entropy_term(cfg, logits, entropy, mask, seqs, counts, metrics) -> torch.Tensor | float:
    """cfg.entropy_coef * aggregated entropy (from `entropy` [B, T] or `logits` [B, T, V]); "entropy" metric."""
    if entropy is None and logits is not None:
        with torch.set_grad_enabled(cfg.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = token_entropy(logits)
    if entropy is None:
        if cfg.entropy_coef > 0:
            raise ValueError("loss.entropy_coef > 0 needs logits= [B, T, V] or entropy= [B, T] in compute_policy_loss")
        return 0.0
    ent = torch.where(mask > 0, entropy.to(mask.dtype), 0.0)
    metrics["entropy"] = _local_mean(ent, mask)
    return cfg.entropy_coef * AGGREGATIONS[cfg.aggregation](ent, mask, seqs, **counts) if cfg.entropy_coef > 0 else 0.0
