"""Supervised fine-tuning's loss: the cross-entropy of the data's own next tokens, only where the mask is 1 (the
assistant's tokens of a chat), aggregated like the RL losses so summed micro-batch gradients equal the batch's.
The trainer calls it in place of `compute_policy_loss` when its loss config is an `SftLossConfig`. Imports only
torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from loss.aggregation import Sequences

SFT_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


@dataclass(kw_only=True)
class SftLossConfig:
    """The loss of a `run.mode: sft` run (built from the `sft:` section by glue.sft.config)."""

    aggregation: str = "token_mean"  # token_mean: every trained token weighs the same; seq_mean_token_mean: every conversation weighs the same

    # What the trainer (glue.trainer.worker) asks of any loss config: SFT trains on the data's tokens, so it needs
    # no old, proximal, reference or EWMA logprobs, adds no entropy or KL term and has no critic.
    needs_old_logprobs: ClassVar[bool] = False
    needs_proximal_logprobs: ClassVar[bool] = False
    old_logprobs_from: ClassVar[str] = "data"
    entropy_coef: ClassVar[float] = 0.0
    kl_loss_coef: ClassVar[float] = 0.0
    kl_reward_coef: ClassVar[float] = 0.0
    uses_critic: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.aggregation not in SFT_AGGREGATIONS:
            raise ValueError(f"sft.aggregation must be one of {list(SFT_AGGREGATIONS)}, got {self.aggregation!r}")


def sft_loss(cfg: SftLossConfig, *, logprobs: torch.Tensor, mask: torch.Tensor, num_global_tokens: float | None = None,
             num_global_seqs: float | None = None, seq_ids: torch.Tensor | None = None,
             **rl_inputs: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's SFT loss: -logprobs aggregated over the tokens where mask > 0.

    logprobs [B, T]: log p(token t+1 | tokens <= t) under the model (differentiable); mask [B, T]: 1 where token t+1
    is trained (an assistant token), 0 elsewhere (system / user / tool turns, template tokens, padding). A masked
    position contributes nothing, not even NaN or inf from its logprob, and gets a zero gradient. seq_ids [B, T]
    marks packed conversations (default: one per row); num_global_tokens / num_global_seqs are the batch's counts
    (loss.count_tokens_and_seqs summed over micro-batches and ranks), as in `compute_policy_loss`. `rl_inputs`
    (old / rollout logprobs, advantages, ... that the trainer passes every loss) are not read.

    Returns (loss, metrics): "nll" is this micro-batch's mean negative log-likelihood per trained token.
    """
    valid = mask > 0
    nll = torch.where(valid, -logprobs, torch.zeros_like(logprobs))
    weights = valid.to(logprobs.dtype)
    seqs = Sequences.from_mask(weights, seq_ids)
    if cfg.aggregation == "token_mean":
        denominator = num_global_tokens if num_global_tokens is not None else weights.sum().clamp(min=1)
        loss = nll.sum() / max(float(denominator), 1.0)
    else:
        per_seq = seqs.sum(nll) / seqs.sum(weights).clamp(min=1)
        denominator = num_global_seqs if num_global_seqs is not None else seqs.valid.sum()
        loss = per_seq.sum() / max(float(denominator), 1.0)
    return loss, {"nll": (nll.sum() / weights.sum().clamp(min=1)).detach()}
