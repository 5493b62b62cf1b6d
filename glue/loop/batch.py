"""From finished groups to what the trainer takes: group-relative advantages packed into a `TrainBatch` (with the
token staleness of what is trained), and the per-step rollout metrics."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch

from glue.loop.buffer import is_trainable
from glue.loop.staleness import StalenessGate, StalenessStats
from glue.rewards.shaping import shaping_metrics
from glue.types import Group, Sample, SampleStatus, TrainBatch
from loss import compute_advantages
from loss.config import LossConfig
from loss.distill import distillation_advantages

if TYPE_CHECKING:
    from glue.rewards.config import TeacherConfig


def build_train_batch(groups: list[Group], loss_cfg: LossConfig, *, withheld: set[tuple[int, int]] = frozenset(),
                      gate: StalenessGate | None = None) -> tuple[TrainBatch, dict[str, float]]:
    """Group-relative advantages from the rewards (loss.compute_advantages; 0 under GAE, whose advantages the trainer
    computes from its critic's values), packed into right-padded tensors,
    and the step's metrics of what is trained: token staleness (when a gate is given), and with
    `loss_cfg.mask_truncated` the share of trained samples masked for hitting the length limit.

    Failed and still-aborted samples are left out of both; `withheld` samples (too stale) count in their group's
    baseline but are not trained on, and so do truncated ones under `mask_truncated` (their loss mask is zeroed).
    """
    samples = [s for g in groups for s in g.samples if is_trainable(s)]
    if not samples:
        raise RuntimeError("every sample of this step failed; see the rollout function's errors in the engine logs")
    if loss_cfg.mask_truncated:
        samples = [dataclasses.replace(s, loss_mask=[0] * len(s.loss_mask)) if is_truncated(s) else s
                   for s in samples]
    longest = max(len(s.response_tokens) for s in samples)
    mask = torch.zeros(len(samples), max(longest, 1))
    for b, s in enumerate(samples):
        mask[b, : len(s.response_tokens)] = torch.tensor(s.loss_mask, dtype=torch.float)
    if loss_cfg.uses_critic:  # GAE: the trainer's critic values the tokens (glue/trainer/critic.py)
        advantages = torch.zeros_like(mask)
    else:
        advantages = compute_advantages(
            loss_cfg,
            rewards=torch.tensor([s.scalar_reward for s in samples], dtype=torch.float),
            group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
            mask=mask,
        )
    keep = [b for b, s in enumerate(samples) if (s.group_id, s.index) not in withheld]
    if not keep:
        raise RuntimeError("every sample of this step was too stale to train on; lower sync.max_staleness "
                           "(admission then holds the bound) or set sync.stale_policy: keep")
    stats = StalenessStats()
    if gate is not None:
        for b in keep:
            s = samples[b]
            stats.add(gate.token_staleness([v for v, m in zip(s.versions, s.loss_mask) if m]))
    per_sample = [advantages[b, : len(samples[b].response_tokens)] for b in keep]
    metrics = stats.metrics()
    if loss_cfg.mask_truncated:
        metrics["loss/truncated_masked_frac"] = sum(is_truncated(samples[b]) for b in keep) / len(keep)
    return TrainBatch.from_samples([samples[b] for b in keep], per_sample), metrics


def is_truncated(sample: Sample) -> bool:
    """Cut at the length limit (the engine's finish reason `length`)."""
    return sample.status is SampleStatus.TRUNCATED


def rollout_metrics(groups: list[Group]) -> dict[str, float | str]:
    samples = [s for g in groups for s in g.samples]
    scored = [s for s in samples if s.status is not SampleStatus.FAILED]
    rewards = torch.tensor([s.scalar_reward for s in scored], dtype=torch.float) if scored else torch.zeros(1)
    lengths = torch.tensor([len(s.response_tokens) for s in samples], dtype=torch.float)
    flat_groups = sum(1 for g in groups if len({s.scalar_reward for s in g.samples if s.status is not SampleStatus.FAILED}) <= 1)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "rollout/response_len_mean": lengths.mean().item(),
        "rollout/truncated_frac": sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples),
        "rollout/failed": float(len(samples) - len(scored)),
        "rollout/aborted": float(sum(s.status is SampleStatus.ABORTED for s in samples)),
        # trained samples with no response token (warned once by glue.rollout.errors)
        "rollout/empty_responses": float(sum(is_trainable(s) and not s.response_tokens for s in samples)),
        # samples whose reward function raised (reward.on_error: fail_sample), FAILED and left out of their group
        "rollout/reward_errors": float(sum(s.metadata.get("reward_error", 0) for s in samples)),
        "rollout/discarded_tokens": float(sum(s.metadata.get("discarded_tokens", 0) for s in samples)),
        "rollout/aborts_without_routing": float(sum(s.metadata.get("aborts_without_routing", 0) for s in samples)),
        # answers stamped with one meta_info.weight_version (no per-token spans), over the step's samples
        "rollout/single_version_answers": float(sum(s.metadata.get("single_version_answers", 0) for s in samples)),
        "rollout/error_turns": float(sum(s.metadata.get("error_turns", 0) for s in samples)),  # failed agent turns
        "rollout/masked_error_turns": float(sum(s.metadata.get("masked_error_turns", 0) for s in samples)),
        "rollout/zero_std_group_frac": flat_groups / len(groups),
        "rollout/num_samples": float(len(samples)),
        "rollout/group_ids": id_ranges(g.group_id for g in groups),  # which prompts this step trained
        **reward_key_means(scored, prefix="reward/"),
        **shaping_metrics(scored),
        **routing_payload(samples),
    }


