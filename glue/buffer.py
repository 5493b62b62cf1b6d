"""The rollout buffer: groups from admission to training. A group is registered when it starts (with its deadline
from the staleness gate) and filled in when its rollout function returns; a train step takes whole groups, those
whose deadline is due first, then the rest in `rollout.buffer_order`. Pure bookkeeping, no waiting."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from glue.staleness import StalePolicy, StalenessGate
from glue.types import Group, Sample, SampleStatus

BufferOrder = Literal["fifo", "newest_first"]


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
        if order not in ("fifo", "newest_first"):
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
        """A train step can start: enough finished groups, and none still generating that this step must take."""
        return (len(self.in_queue) >= self.groups_per_step
                and not any(gate.must_take(e.deadline) for e in self.in_flight))

    def take(self, gate: StalenessGate) -> tuple[list[Group], set[tuple[int, int]]]:
        """The next step's groups (due deadlines first, then `order`) and the (group, index) of samples withheld
        from training for being too stale (`drop`; they still count in their group's baseline). Each withheld
        sample is counted in `gate.dropped_stale`."""
        if not self.is_ready(gate):
            raise AssertionError("RolloutBuffer.take() called before is_ready()")
        queue = self.in_queue
        rest_key = (lambda e: e.finished_order) if self.order == "fifo" else (lambda e: -e.finished_order)
        due = sorted((e for e in queue if gate.must_take(e.deadline)), key=lambda e: (e.deadline, e.finished_order))
        rest = sorted((e for e in queue if not gate.must_take(e.deadline)), key=rest_key)
        chosen = (due + rest)[: self.groups_per_step]
        for e in chosen:
            del self.entries[e.group_id]
        groups = [e.group for e in chosen]
        withheld = {(s.group_id, s.index) for g in groups for s in g.samples
                    if self.stale_policy == "drop" and is_trainable(s) and gate.is_too_stale(s.versions)}
        gate.dropped_stale += len(withheld)
        return groups, withheld


def is_trainable(sample: Sample) -> bool:
    """Failed samples have no usable reward, and a sample still aborted after its resumes is incomplete."""
    return sample.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)
