"""KL estimators against a reference policy and the entropy of the policy, per token [B, T].

Used as loss terms inside `compute_policy_loss` (kl_loss_coef, entropy_coef) or as a reward penalty inside
`compute_advantages` (kl_reward_coef). Estimators follow Schulman's "Approximating KL divergence" note.
"""
from __future__ import annotations

from typing import Callable

import torch

# Log-ratios are clamped to this before exp() so that far-apart policies give large but finite values.
LOG_RATIO_LIMIT = 20.0


def _log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log pi_ref - log pi_theta, clamped to +-LOG_RATIO_LIMIT (also turns -inf logprobs into finite values)."""
    return (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref: unbiased, can be negative per token."""
    return -_log_ratio(logprobs, ref_logprobs)


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2: non-negative, biased, low variance."""
    return 0.5 * _log_ratio(logprobs, ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = pi_ref/pi - log(pi_ref/pi) - 1: unbiased, non-negative, low variance (GRPO's KL)."""
    d = _log_ratio(logprobs, ref_logprobs)
    return torch.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last (vocabulary) dim: [B, T, V] -> [B, T].

    H = logsumexp(z) - sum softmax(z) * z, computed in float32 or wider; finite for any finite logits.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    log_p = torch.log_softmax(z, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)