def routing_payload(samples: list[Sample]) -> dict[str, float]:
    """With MoE routing replay: the routing the step's samples hold (`moe/routing_bytes`) and per token."""
    held = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not held:
        return {}
    nbytes, positions = sum(r.nbytes for r in held), sum(r.shape[0] for r in held)
    return {"moe/routing_bytes": float(nbytes), "moe/routing_bytes_per_token": nbytes / max(positions, 1)}


def reward_key_means(samples: list[Sample], prefix: str) -> dict[str, float]:
    """`<prefix><key>`: the mean of each entry of dict rewards besides "score" (e.g. math_reward's "correct",
    "format_ok"), over the samples whose reward has it."""
    values: dict[str, list[float]] = {}
    for s in samples:
        if isinstance(s.reward, dict):
            for key, value in s.reward.items():
                if key != "score" and isinstance(value, (int, float)):
                    values.setdefault(key, []).append(float(value))
    return {f"{prefix}{key}": sum(v) / len(v) for key, v in sorted(values.items())}


def id_ranges(ids) -> str:
    """Sorted ids as ranges, e.g. [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def distillation_batch_builder(cfg: TeacherConfig) -> Callable[..., tuple[Any, dict[str, float]]]:
    """`build_train_batch` whose advantages then get the teacher's term (loss.distill), with its
    `distill/*` metrics: what the loop calls each step when a run has a teacher."""
    def build(groups: list[Group], loss_cfg: LossConfig, **kwargs: Any) -> tuple[Any, dict[str, float]]:
        batch, metrics = build_train_batch(groups, loss_cfg, **kwargs)
        if batch.teacher_logprobs is None:
            raise RuntimeError("a distillation step has no teacher logprobs on its samples: the teacher scores "
                               "finished groups as they arrive (or a run.replay_from run must have had a teacher)")
        batch.advantages, distill = distillation_advantages(
            batch.advantages, student_logprobs=batch.rollout_logprobs, teacher_logprobs=batch.teacher_logprobs,
            mask=batch.logprob_mask, coef=cfg.kl_coef, objective=cfg.objective, center=cfg.center)
        return batch, {**metrics, **distill}

    return build
