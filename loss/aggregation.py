"""Per-token values [B, T] -> one scalar: the last step of every loss term (policy loss, KL, entropy).

Sequences are rows of [B, T] unless `seq_ids` says otherwise (packed rows). With global token / sequence counts
passed in, summing the micro-batch results gives exactly the full-batch result, so gradients do not depend on how a
batch is split into micro-batches or data-parallel ranks. A sequence must not be split across micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Sequences:
    """Which sequence each token belongs to: `index` [B, T] in 0..count-1 (masked tokens point at a real slot)."""

    index: torch.Tensor  # long [B, T]
    count: int  # sequences in this micro-batch, including ones whose tokens are all masked
    valid: torch.Tensor  # bool [count]: the sequence has at least one token with mask > 0

    @classmethod
    def from_mask(cls, mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> "Sequences":
        """One sequence per row, or per distinct value of `seq_ids` [B, T] (packed rows; masked entries ignored)."""
        B, T = mask.shape
        if seq_ids is None:
            index = torch.arange(B, device=mask.device)[:, None].expand(B, T)
            count = B
        else:
            if seq_ids.shape != mask.shape:
                raise ValueError(f"seq_ids has shape {tuple(seq_ids.shape)} but mask has {tuple(mask.shape)}; pass one id per token")
            ids = torch.where(mask > 0, seq_ids.long(), seq_ids.long().max() + 1 if seq_ids.numel() else 0)
            _, index = torch.unique(ids, return_inverse=True)
            count = int(index.max()) + 1 if index.numel() else 0
        tokens = sequence_sum((mask > 0).to(torch.float32), index, count)
        return cls(index=index, count=count, valid=tokens > 0)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums [count] of a per-token tensor [B, T] (the caller masks it)."""
        return sequence_sum(x, self.index, self.count)

    def spread(self, per_seq: torch.Tensor) -> torch.Tensor:
        """A per-sequence value [count] broadcast back to its tokens [B, T]."""
        return per_seq[self.index]


def sequence_sum(x: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    out = torch.zeros(count, dtype=x.dtype, device=x.device)
    return out.index_add(0, index.reshape(-1), x.reshape(-1))


def count_tokens_and_seqs(mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> tuple[int, int]:
    """The counts to sum over micro-batches and ranks and pass back as num_global_tokens / num_global_seqs.

    A token counts where mask > 0; a sequence counts when it has at least one such token.
    """
    seqs = Sequences.from_mask(mask, seq_ids)
    return int((mask > 0).sum()), int(seqs.valid.sum())


def _denominator(local: torch.Tensor | float, given: float | int | torch.Tensor | None) -> torch.Tensor | float:
    """The global count when the caller passed one, else this micro-batch's own (at least 1, so empty -> 0 loss)."""
    if given is not None:
        if float(given) <= 0:
            return 1.0  # an empty global batch: every numerator is 0 too
        return given
    return local.clamp(min=1) if isinstance(local, torch.Tensor) else max(local, 1)


def token_mean(x, mask, seqs, *, num_global_tokens=None, num_global_seqs=None, norm_length=None):
    """sum over all valid tokens / number of valid tokens in the whole (global) batch."""
    return (x * mask).sum() / _denominator((mask > 0).sum().to(x.dtype), num_global_tokens)


def seq_mean_token_mean(x, mask, seqs, *, num_global_tokens=None, num_global_seqs=None, norm_length=None):
    """mean over sequences of (mean over the sequence's valid tokens)."""
    tokens = seqs.sum((mask > 0).to(x.dtype)).clamp(min=1)
    per_seq = seqs.sum(x * mask) / tokens
    return per_seq.sum() / _denominator(seqs.valid.sum().to(x.dtype), num_global_seqs)


def seq_mean_token_sum(x, mask, seqs, *, num_global_tokens=None, num_global_seqs=None, norm_length=None):
    """mean over sequences of (sum over the sequence's valid tokens)."""
    return seqs.sum(x * mask).sum() / _denominator(seqs.valid.sum().to(x.dtype), num_global_seqs)


def seq_mean_token_sum_norm(x, mask, seqs, *, num_global_tokens=None, num_global_seqs=None, norm_length=None):
    """Dr.GRPO: sum over sequences and tokens / (number of sequences * a constant length, the generation budget)."""
    if norm_length is None:
        raise ValueError("aggregation seq_mean_token_sum_norm needs norm_length: set loss.norm_length to the rollout's max new tokens")
    return seq_mean_token_sum(x, mask, seqs, num_global_seqs=num_global_seqs) / norm_length


Aggregation = Callable[..., torch.Tensor]

AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}
