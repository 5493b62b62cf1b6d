"""Pure tensor math for RL losses (imports only torch).

PLACEHOLDER first form, to be replaced by the full registry-based library (issue 3).
The two entry points below and their keyword signatures are the contract the trainer codes against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class LossConfig:
    advantage_estimator: str = "grpo"  # name in ADVANTAGE_ESTIMATORS
    policy_loss: str = "ppo_clip"  # name in POLICY_LOSSES
    clip_low: float = 0.2  # ratio lower bound is 1 - clip_low
    clip_high: float = 0.2  # ratio upper bound is 1 + clip_high
    aggregation: str = "token_mean"  # name in AGGREGATIONS
    normalize_std: bool = True  # GRPO: divide by the group std


def compute_advantages(cfg: LossConfig, *, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rewards [N], group_ids [N] (long), mask [N, T] -> per-token advantages [N, T] (0 where mask is 0)."""
    adv = torch.zeros_like(rewards, dtype=torch.float)
    for g in group_ids.unique():
        sel = group_ids == g
        r = rewards[sel].float()
        a = r - r.mean()
        if cfg.normalize_std and r.numel() > 1:
            a = a / (r.std() + 1e-6)
        adv[sel] = a
    return adv[:, None] * mask


def compute_policy_loss(
    cfg: LossConfig,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_global_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """All inputs [B, T]; returns (scalar loss, metrics). Metrics include 'clipfrac'."""
    log_ratio = (logprobs - old_logprobs).clamp(-20, 20)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    denom = num_global_tokens if num_global_tokens is not None else mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipfrac = (((ratio - clipped).abs() > 0).float() * mask).sum() / n
    return loss, {"clipfrac": clipfrac}
