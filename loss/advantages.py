"""Advantage estimators: rewards (per sample, or per token) + group ids + mask -> per-token advantages [N, T].

The controller calls `compute_advantages` once per training step on the whole step's samples (rows = samples);
the result is packed into the TrainBatch. Advantages are 0 wherever the mask is 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from loss.config import LossConfig


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, group unbiased std, group size, group is flat) for values [N], all [N]."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    v = values.to(torch.float64)
    size = torch.zeros(G, dtype=torch.float64).index_add(0, inv, torch.ones_like(v))
    mean = torch.zeros(G, dtype=torch.float64).index_add(0, inv, v) / size
    sq = torch.zeros(G, dtype=torch.float64).index_add(0, inv, (v - mean[inv]) ** 2)
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    vmax = torch.full((G,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, v, "amax")
    vmin = torch.full((G,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, v, "amin")
    return mean[inv], std[inv], size[inv], (vmax == vmin)[inv]


def grpo_scalar(rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool, std_floor: float) -> torch.Tensor:
    """A_i = (r_i - mean_group(r)) / max(std_group(r), floor), or without the division; 0 for a flat group."""
    mean, std, _, flat = group_stats(rewards, group_ids)
    adv = rewards.to(torch.float64) - mean
    if normalize_std:
        adv = adv / std.clamp(min=std_floor)
    return torch.where(flat, torch.zeros_like(adv), adv)


def rloo_scalar(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean); a lone sample has no baseline and gets 0."""
    mean, _, size, flat = group_stats(rewards, group_ids)
    adv = (rewards.to(torch.float64) - mean) * size / (size - 1).clamp(min=1)
    return torch.where(flat | (size < 2), torch.zeros_like(adv), adv)


def whiten(x: torch.Tensor, mask: torch.Tensor, *, std_floor: float) -> torch.Tensor:
    """(x - mean) / max(std, floor) over the valid tokens of the whole batch; 0 if they are all equal."""
    valid = mask > 0
    if not valid.any():
        return torch.zeros_like(x)
    vals = x[valid].to(torch.float64)
    if bool(vals.max() == vals.min()):
        return torch.zeros_like(x)
    std = vals.std() if vals.numel() > 1 else vals.new_tensor(0.0)
    out = (x.to(torch.float64) - vals.mean()) / std.clamp(min=std_floor)
    return (out * valid).to(x.dtype)


def terminal_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar rewards [N] placed on each row's last valid token -> [N, T] (all-masked rows get nothing)."""
    valid = mask > 0
    T = mask.shape[1]
    last = torch.where(valid, torch.arange(T, device=mask.device), -1).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards.to(torch.float64)[rows]
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{next valid t}; masked tokens (tool output) are skipped and get 0."""
    out = torch.zeros_like(token_rewards, dtype=torch.float64)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float64, device=token_rewards.device)
    valid = mask > 0
    for t in reversed(range(token_rewards.shape[1])):
        updated = token_rewards[:, t].to(torch.float64) + gamma * running
        running = torch.where(valid[:, t], updated, running)
        out[:, t] = torch.where(valid[:, t], running, 0.0)
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each row -> (advantages, returns), both [N, T].

    delta_t = r_t + gamma V_{t'} - V_t with t' the next valid token (V = 0 after the last);
    A_t = delta_t + gamma lam A_{t'}; returns = A + V. Masked tokens are skipped and get 0.
    """
    N, T = mask.shape
    adv = torch.zeros(N, T, dtype=torch.float64, device=mask.device)
    next_value = torch.zeros(N, dtype=torch.float64, device=mask.device)
    next_adv = torch.zeros_like(next_value)
    valid = mask > 0
    for t in reversed(range(T)):
        v = values[:, t].to(torch.float64)
        delta = token_rewards[:, t].to(torch.float64) + gamma * next_value - v
        a = delta + gamma * lam * next_adv
        next_adv = torch.where(valid[:, t], a, next_adv)
        next_value = torch.where(valid[:, t], v, next_value)
        adv[:, t] = torch.where(valid[:, t], a, 0.0)
    returns = (adv + values.to(torch.float64)) * valid
    return adv, returns


def _per_token(scalar: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scalar[:, None] * (mask > 0)


def _with_extra(rewards: torch.Tensor, extra: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Scalar estimators see the total reward of a row: its scalar reward plus the sum of its per-token terms."""
    return rewards.to(torch.float64) if extra is None else rewards.to(torch.float64) + (extra * (mask > 0)).sum(1)


def _token_rewards(rewards: torch.Tensor, extra: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards for token-level estimators: the scalar on the last valid token plus the per-token terms."""
    out = terminal_token_rewards(rewards, mask)
    return out if extra is None else out + extra.to(torch.float64) * (mask > 0)


def grpo(cfg: "LossConfig", *, rewards, group_ids, mask, extra_token_rewards=None, values=None):
    """GRPO (DeepSeekMath): group-relative reward, optionally divided by the group std (cfg.normalize_std)."""
    r = _with_extra(rewards, extra_token_rewards, mask)
    return _per_token(grpo_scalar(r, group_ids, normalize_std=cfg.normalize_std, std_floor=cfg.std_floor), mask)


def dr_grpo(cfg: "LossConfig", *, rewards, group_ids, mask, extra_token_rewards=None, values=None):
    """Dr.GRPO: group mean baseline, no std division (pair it with seq_mean_token_sum_norm aggregation)."""
    r = _with_extra(rewards, extra_token_rewards, mask)
    return _per_token(grpo_scalar(r, group_ids, normalize_std=False, std_floor=cfg.std_floor), mask)


def rloo(cfg: "LossConfig", *, rewards, group_ids, mask, extra_token_rewards=None, values=None):
    """RLOO: leave-one-out group baseline."""
    return _per_token(rloo_scalar(_with_extra(rewards, extra_token_rewards, mask), group_ids), mask)


def reinforce_pp(cfg: "LossConfig", *, rewards, group_ids, mask, extra_token_rewards=None, values=None):
    """REINFORCE++: discounted return per token, whitened over all valid tokens of the batch."""
    returns = discounted_returns(_token_rewards(rewards, extra_token_rewards, mask), mask, gamma=cfg.gamma)
    return whiten(returns, mask, std_floor=cfg.std_floor)


def reinforce_pp_baseline(cfg: "LossConfig", *, rewards, group_ids, mask, extra_token_rewards=None, values=None):
    """REINFORCE++-baseline: subtract the group-mean scalar reward first, then as REINFORCE++ (global whitening)."""
    centred = grpo_scalar(rewards, group_ids, normalize_std=False, std_floor=cfg.std_floor)
    returns = discounted_returns(_token_rewards(centred, extra_token_rewards, mask), mask, gamma=cfg.gamma)
    return whiten(returns, mask, std_floor=cfg.std_floor)


def gae_advantages(cfg: "LossConfig", *, rewards, group_ids, mask, extra_token_rewards=None, values=None):
    """GAE with a critic's per-token values (cfg.gamma, cfg.gae_lambda)."""
    if values is None:
        raise ValueError("advantage_estimator 'gae' needs values=[N, T] from a critic; pass values= or pick grpo/rloo")
    token_rewards = _token_rewards(rewards, extra_token_rewards, mask)
    adv, _ = gae(token_rewards, values, mask, gamma=cfg.gamma, lam=cfg.gae_lambda)
    return adv


AdvantageEstimator = Callable[..., torch.Tensor]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gae": gae_advantages,
}
