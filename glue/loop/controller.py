"""The GRPO loop, one for both modes: rollouts stream into the buffer as the staleness gate admits them; each step
takes a batch, trains, and syncs weights when the gate says so. `mode: sync` is the gate with max_staleness = 0
(rollout and training alternate); `mode: async` lets rollout run on while the trainer trains. Components do the
work; this file only says in which order. Who holds the devices in each phase is `glue.loop.colocation`'s business."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from glue.loop.batch import build_train_batch, rollout_metrics
from glue.loop.checkpoint import Checkpoints
from glue.loop.colocation import Colocation
from glue.loop.cut import never, save_cut, unless_stopped
from glue.loop.stream import BatchStream
from glue.metrics.logger import MetricsLogger, StepTimer
from glue.types import TrainBatch
from loss.config import LossConfig


class Trainer(Protocol):
    version: int

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...
    def save_checkpoint(self, directory: str) -> None: ...


class FleetControl(Protocol):
    def pause_generation(self, mode: str = "retract") -> None: ...
    def continue_generation(self) -> None: ...


async def no_evaluation(step: int) -> dict[str, float]:
    return {}


@dataclass(frozen=True)
class LoopHooks:
    """Where a run steps into the loop; each default leaves that part to the loop alone.

    `sync_guard(sync)` runs each weight sync (in a worker thread; glue.fleet.watch keeps it apart from engine
    restarts), `train_guard(call)` each train step and checkpoint (their trainer collectives never meet a repair's);
    `extra_metrics()` adds to every step's record and `on_step(record)` sees it once logged; `stop()` is asked after
    each step; `await stop_grace_over()` returns once a requested stop has waited its grace (run.stop_grace_s) for
    the step in progress: a step still waiting on groups then is cut. `await evaluate(step)` runs after each step's
    sync, when the engines hold a known version (and for step 0 before the first step); what it returns
    (glue.loop.evaluation: {} unless due) joins the step's record. `build_batch` turns a step's groups into the
    batch and its metrics (glue.loop.batch's distillation builder adds the teacher's term)."""

    on_step: Callable[[dict], None] | None = None
    stop: Callable[[], bool] = lambda: False
    stop_grace_over: Callable[[], Awaitable[None]] = never
    sync_guard: Callable[[Callable[[], None]], None] = lambda sync: sync()
    train_guard: Callable[[Callable[[], Any]], Any] = lambda call: call()
    extra_metrics: Callable[[], dict[str, float]] = dict
    evaluate: Callable[[int], Awaitable[dict[str, float]]] = no_evaluation
    build_batch: Callable[..., tuple[TrainBatch, dict]] = build_train_batch


@dataclass(frozen=True)
class LoopParts:
    """The loop's collaborators: the stream of finished groups, the trainer, the fleet it pauses for weight syncs,
    who holds the devices in each phase, where records go, checkpoints (None: none written), and the hooks."""

    stream: BatchStream
    trainer: Trainer
    fleet: FleetControl
    phases: Colocation
    logger: MetricsLogger
    checkpoints: Checkpoints | None = None
    hooks: LoopHooks = field(default_factory=LoopHooks)


async def run_loop(parts: LoopParts, *, num_steps: int, loss_cfg: LossConfig, pause_mode: str = "retract",
                   first_step: int = 1) -> int:
    """Train steps `first_step`..`num_steps`, or until `parts.hooks.stop()` holds after a step (a checkpoint is
    written then, as at the last step and every `checkpoints.interval`); returns the last step trained. Every
    trained token is at most `stream.gate.max_staleness` versions old."""
    stream, trainer, fleet, phases, logger = parts.stream, parts.trainer, parts.fleet, parts.phases, parts.logger
    checkpoints, hooks = parts.checkpoints, parts.hooks
    gate = stream.gate
    loop_started = time.perf_counter()  # time/elapsed_s: wall clock of this process's training, for by-time curves
    phases.before_rollout()
    stream.start()
    try:
        if first_step == 1 and (at_start := await hooks.evaluate(0)):
            logger.log({"step": 0, **at_start, "weights/version": trainer.version})
        for step in range(first_step, num_steps + 1):
            timer, started = StepTimer(), time.perf_counter()
            with timer("rollout"):  # the trainer waits for a batch, unless a stop's grace runs out first
                taken = await unless_stopped(stream.next_batch(), hooks.stop_grace_over())
            if taken is None:  # cut: what the step had goes into a checkpoint of the last step trained
                await save_cut(parts, step - 1)
                return step - 1
            groups, withheld = taken
            groups = sorted(groups, key=lambda g: g.group_id)  # one order whatever order they finished in
            batch, staleness = hooks.build_batch(groups, loss_cfg, withheld=withheld, gate=gate)
            with timer("train"):
                train_metrics = await asyncio.to_thread(hooks.train_guard, lambda: train_phase(phases, trainer, batch))
            stream.trained(trainer.version)
            # once a stop is asked the step goes straight to its checkpoint: a resume syncs the engines anyway
            if gate.should_sync() and not hooks.stop():
                with timer("sync"):
                    await stream.sync(lambda: hooks.sync_guard(lambda: sync_weights(fleet, phases, trainer.version,
                                                                                    pause_mode)), trainer.version)
            evaluation = await hooks.evaluate(step) if not hooks.stop() else {}
            wall = time.perf_counter() - started
            record = {"step": step, **rollout_metrics(groups), **train_metrics, **staleness, **stream.metrics(wall),
                      **timer.metrics, **phases.metrics(), "time/step_s": wall,
                      "time/elapsed_s": time.perf_counter() - loop_started,
                      "time/trainer_idle_frac": timer.metrics["time/rollout_s"] / wall,
                      "weights/version": trainer.version, **evaluation, **hooks.extra_metrics()}
            logger.log(record)
            if hooks.on_step is not None:
                hooks.on_step(record)
            stopping = hooks.stop()
            if checkpoints is not None and checkpoints.due(step, last=stopping or step == num_steps):
                state = {**await stream.checkpoint_state(fleet), "version": trainer.version}  # on the loop
                await asyncio.to_thread(hooks.train_guard,
                                        lambda: checkpoints.save(step, trainer.save_checkpoint, state))
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
