"""The rollout buffer: groups from admission to training. A group is registered when it starts (with its deadline
from the staleness gate) and filled in when its rollout function returns; a train step takes whole groups: enough
of the earliest deadlines that every group can still be trained in time, the rest in `rollout.buffer_order`.
Pure bookkeeping, no waiting."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from glue.loop.staleness import StalePolicy, StalenessGate
from glue.types import Group, Sample, SampleStatus

BufferOrder = Literal["fifo", "newest_first", "group_id"]  # group_id: deterministic mode, independent of timing


@dataclass(kw_only=True)
class Entry:
    group_id: int
    deadline: int  # the last train step (version) that keeps this group within max_staleness
    start_version: int  # the engines' version when it started: a lower bound of its tokens' versions
    group: Group | None = None  # set when the rollout function returned
    finished_order: int = -1


class RolloutBuffer:
    """In-flight and finished groups, keyed by group id."""

    def __init__(self, *, groups_per_step: int, order: BufferOrder = "fifo", stale_policy: StalePolicy = "drop"):
        if order not in ("fifo", "newest_first", "group_id"):
            raise ValueError(f"rollout.buffer_order must be 'fifo' or 'newest_first', got {order!r}")
        if stale_policy not in ("drop", "keep"):
            raise ValueError(f"sync.stale_policy must be 'drop' or 'keep', got {stale_policy!r}")
        self.groups_per_step, self.order, self.stale_policy = groups_per_step, order, stale_policy
        self.entries: dict[int, Entry] = {}
        self._finished = 0

    def started(self, group_id: int, *, deadline: int, start_version: int) -> None:
        if group_id in self.entries:
            raise AssertionError(f"group {group_id} started twice")
        self.entries[group_id] = Entry(group_id=group_id, deadline=deadline, start_version=start_version)

    def finished(self, group: Group) -> None:
        entry = self.entries[group.group_id]
        entry.group, entry.finished_order = group, self._finished
        self._finished += 1

    def discard(self, group_id: int) -> None:
        """Forget a group that will not be trained (it failed as a whole)."""
        self.entries.pop(group_id, None)

    @property
    def in_flight(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.group is None]

    @property
    def in_queue(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.group is not None]

    def is_ready(self, gate: StalenessGate) -> bool:
        """A train step can start: enough finished groups, chosen so that every group, finished or still
        generating, can still be trained by its deadline."""
        return self._choose(gate) is not None

    def _choose(self, gate: StalenessGate) -> list[Entry] | None:
        """The next step's groups, or None while no choice among the finished ones keeps every group in time.

        Step j = v_train takes B groups; steps j+1..k have (k - j) x B places, so after this step at most that many
        untrained groups may have a deadline <= k (Hall's condition for fitting every group into a step by its
        deadline). Admission keeps this satisfiable; picking the finished groups with the earliest deadlines
        satisfies it whenever any choice does, and waiting for groups still generating is what makes it so. Within
        that freedom groups go by `order`. With admission off (no deadlines) it is just `order`."""
        size = self.groups_per_step
        if self.order == "group_id":  # deterministic: the next ids, whatever finished first (they are the earliest due)
            first = sorted(self.entries.values(), key=lambda e: e.group_id)[:size]
            return first if len(first) == size and all(e.group is not None for e in first) else None
        queue = sorted(self.in_queue, key={"fifo": lambda e: e.finished_order, "newest_first": lambda e: -e.finished_order,
                                           "group_id": lambda e: e.group_id}[self.order])
        if len(queue) < size:
            return None
        if not gate.admission:
            return queue[:size]
        chosen: list[Entry] = []
        for level in sorted({e.deadline for e in self.entries.values()}):
            places_after = max(level - gate.v_train, 0) * size
            need = sum(e.deadline <= level for e in self.entries.values()) - places_after
            short = need - sum(e.deadline <= level for e in chosen)
            if short > 0:
                extra = [e for e in queue if e.deadline <= level and e not in chosen][:short]
                if len(extra) < short or len(chosen) + short > size:
                    return None if self.in_flight else _earliest(queue, size)  # only after faults: too stale
                chosen += extra
        return chosen + [e for e in queue if e not in chosen][: size - len(chosen)]

    def take(self, gate: StalenessGate) -> tuple[list[Group], set[tuple[int, int]]]:
        """The next step's groups (see `_choose`) and the (group, index) of samples withheld from training for
        being too stale (`drop`; they still count in their group's baseline). Each withheld sample is counted in
        `gate.dropped_stale`."""
        chosen = self._choose(gate)
        if chosen is None:
            raise AssertionError("RolloutBuffer.take() called before is_ready()")
        for e in chosen:
            del self.entries[e.group_id]
        groups = [e.group for e in chosen]
        withheld = {(s.group_id, s.index) for g in groups for s in g.samples
                    if self.stale_policy == "drop" and is_trainable(s) and gate.is_too_stale(s.versions)}
        gate.dropped_stale += len(withheld)
        return groups, withheld


def _earliest(queue: list[Entry], size: int) -> list[Entry]:
    return sorted(queue, key=lambda e: (e.deadline, e.finished_order))[:size]


def is_trainable(sample: Sample) -> bool:
    """Failed samples have no usable reward, and a sample still aborted after its resumes is incomplete."""
    return sample.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)
