"""Off-policy corrections of the train-inference discrepancy factor rho = exp(old_logprob - rollout_logprob).

`compute_policy_loss` splits the total ratio pi_theta / pi_rollout into rho (this module: a per-token weight with
its own thresholds) times the staleness ratio pi_theta / pi_old (policy.py: the clip). This module also supplies
pi_old when exact old logprobs are missing (PPO-EWMA) — see OLD_LOGPROB_SOURCES.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from loss.aggregation import Sequences
from loss.kl import LOG_RATIO_LIMIT

if TYPE_CHECKING:
    from loss.config import LossConfig


def masked_log_ratio(num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """num - den where mask > 0, else 0, clamped to +-LOG_RATIO_LIMIT: padding (even inf/NaN there) never leaks."""
    diff = torch.where(mask > 0, num - den, torch.zeros_like(num))
    return diff.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _token_stats(weight: torch.Tensor, ratio: torch.Tensor, valid: torch.Tensor, clipped: torch.Tensor) -> dict[str, torch.Tensor]:
    n = valid.sum().clamp(min=1).to(ratio.dtype)
    return {
        "kept_frac": ((weight != 0) & valid).sum() / n,
        "clipped_frac": (clipped & valid).sum() / n,
    }


def tis(log_rho, mask, seqs, *, low, high):
    """Token TIS: w = min(rho, high) (truncate the upper tail; keeps every token)."""
    rho = log_rho.exp()
    w = rho.clamp(max=high)
    return w, _token_stats(w, rho, mask > 0, rho > high)


def mis(log_rho, mask, seqs, *, low, high):
    """Token MIS: w = rho if rho <= high else 0 (mask the upper tail out)."""
    rho = log_rho.exp()
    keep = log_rho <= math.log(high)
    w = torch.where(keep, rho, torch.zeros_like(rho))
    return w, _token_stats(w, rho, mask > 0, ~keep)


def icepop(log_rho, mask, seqs, *, low, high):
    """IcePop: w = rho if low <= rho <= high else 0 (both tails masked; the default band is [0.5, 2])."""
    rho = log_rho.exp()
    keep = (log_rho >= math.log(low)) & (log_rho <= math.log(high))
    w = torch.where(keep, rho, torch.zeros_like(rho))
    return w, _token_stats(w, rho, mask > 0, ~keep)


def sequence_log_rho(log_rho: torch.Tensor, mask: torch.Tensor, seqs: Sequences, kind: str) -> torch.Tensor:
    """log of a sequence's ratio [count]: product (sum of logs), arithmetic mean of rho, or geometric mean."""
    valid = (mask > 0).to(log_rho.dtype)
    n = seqs.sum(valid).clamp(min=1)
    if kind == "product":
        return seqs.sum(log_rho * valid).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if kind == "geometric":
        return seqs.sum(log_rho * valid) / n
    if kind == "arithmetic":
        return (seqs.sum(log_rho.exp() * valid) / n).clamp(min=math.exp(-LOG_RATIO_LIMIT)).log()
    raise AssertionError(f"unknown sequence ratio kind {kind!r}")


def _sequence_correction(kind: str, truncate: bool) -> Callable:
    """Sequence TIS (truncate the sequence ratio at high) or MIS (mask sequences outside [low, high])."""

    def correction(log_rho, mask, seqs, *, low, high):
        seq_log = sequence_log_rho(log_rho, mask, seqs, kind)
        if truncate:
            seq_w, clipped = seq_log.clamp(max=math.log(high)).exp(), seq_log > math.log(high)
        else:
            keep = (seq_log >= math.log(low)) & (seq_log <= math.log(high))
            seq_w, clipped = torch.where(keep, seq_log.exp(), torch.zeros_like(seq_log)), ~keep
        w = seqs.spread(seq_w)
        return w, _token_stats(w, log_rho.exp(), mask > 0, seqs.spread(clipped))

    correction.__doc__ = f"Sequence-level {'TIS' if truncate else 'MIS'} on the {kind} sequence ratio."
    return correction


def no_correction(log_rho, mask, seqs, *, low, high):
    """No correction: w = 1 (the discrepancy is still measured and reported)."""
    w = torch.ones_like(log_rho)
    return w, _token_stats(w, log_rho.exp(), mask > 0, torch.zeros_like(mask, dtype=torch.bool))


Correction = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

CORRECTIONS: dict[str, Correction] = {
    "none": no_correction,
    "tis": tis,
    "mis": mis,
    "icepop": icepop,
    "seq_tis": _sequence_correction("product", truncate=True),
    "seq_mis": _sequence_correction("product", truncate=False),
    "seq_tis_arith": _sequence_correction("arithmetic", truncate=True),
    "seq_mis_arith": _sequence_correction("arithmetic", truncate=False),
    "seq_tis_geo": _sequence_correction("geometric", truncate=True),
    "seq_mis_geo": _sequence_correction("geometric", truncate=False),
}


