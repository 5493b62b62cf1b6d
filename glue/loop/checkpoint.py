"""Checkpoints of a run: `<run>/checkpoints/step_<N>/` holds the trainer's part (glue.trainer.checkpointing: `dist/`,
the weights as each rank's shards; `trainer/`: optimizer and RNG state per rank) and the driver's (`state.json`: step, policy version, the
task's cursor and the groups to issue again). Each is written into a `.partial` folder and renamed once complete, so
a crash mid-write leaves the previous checkpoint the latest; only the newest `keep` are kept, each moved aside
(`.step_<N>.removing`) before it is deleted, so a crash mid-delete never leaves a `step_<N>` with part of its files.
A `step_<N>` without state.json (written last) is incomplete and never resumed. A write that fails (disk full: an
OSError, on the driver or a trainer rank) is said in one line and the run goes on from the previous one, until
`max_failures` fail in a row (CheckpointFailed)."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from weight_sync.disk import fsync_path

STATE = "state.json"


class CheckpointFailed(RuntimeError):
    """`run.max_checkpoint_failures` checkpoint writes in a row failed: the run stops; the message says which
    checkpoint is the latest."""


class Checkpoints:
    """`interval`: every this many steps; `interval_s`: also at the first step boundary this many seconds after the
    last checkpoint (or the run's start); 0 / None: not on that schedule. `clock`: seconds, monotonic."""

    def __init__(self, directory: str | Path, *, keep: int = 2, interval: int = 0, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, max_failures: int = 3):
        self.directory, self.keep, self.interval, self.interval_s = Path(directory), keep, interval, interval_s
        self.clock = clock
        self.last_saved = clock()
        self.max_failures = max_failures
        self.failures = 0  # writes that failed in this run (fault/checkpoint_failures)
        self._failures_in_a_row = 0

    def due(self, step: int, *, last: bool) -> bool:
        """Every `interval` steps, once `interval_s` has passed since the last checkpoint, and always at the run's
        last step."""
        return (last or (self.interval > 0 and step % self.interval == 0)
                or (bool(self.interval_s) and self.clock() - self.last_saved >= self.interval_s))

    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.name.startswith("step_") and (p / STATE).is_file()]
        return sorted(found, key=lambda p: int(p.name.split("_")[1]))

    def latest(self) -> Path | None:
        done = self.all()
        return done[-1] if done else None

    def incomplete(self) -> list[Path]:
        """`step_<N>` folders without their state.json (copied by hand, or cut short by a file system without atomic
        renames), oldest first: never resumed."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.name.startswith("step_") and not (p / STATE).is_file()]
        return sorted(found, key=lambda p: int(p.name.split("_")[1]))

    def save(self, step: int, write_trainer: Callable[[str], None], state: dict[str, Any]) -> Path | None:
        """Write checkpoint `step`: the trainer's part by `write_trainer(folder)`, then `state` (+ step); renamed
        into place only when both are on disk. A write that fails with an OSError (a trainer rank's arrives as
        Ray's error, which is one too) leaves no trace: its `.partial` folder is removed, one line says so, and
        None is returned; the `max_failures`-th failure in a row raises CheckpointFailed."""
        try:
            final = self._write(step, write_trainer, state)
        except OSError as err:
            shutil.rmtree(self.directory / f".step_{step:08d}.partial", ignore_errors=True)
            self._failed(step, err)
            return None
        self._failures_in_a_row = 0
        return final

    def metrics(self) -> dict[str, float]:
        return {"fault/checkpoint_failures": float(self.failures)}

    def _failed(self, step: int, err: OSError) -> None:
        self.failures += 1
        self._failures_in_a_row += 1
        cause = getattr(err, "cause", None) or err  # a trainer rank's error, as Ray hands it on
        latest = self.latest()
        line = (f"checkpoint step_{step:08d} could not be written ({type(cause).__name__}: "
                f"{(str(cause).strip().splitlines() or [''])[0]}); "
                + (f"{latest} stays the latest" if latest else "there is no checkpoint yet"))
        if self._failures_in_a_row >= self.max_failures:
            raise CheckpointFailed(f"{line}; {self._failures_in_a_row} checkpoint writes in a row failed "
                                   f"(run.max_checkpoint_failures={self.max_failures})") from err
        print(f"sluice: {line}; the run goes on ({self._failures_in_a_row} of at most {self.max_failures} failures "
              f"in a row, run.max_checkpoint_failures)", flush=True)

    def _write(self, step: int, write_trainer: Callable[[str], None], state: dict[str, Any]) -> Path:
        final = self.directory / f"step_{step:08d}"
        partial = self.directory / f".step_{step:08d}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        write_trainer(str(partial))
        with open(partial / STATE, "w") as handle:
            json.dump({**state, "step": step}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        remove(final)  # the same step saved again (a stop's checkpoint after a scheduled one)
        os.rename(partial, final)
        fsync_path(str(self.directory))
        for old in self.all()[:-self.keep]:
            remove(old)
        for stale in [*self.directory.glob(".step_*.partial"), *self.directory.glob(".step_*.removing")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a crash mid-write or mid-delete
        self.last_saved = self.clock()
        return final

    @staticmethod
    def read_state(checkpoint: str | Path) -> dict[str, Any]:
        path = Path(checkpoint) / STATE
        if not path.is_file():
            raise FileNotFoundError(f"{checkpoint} is not a complete sluice checkpoint (no {STATE})")
        return json.loads(path.read_text())



def remove(checkpoint: Path) -> None:
    """Delete `checkpoint` (if there), renamed out of the `step_<N>` names first: never a half-deleted one to resume."""
    aside = checkpoint.with_name(f".{checkpoint.name}.removing")
    try:
        os.rename(checkpoint, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)
