"""The SFT loop: take the next conversations → train → log → checkpoint. No engines, no weight sync, no staleness:
the trainer, its checkpoints and the metrics loggers are the RL run's own; only the batches and the loss differ."""
from __future__ import annotations

import time
from typing import Callable

from glue.loop.checkpoint import Checkpoints
from glue.loop.controller import Trainer
from glue.metrics.logger import MetricsLogger, StepTimer
from glue.sft.data import ConversationStream

MODE = "sft"  # a checkpoint's state.json says which kind of run wrote it


def run_sft_loop(*, num_steps: int, data: ConversationStream, trainer: Trainer, logger: MetricsLogger,
                 checkpoints: Checkpoints, first_step: int = 1, stop: Callable[[], bool] = lambda: False,
                 on_step: Callable[[dict], None] | None = None) -> int:
    """Train steps `first_step`..`num_steps` on `data`, or until `stop()` holds after a step (a checkpoint is written
    then, as at the last step and every `checkpoints.interval`); returns the last step trained."""
    for step in range(first_step, num_steps + 1):
        timer, started = StepTimer(), time.perf_counter()
        with timer("data"):
            batch, data_metrics = data.next_batch()
        with timer("train"):
            train_metrics = trainer.train_step(batch)
        wall = time.perf_counter() - started
        record = {"step": step, **train_metrics, **data_metrics, **timer.metrics, "time/step_s": wall,
                  "weights/version": trainer.version}
        logger.log(record)
        if on_step is not None:
            on_step(record)
        stopping = stop()
        if checkpoints.due(step, last=stopping or step == num_steps):
            state = {"mode": MODE, "version": trainer.version, "cursor": data.cursor}
            checkpoints.save(step, trainer.save_checkpoint, state)
        if stopping:
            return step
    return num_steps


def loss_summary(records: list[dict], window: int = 5) -> str:
    """One line saying whether the loss fell: mean `train/loss` over the first and last `window` steps."""
    losses = [r["train/loss"] for r in records if isinstance(r.get("train/loss"), (int, float))]
    if not losses:
        return "no train/loss recorded"
    n = min(window, len(losses))
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    return f"train/loss: first {n} steps {first:.3f} -> last {n} steps {last:.3f} ({last - first:+.3f})"
