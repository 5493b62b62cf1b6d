"""Per-token logprobs and entropy of the temperature-scaled next-token distribution, from this TP rank's vocab shard
of the logits [B, T, V / TP], for the loss: worked through in chunks of rows so that no fp32 copy of the logits
exists (forward and backward each hold at most two fp32 [chunk, V / TP] buffers; backward recomputes each chunk)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

CHUNK_BYTES = 128 * 2**20
"""Default bytes of one fp32 [chunk, V / TP] buffer: small beside the fp32 logits of a long micro-batch (16k tokens
x 152k vocab is 10 GB), and enough rows to amortise a chunk's collectives and kernel launches (on an H200, 16k x 152k
bf16 logits took 0.11 s forward + backward with 128 MiB chunks, 0.15 s with 64 MiB, 0.10 s unchunked)."""


def default_chunk_rows(vocab_width: int) -> int:
    """Rows per chunk for a vocab shard `vocab_width` wide: an fp32 chunk of at most CHUNK_BYTES, at least one row."""
    return max(1, CHUNK_BYTES // (4 * vocab_width))


def token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                               seq_ids: torch.Tensor | None = None, *, with_entropy: bool,
                               chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [B, T], entropy [B, T] or None) from this rank's vocab shard `logits` [B, T, V / TP] (bf16 or
    fp32; contiguous, else it is copied once in its own dtype) of a batch of `tokens` [B, T].

    logprobs[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]) under softmax(logits / temperature) over the whole
    vocabulary (all TP shards); 0 in the last column and, with `seq_ids` [B, T] (packed rows), at each sample's last
    token, whose next token belongs to another sample. entropy[b, t]: that distribution's entropy, at every position.
    Both are the same on every TP rank and differentiable: each rank's logits get the gradient of their own shard, as
    from megatron's vocab-parallel cross entropy. `chunk_rows` overrides default_chunk_rows (tests force small ones).
    """
    if logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}: expected [B, T, V]")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    targets = F.pad(tokens[:, 1:], (0, 1))  # the last column's next token is past the row: a dummy, zeroed below
    rows = chunk_rows or default_chunk_rows(logits.shape[-1])
    logprobs, entropy = _ShardedTokenStats.apply(logits, targets, float(temperature), with_entropy, rows)
    if seq_ids is None:
        has_next = torch.ones_like(tokens[:, 1:], dtype=torch.bool)
    else:
        has_next = seq_ids[:, 1:] == seq_ids[:, :-1]
    logprobs = torch.where(F.pad(has_next, (0, 1), value=False), logprobs, 0.0)
    return logprobs, entropy if with_entropy else None


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: its first id, its width, and the TP group holding the other slices
    (None at TP = 1, where every collective is skipped)."""

    start: int
    width: int
    group: Any

    @classmethod
    def of_this_rank(cls, width: int) -> "VocabShard":
        """Megatron's even split: TP rank r holds ids [r * width, (r + 1) * width)."""
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return cls(start=0, width=width, group=None)
        rank = parallel_state.get_tensor_model_parallel_rank()
        return cls(start=rank * width, width=width, group=parallel_state.get_tensor_model_parallel_group())

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> None:
        if self.group is not None:
            torch.distributed.all_reduce(tensor, op=op, group=self.group)

    def local_targets(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(column of each target in this shard, clamped into it so a gather stays in bounds; whether it is here)."""
        local = targets.long() - self.start
        is_here = (local >= 0) & (local < self.width)
        return local.clamp(0, self.width - 1), is_here


def _scaled(rows: torch.Tensor, temperature: float, into: torch.Tensor | None = None) -> torch.Tensor:
    """rows / temperature in fp32, in `into` when given (fp32, same shape), else in one fresh buffer."""
    if into is None:
        return rows.to(torch.float32, copy=True).div_(temperature)
    return into.copy_(rows).div_(temperature)


def _chunk_forward(rows: torch.Tensor, targets: torch.Tensor, temperature: float, shard: VocabShard,
                   with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """(logprob, entropy or None, logsumexp, mean scaled logit E[s] or None) of `rows` [n, V / TP], each [n]; with
    s = rows / temperature, E[s] is under softmax(s). The last two are what backward needs to recompute p."""
    from torch.distributed import ReduceOp

    s = _scaled(rows, temperature)
    peak = s.amax(dim=-1)
    shard.all_reduce(peak, ReduceOp.MAX)
    s.sub_(peak[:, None])
    column, is_here = shard.local_targets(targets)
    target = torch.where(is_here, s.gather(1, column[:, None])[:, 0], 0.0)  # only the owning rank contributes
    e = s.exp() if with_entropy else s.exp_()
    sums = [e.sum(-1), target] + ([e.mul_(s).sum(-1)] if with_entropy else [])
    del e, s
    stats = torch.stack(sums)  # one collective for every per-token sum
    shard.all_reduce(stats, ReduceOp.SUM)
    log_z = stats[0].log()
    logprob = stats[1] - log_z
    if not with_entropy:
        return logprob, None, peak + log_z, None
    shifted_mean = stats[2] / stats[0]  # E[s - peak]
    return logprob, log_z - shifted_mean, peak + log_z, peak + shifted_mean


def _chunk_grad(rows: torch.Tensor, targets: torch.Tensor, saved: tuple, grads: tuple, temperature: float,
                shard: VocabShard, out: torch.Tensor) -> None:
    """Write d(sum g_lp * logprob + g_H * entropy) / d rows into `out` (the same rows of the logits' gradient).

    With s = rows / T and p = softmax(s): d logprob / ds_i = onehot_i - p_i and d H / ds_i = -p_i (s_i - E[s]), so
    the gradient is (-p_i (g_lp + g_H (s_i - E[s])) + g_lp onehot_i) / T; `grads` come already divided by T.
    """
    logsumexp, mean = saved
    g_lp, g_ent = grads
    s = _scaled(rows, temperature, into=out if out.dtype == torch.float32 else None)
    if g_ent is None:
        grad = s.sub_(logsumexp[:, None]).exp_().mul_(-g_lp[:, None])
    else:
        p = torch.sub(s, logsumexp[:, None]).exp_()
        grad = s.sub_(mean[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
        del p
    column, is_here = shard.local_targets(targets)
    grad.scatter_add_(1, column[:, None], torch.where(is_here, g_lp, 0.0)[:, None])
    if grad is not out:
        out.copy_(grad)


class _ShardedTokenStats(torch.autograd.Function):
    """logits [B, T, V / TP], targets [B, T] -> (logprob of each target, entropy or an empty tensor), both fp32;
    keeps only [B * T] statistics for backward, which recomputes each chunk's softmax from the logits."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk_rows):
        rows, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        shard = VocabShard.of_this_rank(rows.shape[1])
        count = rows.shape[0]
        logprobs, logsumexp = (rows.new_empty(count, dtype=torch.float32) for _ in range(2))
        entropy, mean = (rows.new_empty(count if with_entropy else 0, dtype=torch.float32) for _ in range(2))
        for start in range(0, count, chunk_rows):
            part = slice(start, start + chunk_rows)
            lp, ent, lse, mu = _chunk_forward(rows[part], flat_targets[part], temperature, shard, with_entropy)
            logprobs[part], logsumexp[part] = lp, lse
            if with_entropy:
                entropy[part], mean[part] = ent, mu
        ctx.save_for_backward(logits, targets, logsumexp, mean if with_entropy else None)
        ctx.temperature, ctx.chunk_rows, ctx.shard = temperature, chunk_rows, shard
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no [B, T] of zeros to add
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
            return logprobs.view(targets.shape), entropy
        return logprobs.view(targets.shape), entropy.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, logsumexp, mean = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        temperature = ctx.temperature
        rows, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        g_lp = torch.zeros_like(logsumexp) if grad_logprobs is None else grad_logprobs.reshape(-1).float() / temperature
        g_ent = None if grad_entropy is None or mean is None else grad_entropy.reshape(-1).float() / temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        for start in range(0, rows.shape[0], ctx.chunk_rows):
            part = slice(start, start + ctx.chunk_rows)
            _chunk_grad(rows[part], flat_targets[part], (logsumexp[part], None if g_ent is None else mean[part]),
                        (g_lp[part], None if g_ent is None else g_ent[part]), temperature, ctx.shard, flat_grad[part])
        return grad, None, None, None, None
