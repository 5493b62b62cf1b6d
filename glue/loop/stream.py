"""The rollout stream: keeps groups generating whenever the staleness gate admits one, collects finished groups
in the buffer, and hands the trainer a step's groups once the buffer is ready. Weight syncs go through it so
admission stops while generation is paused. Runs on the loop's event loop; the blocking sync runs in a thread."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Protocol

from glue.loop.buffer import RolloutBuffer, is_trainable
from glue.loop.stall import StallWarnings
from glue.loop.staleness import StalenessGate
from glue.types import Group


class GroupSource(Protocol):
    """What the stream drives of the rollout manager (glue.rollout.manager.RolloutManager): the next group to
    generate, and for checkpoints the task's cursor and the samples of groups in flight, which `resume` gives back.
    It lives with its user: the stream never imports the manager (which loads rollout functions and talks to
    engines), and tests hand it doubles."""

    @property
    def groups_drawn(self) -> int: ...
    @property
    def partial_rollouts(self) -> str: ...  # "resume": a checkpoint keeps the tokens of groups in flight

    def next_group(self) -> tuple[int, Awaitable[Group]]: ...
    def partial_samples(self, group_ids: list[int]) -> dict[int, list[dict]]: ...
    def resume(self, groups_drawn: int, reissue: list[int], partial: dict[int, list[dict]] | None = None) -> None: ...


class BatchStream(Protocol):
    """What the loop (glue.loop.controller) drives of a stream: `RolloutStream` below, or a train_only run's
    `ReplayStream` (glue.loop.replay; `SavingStream` wraps either). `gate`: the staleness gate it admits groups by."""

    gate: StalenessGate

    def start(self) -> None: ...
    async def next_batch(self) -> tuple[list[Group], set[tuple[int, int]]]: ...
    def trained(self, version: int) -> None: ...
    async def sync(self, transfer: Callable[[], None], version: int) -> None: ...
    def metrics(self, step_s: float) -> dict[str, float]: ...
    async def checkpoint_state(self, fleet: Any) -> dict[str, Any]: ...
    async def stop(self) -> None: ...


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
    is counted; more than `max_failed_frac` of a step's groups failing stops the run with RolloutFailed. With
    `dynamic_sampling` (DAPO) a group whose rewards are all equal gives its place back the same way, counted in
    `rollout/filtered_groups`, bounded by `max_filtered_frac`. With `stalls`, a step that waits long on groups
    says so (glue.loop.stall)."""

    def __init__(self, *, manager: GroupSource, gate: StalenessGate, buffer: RolloutBuffer, max_groups: int,
                 max_concurrent: int | None = None, max_failed_frac: float = 0.5, drain_before_sync: bool = False,
                 dynamic_sampling: bool = False, max_filtered_frac: float = 0.9,
                 stalls: StallWarnings | None = None):
        self.manager, self.gate, self.buffer, self.max_groups = manager, gate, buffer, max_groups
        self.max_concurrent = max_concurrent  # groups generating at once (None: as many as the gate admits)
        self.max_failed_frac = max_failed_frac
        self.drain_before_sync = drain_before_sync  # deterministic mode: no rollout spans a weight sync
        self.dynamic_sampling, self.max_filtered_frac = dynamic_sampling, max_filtered_frac
        self.stalls = stalls
        self._started_at: dict[int, float] = {}  # group id -> when it started generating (time.monotonic)
        self.filtered_groups = 0  # groups dropped for equal rewards, over the run
        self._filtered_this_step = 0
        self._filtered_at_last_metrics = 0
        self.failed_groups = 0  # over the run
        self.lost_samples = 0  # samples of groups that failed because the fleet could not serve them, over the run
        self._lost_at_last_metrics = 0
        self.resume_limit_drops = 0  # samples given up after RolloutContext.max_resumes continuations, over the run
        self._resume_drops_at_last_metrics = 0
        self._failed_this_step: list[Group] = []
        self._failed_at_last_metrics = 0
        self.idle = IdleClock()
        self._idle_at_last_metrics = 0.0
        self._tasks: dict[int, asyncio.Task] = {}
        self._paused = False
        self._error: BaseException | None = None
        self._changed: asyncio.Event | None = None
        self._producer: asyncio.Task | None = None
        self._admitted_before: dict[int, tuple[int, int]] = {}  # group id -> (deadline, start version) to restore

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
        # a group a resumed run issues again keeps the bound it was admitted under: its tokens are that old
        deadline, start_version = self._admitted_before.pop(group_id, (deadline, self.gate.v_engine))
        self.buffer.started(group_id, deadline=deadline, start_version=start_version)
        task = asyncio.ensure_future(coroutine)
        self._tasks[group_id] = task
        self._started_at[group_id] = time.monotonic()
        task.add_done_callback(lambda t, gid=group_id: self._on_done(gid, t))
        self.idle.set(self._paused)
        self._changed.set()  # a step waiting for the groups a resume issues again (next_batch) looks again

    def _on_done(self, group_id: int, task: asyncio.Task) -> None:
        self._tasks.pop(group_id, None)
        self._started_at.pop(group_id, None)
        if task.cancelled():
            return
        if task.exception() is not None:
            self._error = self._error or task.exception()
        else:
            self._accept(task.result())
        self.idle.set(self._paused or not self._tasks)
        self._changed.set()

    def _accept(self, group: Group) -> None:
        self.resume_limit_drops += sum(s.metadata.get("resume_limit_hit", 0) for s in group.samples)
        if group.error is not None:
            self._count_failure(group)
        trainable = [s for s in group.samples if is_trainable(s)]
        is_flat = self.dynamic_sampling and len({s.scalar_reward for s in trainable}) == 1
        if trainable and not is_flat:
            self.buffer.finished(group)
        else:  # nothing to learn from: give its place back so another group can start
            self.buffer.discard(group.group_id)
            self.gate.give_back()
        if trainable and is_flat:
            self._count_filtered()

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

    def _count_filtered(self) -> None:
        """Like failures: once the dropped groups alone exceed `max_filtered_frac` of the step (dropped + kept),
        the task gives the policy too few groups with a learning signal to go on."""
        self.filtered_groups += 1
        self._filtered_this_step += 1
        filtered, good = self._filtered_this_step, self.buffer.groups_per_step
        if filtered > self.max_filtered_frac * (filtered + good) and self._error is None:
            self._error = RolloutFailed(
                f"{filtered} groups had all-equal rewards and were dropped (rollout.dynamic_sampling) while a step "
                f"of {good} was collected, more than rollout.max_filtered_frac={self.max_filtered_frac:g} of them; "
                "the task is too hard or too easy for the policy: raise rollout.max_filtered_frac, "
                "rollout.samples_per_prompt, or set rollout.dynamic_sampling=false")

    async def next_batch(self) -> tuple[list[Group], set[tuple[int, int]]]:
        """Wait until the buffer holds a step's groups (re-raising a rollout function's error), then take them.
        After a resume, not before every group to issue again is back in the buffer with its deadline: a choice made
        without them could pass over one that is due now, which would then train over-stale."""
        waiting = self._wait_for(lambda: self._error is not None or (not self._admitted_before
                                                                     and self.buffer.is_ready(self.gate)))
        if self.stalls is not None:
            await self.stalls.watch(waiting, self.group_ages)
        else:
            await waiting
        if self._error is not None:
            raise self._error
        self._failed_this_step, self._filtered_this_step = [], 0
        return self.buffer.take(self.gate)

    def group_ages(self) -> list[float]:
        """Seconds each group still generating has been at it."""
        now = time.monotonic()
        return [now - started for started in self._started_at.values()]

    def trained(self, version: int) -> None:
        self.gate.trained(version)
        self._changed.set()

    async def sync(self, transfer: Callable[[], None], version: int) -> None:
        """Stop admitting, run the blocking `transfer` (pause -> weights -> continue) in a thread, record the
        engines' new version, admit again."""
        self._paused = True
        self.idle.set(True)
        try:
            if self.drain_before_sync:  # every group in flight finishes on the weights it started with
                await self._wait_for(lambda: not self._tasks or self._error is not None)
            await asyncio.to_thread(transfer)
            self.gate.synced(version)
        finally:
            self._paused = False
            self.idle.set(not self._tasks)
            self._changed.set()

    def resume_state(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this stream: the task's cursor, the finished groups waiting in the
        buffer (whole: tokens, logprobs, versions, rewards), and the ids of the groups still generating, which a
        resumed run issues again, with the deadline and start version each was admitted under. Taken on the event
        loop."""
        finished = [{"group": e.group.to_dict(), "deadline": e.deadline, "start_version": e.start_version}
                    for e in sorted(self.buffer.in_queue, key=lambda e: e.finished_order)]
        in_flight = sorted(self.buffer.in_flight, key=lambda e: e.group_id)
        ids = [e.group_id for e in in_flight]
        return {"groups_drawn": self.manager.groups_drawn, "finished": finished, "reissue": ids,
                "admitted": {str(e.group_id): [e.deadline, e.start_version] for e in in_flight},
                "partial": self.manager.partial_samples(ids)}

    async def checkpoint_state(self, fleet: Any) -> dict[str, Any]:
        """`resume_state()` with the tokens generated so far by the groups in flight: generation is paused with
        mode "abort", so the engines hand every request's tokens back to its rollout function (which keeps them in
        its tracked samples and asks again: those requests wait behind the pause), then it continues. Without
        groups in flight, or with partial_rollouts "restart" (which would throw the tokens away), just the state."""
        if not self.buffer.in_flight or self.manager.partial_rollouts != "resume":
            return self.resume_state()
        await asyncio.to_thread(fleet.pause_generation, "abort")
        try:
            await fleet.calls_settled()
            return self.resume_state()
        finally:
            await asyncio.to_thread(fleet.continue_generation)

    def resume(self, state: dict[str, Any], version: int, trained_groups: int) -> None:
        """Continue from a checkpoint: trainer and engines at `version`, `trained_groups` already trained; the
        buffer's finished groups come back as they were, the ones that were generating are issued again under the
        deadlines they were admitted with (a fresh one would let their old tokens train over-stale, or be dropped)."""
        self.manager.resume(state["groups_drawn"], state["reissue"], state.get("partial"))
        # checkpoints before 2026-11-25 lack "admitted": those groups get fresh deadlines, as they did then
        self._admitted_before = {int(gid): (int(deadline), int(start))
                                 for gid, (deadline, start) in state.get("admitted", {}).items()}
        self.gate.v_train = self.gate.v_engine = version
        self.gate.admitted = trained_groups
        for entry in state.get("finished", []):  # checkpoints before 2026-11-23 re-issued these too
            group = Group.from_dict(entry["group"])
            self.buffer.started(group.group_id, deadline=entry["deadline"], start_version=entry["start_version"])
            self.buffer.finished(group)
            self.gate.admitted += 1

    def metrics(self, step_s: float) -> dict[str, float]:
        """Where work waits and how far behind it is, for a step that took `step_s`: staleness of groups still
        generating vs finished in the buffer (versions behind the trainer, from the engines' version at their
        start), the engines' lag, drops (stale samples, and samples given up at the resume limit), and the share of
        the step with nothing generating."""
        gate = self.gate

        def mean_lag(entries) -> float:
            return sum(gate.v_train - e.start_version for e in entries) / len(entries) if entries else 0.0

        idle_now = self.idle.read()
        idle, self._idle_at_last_metrics = idle_now - self._idle_at_last_metrics, idle_now
        in_flight, in_queue = self.buffer.in_flight, self.buffer.in_queue
        failed, self._failed_at_last_metrics = self.failed_groups - self._failed_at_last_metrics, self.failed_groups
        lost, self._lost_at_last_metrics = self.lost_samples - self._lost_at_last_metrics, self.lost_samples
        resume_drops = self.resume_limit_drops - self._resume_drops_at_last_metrics
        self._resume_drops_at_last_metrics = self.resume_limit_drops
        filtered, self._filtered_at_last_metrics = (self.filtered_groups - self._filtered_at_last_metrics,
                                                    self.filtered_groups)
        return {"rollout/failed_groups": float(failed), "rollout/filtered_groups": float(filtered),
                "rollout/lost_samples": float(lost), "rollout/resume_limit_drops": float(resume_drops),
                "staleness/in_flight": mean_lag(in_flight), "staleness/in_queue": mean_lag(in_queue),
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
        self._started_at.clear()
