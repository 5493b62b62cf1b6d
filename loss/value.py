"""The critic's math for `advantage_estimator: gae`: the critic's per-token values and the scalar rewards -> GAE
advantages (what the policy trains on) and returns (what the critic trains toward), and PPO's clipped value loss.
The trainer's critic (glue/trainer/critic.py) calls both once per step; pure torch, all per-token tensors [B, T].
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loss.advantages import gae, terminal_token_rewards, whiten

if TYPE_CHECKING:
    from loss.config import LossConfig


def gae_targets(cfg: "LossConfig", *, rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [B] (on each row's last valid token), values [B, T] (the critic before its update), mask [B, T] ->
    (advantages, returns), both [B, T] float32 and 0 where mask is 0. GAE with cfg.gamma and cfg.gae_lambda;
    returns = advantages + values (before whitening: the critic's targets); the advantages are then whitened over
    the batch's valid tokens when cfg.whiten_advantages."""
    token_rewards = terminal_token_rewards(rewards, mask)
    advantages, returns = gae(token_rewards, values.detach(), mask, gamma=cfg.gamma, lam=cfg.gae_lambda)
    if cfg.whiten_advantages:
        advantages = whiten(advantages, mask, std_floor=cfg.std_floor)
    valid = mask > 0
    return (advantages * valid).float(), (returns * valid).float()


def clipped_value_loss(values: torch.Tensor, *, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip: float | None, num_global_tokens: float | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's value loss: 0.5 * max((V - R)^2, (V_clip - R)^2) per token, V_clip = V_old + clamp(V - V_old, -clip,
    clip) (clip None: the plain squared error), summed over valid tokens and divided by `num_global_tokens` (default:
    this call's valid tokens), so summed micro-batch losses are the batch's token mean.

    Metrics: "value_loss" (this call's share of the batch loss), "value_clipfrac" (share of valid tokens whose clipped
    error was the larger, i.e. whose gradient the clip stopped), both detached."""
    mask = mask.to(values.dtype)
    error = (values - returns) ** 2
    if clip is None:
        per_token, clipped = 0.5 * error, torch.zeros_like(error, dtype=torch.bool)
    else:
        moved = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped_error = (moved - returns) ** 2
        per_token, clipped = 0.5 * torch.maximum(error, clipped_error), clipped_error > error
    count = float(num_global_tokens) if num_global_tokens is not None else float(mask.sum().clamp(min=1))
    loss = (per_token * mask).sum() / max(count, 1.0)
    local = mask.sum().clamp(min=1)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": ((clipped * mask).sum() / local).detach()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the valid tokens: 1 for a perfect critic, 0 for one that predicts the mean,
    negative for worse; 0 when the returns do not vary."""
    valid = mask > 0
    r, v = returns[valid].double(), values[valid].double()
    if r.numel() < 2 or float(r.var()) == 0.0:
        return 0.0
    return float(1 - (r - v).var() / r.var())
