"""The synchronous GRPO loop: generate -> reward -> train -> sync -> log. Components do the work; this file only
says in which order (mode: sync is max_staleness = 0, the special case the async loop will generalise). Who holds
the devices in each phase is the `glue.colocation` component's business."""
from __future__ import annotations

import asyncio
from typing import Any, Protocol

import torch

from glue.colocation import Colocation, Disaggregated
from glue.metrics import MetricsLogger, StepTimer
from glue.types import Group, SampleStatus, TrainBatch


class Trainer(Protocol):
    version: int

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...


class Bridge(Protocol):
    def sync(self, version: int) -> None: ...


class FleetControl(Protocol):
    def pause_generation(self) -> None: ...
    def continue_generation(self) -> None: ...


def run_sync_loop(*, num_steps: int, manager: Any, trainer: Trainer, fleet: FleetControl, bridge: Bridge,
                  loss_cfg: Any, logger: MetricsLogger, loop: asyncio.AbstractEventLoop, progress: Any = None,
                  colocation: Colocation | None = None) -> None:
    """Run `num_steps` on-policy steps; every step's rollouts come from the weights of the step before.
    `colocation` (default: separate devices) hands the devices over before each phase and owns the weight sync."""
    phases = colocation or Disaggregated(bridge)
    for step in range(1, num_steps + 1):
        timer = StepTimer()
        with timer("rollout"):
            phases.before_rollout()
            groups = loop.run_until_complete(manager.generate_step())
        batch = build_train_batch(groups, loss_cfg)
        with timer("train"):
            phases.before_train()
            train_metrics = trainer.train_step(batch)
        with timer("sync"):
            sync_weights(fleet, phases, trainer.version)
        record = {"step": step, **rollout_metrics(groups), **train_metrics, **timer.metrics, **phases.metrics(),
                  "weights/version": trainer.version}
        logger.log(record)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(reward=f"{record['rollout/reward_mean']:.3f}", loss=f"{record.get('train/loss', 0):.3f}")


def sync_weights(fleet: FleetControl, bridge: Bridge, version: int) -> None:
    """Pause generation, move the weights (the bridge verifies the version), and resume even if the move failed."""
    fleet.pause_generation()
    try:
        bridge.sync(version)
    finally:
        fleet.continue_generation()


def build_train_batch(groups: list[Group], loss_cfg: Any) -> TrainBatch:
    """Group-relative advantages from the rewards (loss.compute_advantages), packed into right-padded tensors.

    Failed samples are left out; a group keeps its remaining samples.
    """
    from loss import compute_advantages

    samples = [s for g in groups for s in g.samples if s.status is not SampleStatus.FAILED]
    if not samples:
        raise RuntimeError("every sample of this step failed; see the rollout function's errors in the engine logs")
    longest = max(len(s.response_tokens) for s in samples)
    mask = torch.zeros(len(samples), max(longest, 1))
    for b, s in enumerate(samples):
        mask[b, : len(s.response_tokens)] = torch.tensor(s.loss_mask, dtype=torch.float)
    advantages = compute_advantages(
        loss_cfg,
        rewards=torch.tensor([s.scalar_reward for s in samples], dtype=torch.float),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        mask=mask,
    )
    per_sample = [advantages[b, : len(s.response_tokens)] for b, s in enumerate(samples)]
    return TrainBatch.from_samples(samples, per_sample)


def rollout_metrics(groups: list[Group]) -> dict[str, float]:
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
        "rollout/zero_std_group_frac": flat_groups / len(groups),
        "rollout/num_samples": float(len(samples)),
    }
