"""The GRPO loop, one for both modes: rollouts stream into the buffer as the staleness gate admits them; each step
takes a batch, trains, and syncs weights when the gate says so. `mode: sync` is the gate with max_staleness = 0
(rollout and training alternate); `mode: async` lets rollout run on while the trainer trains. Components do the
work; this file only says in which order. Who holds the devices in each phase is `glue.colocation`'s business."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Protocol

import torch

from glue.buffer import is_trainable
from glue.colocation import Colocation
from glue.metrics import MetricsLogger, StepTimer
from glue.staleness import StalenessGate, StalenessStats
from glue.stream import RolloutStream
from glue.types import Group, SampleStatus, TrainBatch


class Trainer(Protocol):
    version: int

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...


class Bridge(Protocol):
    def sync(self, version: int) -> None: ...


class FleetControl(Protocol):
    def pause_generation(self, mode: str = "retract") -> None: ...
    def continue_generation(self) -> None: ...


async def run_loop(*, num_steps: int, stream: RolloutStream, trainer: Trainer, fleet: FleetControl,
                   phases: Colocation, loss_cfg: Any, logger: MetricsLogger, pause_mode: str = "retract",
                   on_step: Callable[[dict], None] | None = None) -> None:
    """Train `num_steps` steps; every trained token is at most `stream.gate.max_staleness` versions old."""
    gate = stream.gate
    phases.before_rollout()
    stream.start()
    idle_before = stream.idle.read()
    try:
        for step in range(1, num_steps + 1):
            timer, started = StepTimer(), time.perf_counter()
            with timer("rollout"):  # the trainer waits for a batch
                groups, withheld = await stream.next_batch()
            batch, staleness = build_train_batch(groups, loss_cfg, withheld=withheld, gate=gate)
            with timer("train"):
                train_metrics = await asyncio.to_thread(train_phase, phases, trainer, batch)
            stream.trained(trainer.version)
            if gate.should_sync():
                with timer("sync"):
                    await stream.sync(lambda: sync_weights(fleet, phases, trainer.version, pause_mode), trainer.version)
            wall, idle_now = time.perf_counter() - started, stream.idle.read()
            record = {"step": step, **rollout_metrics(groups), **train_metrics, **staleness,
                      **async_metrics(stream, gate), **timer.metrics, **phases.metrics(),
                      "time/step_s": wall, "time/trainer_idle_frac": timer.metrics["time/rollout_s"] / wall,
                      "time/rollout_idle_frac": min(1.0, (idle_now - idle_before) / wall),
                      "weights/version": trainer.version}
            idle_before = idle_now
            logger.log(record)
            if on_step is not None:
                on_step(record)
    finally:
        await stream.stop()


def train_phase(phases: Colocation, trainer: Trainer, batch: TrainBatch) -> dict[str, float]:
    """Give the trainer its devices (colocated placement) and train one step; blocking, run in a thread."""
    phases.before_train()
    return trainer.train_step(batch)


def sync_weights(fleet: FleetControl, phases: Colocation, version: int, pause_mode: str = "retract") -> None:
    """Pause generation, move the weights (the bridge verifies the version), and resume even if the move failed.
    Colocated placement hands the devices back to the engines here too (the transfer happens in that handover)."""
    fleet.pause_generation(pause_mode)
    try:
        phases.sync(version)
        phases.before_rollout()
    finally:
        fleet.continue_generation()


def build_train_batch(groups: list[Group], loss_cfg: Any, *, withheld: set[tuple[int, int]] = frozenset(),
                      gate: StalenessGate | None = None) -> tuple[TrainBatch, dict[str, float]]:
    """Group-relative advantages from the rewards (loss.compute_advantages), packed into right-padded tensors,
    and the token staleness of what is trained (when a gate is given).

    Failed and still-aborted samples are left out of both; `withheld` samples (too stale) count in their group's
    baseline but are not trained on.
    """
    from loss import compute_advantages

    samples = [s for g in groups for s in g.samples if is_trainable(s)]
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
    return TrainBatch.from_samples([samples[b] for b in keep], per_sample), stats.metrics()


def async_metrics(stream: RolloutStream, gate: StalenessGate) -> dict[str, float]:
    """Where work waits and how far behind it is: staleness of groups still generating vs finished in the buffer
    (versions behind the trainer, from the engines' version at their start), the engines' lag, drops."""
    def mean_lag(entries) -> float:
        return sum(gate.v_train - e.start_version for e in entries) / len(entries) if entries else 0.0

    in_flight, in_queue = stream.buffer.in_flight, stream.buffer.in_queue
    return {"staleness/in_flight": mean_lag(in_flight), "staleness/in_queue": mean_lag(in_queue),
            "async/in_flight_groups": float(len(in_flight)), "async/buffer_groups": float(len(in_queue)),
            "async/dropped_stale": float(gate.dropped_stale), "async/syncs": float(gate.syncs),
            "weights/lag": float(gate.lag)}


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
        "rollout/aborted": float(sum(s.status is SampleStatus.ABORTED for s in samples)),
        "rollout/discarded_tokens": float(sum(s.metadata.get("discarded_tokens", 0) for s in samples)),
        "rollout/zero_std_group_frac": flat_groups / len(groups),
        "rollout/num_samples": float(len(samples)),
    }
