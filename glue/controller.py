"""The GRPO loop, one for both modes: rollouts stream into the buffer as the staleness gate admits them; each step
takes a batch, trains, and syncs weights when the gate says so. `mode: sync` is the gate with max_staleness = 0
(rollout and training alternate); `mode: async` lets rollout run on while the trainer trains. Components do the
work; this file only says in which order. Who holds the devices in each phase is `glue.colocation`'s business."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Protocol

from glue.batch import build_train_batch, rollout_metrics
from glue.checkpoint import Checkpoints
from glue.colocation import Colocation
from glue.metrics import MetricsLogger, StepTimer
from glue.stream import RolloutStream
from glue.types import TrainBatch


class Trainer(Protocol):
    version: int

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...
    def save_checkpoint(self, directory: str) -> None: ...


class FleetControl(Protocol):
    def pause_generation(self, mode: str = "retract") -> None: ...
    def continue_generation(self) -> None: ...


async def no_evaluation(step: int) -> dict[str, float]:
    return {}


async def run_loop(*, num_steps: int, stream: RolloutStream, trainer: Trainer, fleet: FleetControl,
                   phases: Colocation, loss_cfg: Any, logger: MetricsLogger, pause_mode: str = "retract",
                   on_step: Callable[[dict], None] | None = None, stop: Callable[[], bool] = lambda: False,
                   checkpoints: Checkpoints | None = None, first_step: int = 1,
                   sync_guard: Callable[[Callable[[], None]], None] = lambda sync: sync(),
                   train_guard: Callable[[Callable[[], Any]], Any] = lambda call: call(),
                   extra_metrics: Callable[[], dict[str, float]] = dict,
                   evaluate: Callable[[int], Awaitable[dict[str, float]]] = no_evaluation,
                   build_batch: Callable[..., tuple[TrainBatch, dict]] = build_train_batch) -> int:
    """Train steps `first_step`..`num_steps`, or until `stop()` holds after a step (a checkpoint is written then,
    as at the last step and every `checkpoints.interval`); returns the last step trained. Every trained token is
    at most `stream.gate.max_staleness` versions old. `sync_guard(sync)` runs each weight sync (in a worker thread;
    glue.fleet_watch keeps it apart from engine restarts), `train_guard(call)` each train step and checkpoint (their
    trainer collectives never meet a repair's); `extra_metrics()` adds to every step's record.
    `await evaluate(step)` runs after each step's sync, when the engines hold a known version (and for step 0 before
    the first step); what it returns (glue.evaluation: {} unless due) joins the step's record. `build_batch` turns a
    step's groups into the batch and its metrics (glue.teacher's adds the distillation term)."""
    gate = stream.gate
    loop_started = time.perf_counter()  # time/elapsed_s: wall clock of this process's training, for by-time curves
    phases.before_rollout()
    stream.start()
    try:
        if first_step == 1 and (at_start := await evaluate(0)):
            logger.log({"step": 0, **at_start, "weights/version": trainer.version})
        for step in range(first_step, num_steps + 1):
            timer, started = StepTimer(), time.perf_counter()
            with timer("rollout"):  # the trainer waits for a batch
                groups, withheld = await stream.next_batch()
            groups = sorted(groups, key=lambda g: g.group_id)  # one order whatever order they finished in
            batch, staleness = build_batch(groups, loss_cfg, withheld=withheld, gate=gate)
            with timer("train"):
                train_metrics = await asyncio.to_thread(train_guard, lambda: train_phase(phases, trainer, batch))
            stream.trained(trainer.version)
            if gate.should_sync():
                with timer("sync"):
                    await stream.sync(lambda: sync_guard(lambda: sync_weights(fleet, phases, trainer.version,
                                                                              pause_mode)), trainer.version)
            evaluation = await evaluate(step)
            wall = time.perf_counter() - started
            record = {"step": step, **rollout_metrics(groups), **train_metrics, **staleness, **stream.metrics(wall),
                      **timer.metrics, **phases.metrics(), "time/step_s": wall,
                      "time/elapsed_s": time.perf_counter() - loop_started,
                      "time/trainer_idle_frac": timer.metrics["time/rollout_s"] / wall,
                      "weights/version": trainer.version, **evaluation, **extra_metrics()}
            logger.log(record)
            if on_step is not None:
                on_step(record)
            stopping = stop()
            if checkpoints is not None and checkpoints.due(step, last=stopping or step == num_steps):
                state = {**await stream.checkpoint_state(fleet), "version": trainer.version}  # on the loop
                await asyncio.to_thread(train_guard, lambda: checkpoints.save(step, trainer.save_checkpoint, state))
            if stopping:
                return step
        return num_steps
    finally:
        await stream.stop()


def train_phase(phases: Colocation, trainer: Trainer, batch: TrainBatch) -> dict[str, float]:
    """Give the trainer its devices (colocated placement) and train one step; blocking, run in a thread."""
    phases.before_train()
    return trainer.train_step(batch)


def sync_weights(fleet: FleetControl, phases: Colocation, version: int, pause_mode: str = "retract") -> None:
    """Pause generation, move the weights (the bridge verifies the version), resume. Colocated placement hands the
    devices back to the engines here too (the transfer happens in that handover). If the move fails, generation
    stays paused: the engines may hold some of the new buckets under the old version tag, and must not sample."""
    fleet.pause_generation(pause_mode)
    phases.sync(version)
    phases.before_rollout()
    fleet.continue_generation()
