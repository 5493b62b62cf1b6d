"""Batches of spread response lengths for the packing and balancing tests, and the loss settings they train with."""
from __future__ import annotations

import torch

from glue.types import Sample, TrainBatch

# 6..60 tokens: lengths spread 10x, as agent rollouts are
PROMPT_LEN = 3
RESPONSE_LENS = [57, 3, 20, 9, 41, 5, 14, 30]
# sequence-level ratio and aggregation, KL to a reference model and an entropy bonus: every per-sequence and
# per-token input of the loss goes through the packing
LOSS = dict(policy_loss="gspo", aggregation="seq_mean_token_mean", kl_loss_coef=0.05, entropy_coef=0.01)


def spread_batch(response_lens: list[int] = RESPONSE_LENS, seed: int = 5) -> TrainBatch:
    """Samples of random tokens with the given response lengths, rewards 0, 1, ... (advantage = reward - mean)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(response_lens):
        tokens = torch.randint(2, 32, (PROMPT_LEN + n,), generator=gen).tolist()
        s = Sample(prompt_tokens=tokens[:PROMPT_LEN], reward=float(i), index=i)
        s.append_response(tokens[PROMPT_LEN:], (-1.0 - torch.rand(n, generator=gen)).tolist(), version=0)
        samples.append(s)
    mean = (len(samples) - 1) / 2
    return TrainBatch.from_samples(samples, [float(i) - mean for i in range(len(samples))])


def real_positions(batch: TrainBatch) -> torch.Tensor:
    """Positions whose target token t+1 belongs to the same sample."""
    return torch.arange(batch.tokens.shape[1])[None, :] < torch.tensor(batch.seq_lens)[:, None] - 1
