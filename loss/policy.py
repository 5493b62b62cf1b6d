"""Policy losses on the staleness ratio r = pi_theta / pi_old: per-token loss [B, T] (0 on masked tokens) + metrics.

`compute_policy_loss` multiplies the result by the discrepancy weights (corrections.py) and aggregates it
(aggregation.py). Every function here has the signature (cfg, *, logprobs, old_logprobs, advantages, mask, seqs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from loss.aggregation import Sequences
from loss.corrections import masked_log_ratio
from loss.kl import LOG_RATIO_LIMIT

if TYPE_CHECKING:
    from loss.config import LossConfig


def _frac(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    valid = mask > 0
    return ((flags & valid).sum() / valid.sum().clamp(min=1)).to(torch.float32)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, *, low: float, high: float,
                      dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO: max(-A r, -A clip(r, 1-low, 1+high)); with dual-clip c, tokens with A < 0 are also capped at -c A.

    Returns (per-token loss, clipped flags, dual-clipped flags). A ratio exactly on a bound is not clipped.
    """
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - low, 1 + high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    is_dual = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        is_dual = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return loss, is_clipped | is_dual, is_dual


def ppo_clip(cfg: "LossConfig", *, logprobs, old_logprobs, advantages, mask, seqs):
    """PPO clip with asymmetric bounds (clip-higher / DAPO: clip_high > clip_low) and optional dual-clip."""
    ratio = masked_log_ratio(logprobs, old_logprobs, mask).exp()
    loss, clipped, dual = clipped_surrogate(ratio, advantages, low=cfg.clip_low, high=cfg.clip_high, dual_clip=cfg.dual_clip)
    metrics = {"clipfrac": _frac(clipped, mask)}
    if cfg.dual_clip is not None:
        metrics["dual_clipfrac"] = _frac(dual, mask)
    return torch.where(mask > 0, loss, 0.0), metrics


def gspo(cfg: "LossConfig", *, logprobs, old_logprobs, advantages, mask, seqs: Sequences):
    """GSPO: s_i = exp(mean_t log r_{i,t}) per sequence, clipped to [1 - gspo_clip_low, 1 + gspo_clip_high].

    Token form s_{i,t} = sg(s_i) * pi_theta(t) / sg(pi_theta(t)): equal in value to s_i, with GSPO's gradient under
    seq_mean_token_mean aggregation, and it allows per-token advantages.
    """
    valid = mask > 0
    log_r = masked_log_ratio(logprobs, old_logprobs, mask)
    seq_log_r = seqs.sum(log_r) / seqs.sum(valid.to(log_r.dtype)).clamp(min=1)
    lp = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    tok_log_s = seqs.spread(seq_log_r).detach() + lp - lp.detach()
    s = tok_log_s.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    loss, clipped, _ = clipped_surrogate(s, advantages, low=cfg.gspo_clip_low, high=cfg.gspo_clip_high)
    return torch.where(valid, loss, 0.0), {"clipfrac": _frac(clipped, mask)}


def cispo(cfg: "LossConfig", *, logprobs, old_logprobs, advantages, mask, seqs):
    """CISPO: -sg(clip(r, 1 - cispo_clip_low, 1 + cispo_clip_high)) * A * log pi_theta: every token keeps a gradient."""
    valid = mask > 0
    ratio = masked_log_ratio(logprobs, old_logprobs, mask).exp().detach()
    weight = ratio.clamp(1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high)
    lp = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    loss = -weight * advantages * lp
    return torch.where(valid, loss, 0.0), {"clipfrac": _frac(weight != ratio, mask)}


def negative_advantage_veto(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, seqs: Sequences, *, trigger_ratio: float) -> torch.Tensor:
    """Mu-GRPO's veto: in a negative-advantage response, the first token with r > trigger_ratio and every later token
    of the same sequence are vetoed. Returns bool [B, T]."""
    valid = mask > 0
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    trigger = valid & (adv < 0) & (ratio > trigger_ratio)
    big = torch.full((seqs.count,), T, dtype=torch.long, device=mask.device)
    first = big.scatter_reduce(0, seqs.index.reshape(-1), torch.where(trigger, pos, T).reshape(-1), "amin")
    return valid & (adv < 0) & (pos >= seqs.spread(first))


def mu_grpo(cfg: "LossConfig", *, logprobs, old_logprobs, advantages, mask, seqs: Sequences):
    """Mu-GRPO: relaxed clip [1 - mu_clip_low, 1 + mu_clip_high] plus the negative-advantage veto."""
    ratio = masked_log_ratio(logprobs, old_logprobs, mask).exp()
    loss, clipped, _ = clipped_surrogate(ratio, advantages, low=cfg.mu_clip_low, high=cfg.mu_clip_high)
    veto = negative_advantage_veto(ratio.detach(), advantages, mask, seqs, trigger_ratio=cfg.veto_ratio)
    loss = torch.where((mask > 0) & ~veto, loss, 0.0)
    return loss, {"clipfrac": _frac(clipped & ~veto, mask), "mu_grpo/veto_frac": _frac(veto, mask)}


def reinforce(cfg: "LossConfig", *, logprobs, old_logprobs, advantages, mask, seqs):
    """Plain REINFORCE / on-policy gradient: -A * log pi_theta (no ratio, no clip)."""
    valid = mask > 0
    lp = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    return torch.where(valid, -advantages * lp, 0.0), {"clipfrac": _frac(torch.zeros_like(valid), mask)}


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
    "mu_grpo": mu_grpo,
    "reinforce": reinforce,
}
