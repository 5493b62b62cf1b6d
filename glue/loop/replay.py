"""Replay debugging: each step's trained groups saved in the run folder (`run.save_rollouts`), a stream that reads
them back so the trainer trains on them with no engines (`run.debug: train_only`), and the stand-ins that let the
loop run with only one side present (`NoTrainer` for `rollout_only`, `NoFleet` for `train_only`)."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, Callable

from glue.loop.staleness import StalenessGate
from glue.loop.stream import BatchStream
from glue.types import Group

ROLLOUTS = "rollouts"  # the run folder's sub-folder of saved steps


def step_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS / f"step_{step:08d}.json"


def save_step(run_dir: str | Path, step: int, groups: list[Group], withheld: set[tuple[int, int]]) -> Path:
    """Write train step `step`'s groups (samples whole: tokens, logprobs, versions, rewards, status, metadata,
    routed experts) and the samples withheld from training as too stale; written aside and renamed, so a file
    that exists is complete."""
    path = step_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"step": step, "groups": [g.to_dict() for g in sorted(groups, key=lambda g: g.group_id)],
              "withheld": sorted([list(key) for key in withheld])}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)
    return path


def load_step(run_dir: str | Path, step: int) -> tuple[list[Group], set[tuple[int, int]]]:
    """What `save_step` wrote for `step`: (groups, withheld)."""
    record = json.loads(step_path(run_dir, step).read_text())
    return [Group.from_dict(g) for g in record["groups"]], {(int(g), int(i)) for g, i in record["withheld"]}


def saved_steps(run_dir: str | Path) -> list[int]:
    """The steps whose groups `run_dir` holds, in order."""
    folder = Path(run_dir) / ROLLOUTS
    if not folder.is_dir():
        return []
    return sorted(int(p.stem.split("_")[1]) for p in folder.iterdir()
                  if p.name.startswith("step_") and p.suffix == ".json")


def check_replay_source(run_dir: str | Path, steps: range) -> None:
    """Raise ValueError unless `run_dir` saved the groups of every step in `steps` (before anything starts)."""
    missing = sorted(set(steps) - set(saved_steps(run_dir)))
    if missing:
        held = saved_steps(run_dir)
        what = f"steps {held[0]}-{held[-1]}" if held else "no steps"
        raise ValueError(f"run.replay_from={str(run_dir)!r} holds {what} in {ROLLOUTS}/ but this run trains steps "
                         f"{steps.start}-{steps.stop - 1} (missing from step {missing[0]}): lower run.num_steps, or "
                         "point it at a run that had run.save_rollouts: true (or run.debug: rollout_only)")


class SavingStream:
    """A rollout stream (glue.loop.stream.RolloutStream) whose every batch is also written to the run folder, step
    `first_step` first; everything else is the stream's own."""

    def __init__(self, stream: BatchStream, run_dir: str | Path, first_step: int = 1):
        self.stream, self.run_dir, self.step = stream, Path(run_dir), first_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    async def next_batch(self) -> tuple[list[Group], set[tuple[int, int]]]:
        groups, withheld = await self.stream.next_batch()
        await asyncio.to_thread(save_step, self.run_dir, self.step, groups, withheld)
        self.step += 1
        return groups, withheld


class ReplayStream:
    """Stands in for the rollout stream in a train_only run: train step N takes the groups (and the withheld
    samples) that run `source` saved for its step N. A weight sync only records the version: there are no engines."""

    def __init__(self, source: str | Path, *, gate: StalenessGate, first_step: int = 1):
        self.source, self.gate, self.step = Path(source), gate, first_step

    def start(self) -> None:
        pass

    async def next_batch(self) -> tuple[list[Group], set[tuple[int, int]]]:
        batch = await asyncio.to_thread(load_step, self.source, self.step)
        self.step += 1
        return batch

    def trained(self, version: int) -> None:
        self.gate.trained(version)

    async def sync(self, transfer: Callable[[], None], version: int) -> None:
        self.gate.synced(version)

    def metrics(self, step_s: float) -> dict[str, float]:
        return {}

    async def checkpoint_state(self, fleet: Any) -> dict[str, Any]:
        return {"replay_from": str(self.source), "finished": [], "reissue": []}

    async def stop(self) -> None:
        pass


class NoTrainer:
    """Stands in for the trainer in a rollout_only run: a step trains nothing, so the engines keep the initial
    weights; `version` counts steps as a trainer's would, so the staleness gate admits each next step's groups."""

    def __init__(self) -> None:
        self.version = 0

    def train_step(self, batch: Any) -> dict[str, float]:
        self.version += 1
        return {}

    def save_checkpoint(self, directory: str) -> None:
        raise RuntimeError("a rollout_only run has no trainer to checkpoint")


class NoFleet:
    """Stands in for the fleet watch in a train_only run: no engines to watch, pause or bring to new weights."""

    async def run(self, training: asyncio.Future, stopping: Callable[[], bool] = lambda: False) -> Any:
        return await training

    def guarded_sync(self, sync: Callable[[], Any]) -> Any:
        return sync()

    def guarded_train(self, call: Callable[[], Any]) -> Any:
        return call()

    def pause_generation(self, mode: str = "retract") -> None:
        pass

    def continue_generation(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}