def apply_correction(cfg: "LossConfig", *, old_logprobs, rollout_logprobs, mask, seqs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached per-token weights [B, T] for the discrepancy factor, and metrics under "correction/" and
    "discrepancy/" (the ratio's own statistics over valid tokens)."""
    with torch.no_grad():
        log_rho = masked_log_ratio(old_logprobs.detach(), rollout_logprobs.detach(), mask)
        w, stats = CORRECTIONS[cfg.correction](log_rho, mask, seqs, low=cfg.correction_low, high=cfg.correction_high)
        metrics = {f"correction/{k}": v for k, v in stats.items()}
        metrics.update(ratio_metrics("discrepancy", log_rho, mask))
    return w, metrics


def ratio_metrics(prefix: str, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean / max / min of exp(log_ratio) and mean |log_ratio| over valid tokens (0 when there are none)."""
    valid = mask > 0
    if not valid.any():
        zero = log_ratio.new_zeros(())
        return {f"{prefix}/ratio_mean": zero, f"{prefix}/ratio_max": zero, f"{prefix}/ratio_min": zero, f"{prefix}/abs_log_ratio_mean": zero}
    lr = log_ratio.detach()[valid]
    return {
        f"{prefix}/ratio_mean": lr.exp().mean(),
        f"{prefix}/ratio_max": lr.max().exp(),
        f"{prefix}/ratio_min": lr.min().exp(),
        f"{prefix}/abs_log_ratio_mean": lr.abs().mean(),
    }


def ewma_proximal_logprobs(*, state: torch.Tensor, logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """PPO-EWMA, one evaluation: state in [B, T] -> state out [B, T], which is also this evaluation's proximal policy.

        log pi_prox <- beta * log pi_prox + (1 - beta) * sg(log pi_theta)

    per token, in log space as the revised PPO-EWMA of the Missing-Old-Logits write-up (docs/algorithms.md [W1]; its
    "log-linear" proxy: a geometric mixture of the policies; Hilton et al. 2022 average the weights instead, which
    needs a second model). The state of a sample
    starts at its rollout logprobs (the behaviour policy: each token under the version that generated it) and takes
    one update each time a trainer policy evaluates the sample, i.e. once per optimizer step that trains it
    (`trainer.num_epochs` per train_step). After evaluations l_1..l_n of rollout logprobs r:

        log pi_prox_n = beta^n * r + (1 - beta) * sum_k beta^(n - k) * l_k

    Versions that passed while the sample waited in the buffer never evaluated it and have no term (sluice has no
    logprobs of theirs: the missing old logits). Detached: the proximal policy is a constant of the loss.
    """
    return (beta * state.detach() + (1 - beta) * logprobs.detach()).detach()


def resolve_old_logprobs(cfg: "LossConfig", *, logprobs, old_logprobs, rollout_logprobs, mask,
                         ewma_logprobs=None) -> torch.Tensor:
    """The training-side old (proximal) logprobs per cfg.old_logprobs_from, detached; `ewma_logprobs` is PPO-EWMA's
    state before this evaluation (None: the rollout logprobs, a sample no trainer policy has evaluated yet)."""
    source = cfg.old_logprobs_from
    if source == "given":
        if old_logprobs is None:
            raise ValueError("old_logprobs is None but loss.old_logprobs_from='given': pass the recomputed/snapshot old "
                             "logprobs, or set old_logprobs_from to 'rollout' or 'ewma'")
        return old_logprobs.detach()
    if source == "rollout":
        return rollout_logprobs.detach()
    state = ewma_logprobs if ewma_logprobs is not None else rollout_logprobs
    state = torch.where(mask > 0, state, logprobs.detach())  # padding: any finite value, it is masked later
    return ewma_proximal_logprobs(state=state, logprobs=logprobs, beta=cfg.ewma_beta)


OLD_LOGPROB_SOURCES: dict[str, str] = {
    "given": "the caller's old_logprobs (recomputed before the update, or exact per-version snapshots)",
    "rollout": "the engine's rollout logprobs (no separate discrepancy factor: rho = 1)",
    "ewma": "PPO-EWMA proximal policy: per sample, the EWMA in log space (decay ewma_beta) of its rollout logprobs and "
            "the trainer policies that evaluated it, for when exact old logprobs are missing",
}


CLIP_REFERENCES: dict[str, str] = {
    "proximal": "decoupled PPO: the clip's ratio is pi_theta / pi_prox, the trainer's weights before this update "
                "(trainer.old_logprobs: recompute gives them as old_logprobs; with snapshot they come as "
                "proximal_logprobs), and the importance weight pi_prox / pi_behaviour goes to the correction",
    "behaviour": "coupled PPO against the behaviour policy: with trainer.old_logprobs: snapshot the clip's ratio is "
                 "pi_theta / pi_snapshot, the exact (stale) version that generated each token (the two-factor form "
                 "of the Missing-Old-Logits write-up; preset coupled_snapshot)",
}


def staleness_weight(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
                     high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO's importance weight between the proximal policy and the trainer-side behaviour policy (the
    snapshot logprob of each token at the version that generated it): w = min(pi_prox / pi_snapshot, high), detached
    [B, T], and metrics "stale_weight/*" (the ratio's statistics and the fraction truncated)."""
    with torch.no_grad():
        log_s = masked_log_ratio(proximal_logprobs.detach(), behaviour_logprobs.detach(), mask)
        s = log_s.exp()
        w = s.clamp(max=high)
        valid = mask > 0
        metrics = ratio_metrics("stale_weight", log_s, mask)
        metrics["stale_weight/clipped_frac"] = ((s > high) & valid).sum() / valid.sum().clamp(min=1).to(s.dtype)
    return w, metrics
