"""Hangs speak: while a train step waits on groups, `StallWarnings` says so once it has waited `after_s`
(rollout.stall_warning_s), and again each time the wait has doubled: how many groups are outstanding, the oldest
one's age, and which rollout function and task they run. Used by the rollout stream's `next_batch`."""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StallWarnings:
    """`await stalls.watch(waiting, ages)`: `waiting`'s result, with a line to `echo` at `after_s`, 2 x, 4 x ...
    `ages()` gives the seconds each outstanding group has been generating. `source` names the rollout function and
    task; `group_timeout_s` (None: no limit) is said with it, so a reader knows when the groups will be cut."""

    def __init__(self, *, after_s: float, source: str, group_timeout_s: float | None = None,
                 echo: Callable[[str], None] = to_stderr):
        if not after_s > 0:
            raise ValueError(f"rollout.stall_warning_s must be > 0, got {after_s}")
        self.after_s, self.source, self.group_timeout_s, self.echo = after_s, source, group_timeout_s, echo
        self.warnings = 0  # lines said over the run

    async def watch(self, waiting: Awaitable[T], ages: Callable[[], list[float]]) -> T:
        task = asyncio.ensure_future(waiting)
        started, notice_at = time.monotonic(), self.after_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=max(0.0, started + notice_at - time.monotonic()))
                if done:
                    return task.result()
                self.echo(self.line(time.monotonic() - started, ages(), next_s=2 * notice_at))
                self.warnings += 1
                notice_at *= 2
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def line(self, waited_s: float, ages: list[float], *, next_s: float) -> str:
        """E.g. `sluice: the step has waited 61 s on groups: 3 outstanding, the oldest for 75 s (rollout
        function 'mytask:generate_group', task 'mytask:Task'); rollout.group_timeout_s=600 cuts a group; next
        notice at 120 s`."""
        oldest = f", the oldest for {seconds(max(ages))} s" if ages else ""
        limit = ("no rollout.group_timeout_s: a hung group waits forever" if self.group_timeout_s is None
                 else f"rollout.group_timeout_s={self.group_timeout_s:g} cuts a group")
        return (f"sluice: the step has waited {seconds(waited_s)} s on groups: {len(ages)} outstanding{oldest} "
                f"({self.source}); {limit}; next notice at {seconds(next_s)} s")


def seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"
