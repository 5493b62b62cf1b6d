"""The rollout stream: keeps groups generating whenever the staleness gate admits one, collects finished groups
in the buffer, and hands the trainer a step's groups once the buffer is ready. Weight syncs go through it so
admission stops while generation is paused. Runs on the loop's event loop; the blocking sync runs in a thread."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from glue.buffer import RolloutBuffer, is_trainable
from glue.staleness import StalenessGate
from glue.types import Group


class IdleClock:
    """Seconds during which the rollout side had nothing generating (no group in flight, or generation paused)."""

    def __init__(self) -> None:
        self.total, self._since = 0.0, time.perf_counter()

    def set(self, idle: bool) -> None:
        now = time.perf_counter()
        if self._since is not None:
            self.total += now - self._since
        self._since = now if idle else None

    def read(self) -> float:
        return self.total + (time.perf_counter() - self._since if self._since is not None else 0.0)


class RolloutFailed(RuntimeError):
    """Too many of a step's groups failed (rollout.max_failed_frac); the message has the count and the first error."""


class RolloutStream:
    """`start()`, then `await next_batch()` per train step and `await sync(fn)` per weight sync; `stop()` cancels
    what is still generating. `max_groups` caps the groups ever trained (the run's steps x groups per step),
    `max_concurrent` the groups generating at once. A failed group (`Group.error`) gives its place to a new one and
    is counted; more than `max_failed_frac` of a step's groups failing stops the run with RolloutFailed."""

    def __init__(self, *, manager: Any, gate: StalenessGate, buffer: RolloutBuffer, max_groups: int,
                 max_concurrent: int | None = None, max_failed_frac: float = 0.5):
        self.manager, self.gate, self.buffer, self.max_groups = manager, gate, buffer, max_groups
        self.max_concurrent = max_concurrent  # groups generating at once (None: as many as the gate admits)
        self.max_failed_frac = max_failed_frac
        self.failed_groups = 0  # over the run
        self.lost_samples = 0  # samples of groups that failed because the fleet could not serve them, over the run
        self._lost_at_last_metrics = 0
        self._failed_this_step: list[Group] = []
        self._failed_at_last_metrics = 0
        self.idle = IdleClock()
        self._idle_at_last_metrics = 0.0
        self._tasks: dict[int, asyncio.Task] = {}
        self._paused = False
        self._error: BaseException | None = None
        self._changed: asyncio.Event | None = None
        self._producer: asyncio.Task | None = None

    def start(self) -> None:
        self._idle_at_last_metrics = self.idle.read()
        self._changed = asyncio.Event()
        self._producer = asyncio.ensure_future(self._produce())

    async def _wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate()` holds; every state change sets `_changed` and wakes all waiters."""
        while not predicate():
            self._changed.clear()
            await self._changed.wait()

    async def _produce(self) -> None:
        try:
            while True:
                await self._wait_for(self._may_admit)
                self._start_group()
        except Exception as err:  # e.g. the task ran out of prompts: the trainer's next_batch raises it
            self._error = err
            self._changed.set()

    def _may_admit(self) -> bool:
        return (not self._paused and self._error is None and self.gate.can_admit()
                and self.gate.admitted < self.max_groups
                and (self.max_concurrent is None or len(self._tasks) < self.max_concurrent))

    def _start_group(self) -> None:
        deadline = self.gate.admit()
        group_id, coroutine = self.manager.next_group()
        self.buffer.started(group_id, deadline=deadline, start_version=self.gate.v_engine)
        task = asyncio.ensure_future(coroutine)
        self._tasks[group_id] = task
        task.add_done_callback(lambda t, gid=group_id: self._on_done(gid, t))
        self.idle.set(self._paused)

    def _on_done(self, group_id: int, task: asyncio.Task) -> None:
        self._tasks.pop(group_id, None)
        if task.cancelled():
            return
        if task.exception() is not None:
            self._error = self._error or task.exception()
        else:
            self._accept(task.result())
        self.idle.set(self._paused or not self._tasks)
        self._changed.set()

    def _accept(self, group: Group) -> None:
        if group.error is not None:
            self._count_failure(group)
        if any(is_trainable(s) for s in group.samples):
            self.buffer.finished(group)
        else:  # nothing to learn from: give its place back so another group can start
            self.buffer.discard(group.group_id)
            self.gate.give_back()

    def _count_failure(self, group: Group) -> None:
        """A step takes `groups_per_step` good groups; once the failed ones alone exceed `max_failed_frac` of the
        step (failed + good), no later success can bring the share back under it."""
        self.failed_groups += 1
        self.lost_samples += len(group.samples) if group.lost else 0
        self._failed_this_step.append(group)
        failed, good = len(self._failed_this_step), self.buffer.groups_per_step
        if failed > self.max_failed_frac * (failed + good) and self._error is None:
            first = self._failed_this_step[0]
            self._error = RolloutFailed(
                f"{failed} groups failed while a step of {good} was collected, more than rollout.max_failed_frac="
                f"{self.max_failed_frac:g} of them; first: group {first.group_id}: {first.error}")

    async def next_batch(self) -> tuple[list[Group], set[tuple[int, int]]]:
        """Wait until the buffer holds a step's groups (re-raising a rollout function's error), then take them."""
        await self._wait_for(lambda: self._error is not None or self.buffer.is_ready(self.gate))
        if self._error is not None:
            raise self._error
        self._failed_this_step = []
        return self.buffer.take(self.gate)

    def trained(self, version: int) -> None:
        self.gate.trained(version)
        self._changed.set()

    async def sync(self, transfer: Callable[[], None], version: int) -> None:
        """Stop admitting, run the blocking `transfer` (pause -> weights -> continue) in a thread, record the
        engines' new version, admit again."""
        self._paused = True
        self.idle.set(True)
        try:
            await asyncio.to_thread(transfer)
            self.gate.synced(version)
        finally:
            self._paused = False
            self.idle.set(not self._tasks)
            self._changed.set()

    def resume_state(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this stream: the task's cursor and the groups drawn but not trained
        (still generating, or finished and waiting), which a resumed run issues again. Taken on the event loop."""
        return {"groups_drawn": self.manager.groups_drawn, "reissue": sorted(self.buffer.entries)}

    def resume(self, state: dict[str, Any], version: int, trained_groups: int) -> None:
        """Continue from a checkpoint: trainer and engines at `version`, `trained_groups` already trained."""
        self.manager.resume(state["groups_drawn"], state["reissue"])
        self.gate.v_train = self.gate.v_engine = version
        self.gate.admitted = trained_groups

    def metrics(self, step_s: float) -> dict[str, float]:
        """Where work waits and how far behind it is, for a step that took `step_s`: staleness of groups still
        generating vs finished in the buffer (versions behind the trainer, from the engines' version at their
        start), the engines' lag, drops, and the share of the step with nothing generating."""
        gate = self.gate

        def mean_lag(entries) -> float:
            return sum(gate.v_train - e.start_version for e in entries) / len(entries) if entries else 0.0

        idle_now = self.idle.read()
        idle, self._idle_at_last_metrics = idle_now - self._idle_at_last_metrics, idle_now
        in_flight, in_queue = self.buffer.in_flight, self.buffer.in_queue
        failed, self._failed_at_last_metrics = self.failed_groups - self._failed_at_last_metrics, self.failed_groups
        lost, self._lost_at_last_metrics = self.lost_samples - self._lost_at_last_metrics, self.lost_samples
        return {"rollout/failed_groups": float(failed), "rollout/lost_samples": float(lost), "staleness/in_flight": mean_lag(in_flight), "staleness/in_queue": mean_lag(in_queue),
                "async/in_flight_groups": float(len(in_flight)), "async/buffer_groups": float(len(in_queue)),
                "async/dropped_stale": float(gate.dropped_stale), "async/syncs": float(gate.syncs),
                "weights/lag": float(gate.lag), "time/rollout_idle_frac": min(1.0, idle / step_s)}

    async def stop(self) -> None:
        """Cancel the producer and every group still generating; their requests are abandoned (the engines abort
        a request whose client hung up)."""
        tasks = [t for t in (self._producer, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
