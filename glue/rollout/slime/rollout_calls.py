"""slime's whole-rollout contract, long-lived: `generate_rollout(args, rollout_id, data_source, evaluation=False)` is
called as slime's rollout manager calls it, once for a step's worth of groups (`rollout_id` 0, 1, 2, ...), on one
thread of its own, against one `PromptDataSource` that lives as long as the run. What a function keeps between
calls (a background worker with its own event loop and a queue of finished groups, slime's fully-async pattern)
therefore works as in slime.

sluice's steps ask for groups one at a time (`next_group`, from each admitted group's rollout function); a call is
made when groups are asked for and none is left over from the last call, and the groups a call returns serve the
askers in order (the rest wait for the next ones). At the run's end `close` lets a call in progress finish (at most
`CLOSE_WAIT_S`), then runs the exit hooks the function's module registered (glue.rollout.slime.user_code): slime's
workers stop there, as at slime's process exit. Threads the function starts reach the run's fleet (its API key) from
the first call until they end."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import threading
from typing import Any, Callable

from glue.rollout.slime import http_calls, user_code
from glue.rollout.slime.data_source import PromptDataSource

CLOSE_WAIT_S = 30.0  # at the run's end, how long a call in progress may take to finish


class RolloutCalls:
    """`await next_group(prompt)` gives one finished group (a list of slime samples, with the /generate answers
    recorded while its call ran); `close()` at the run's end."""

    def __init__(self, fn: Callable, args: Any, source: PromptDataSource, *, fleet: http_calls.Fleet, where: str):
        self.fn, self.args, self.source, self.fleet, self.where = fn, args, source, fleet, where
        self.calls = 0  # calls made so far: the next call's rollout_id
        self._waiting: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = collections.deque()
        self._finished: collections.deque[tuple[list, list]] = collections.deque()  # (group, recorded answers)
        self._changed = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._serving = contextlib.ExitStack()  # the fleet served to every thread while calls may run
        self._threads_before: set[int] = set()  # threads alive before the first call: not the function's

    async def next_group(self, prompt: dict) -> tuple[list, list]:
        """Offer `prompt` to the data source and wait for the next finished group and the answers recorded."""
        self.source.offer(prompt)
        future = asyncio.get_running_loop().create_future()
        with self._changed:
            if self._closing:
                raise RuntimeError(f"{self.where}: the run is ending; no more rollout calls")
            self._waiting.append((asyncio.get_running_loop(), future))
            self._serve()
            self._changed.notify_all()
            if self._thread is None:  # from here until close() has run the exit hooks, the threads the function
                self._serving.enter_context(http_calls.serving_all_threads(self.fleet))  # starts reach the fleet
                self._threads_before = {t.ident for t in threading.enumerate()}
                self._thread = threading.Thread(target=self._call_when_asked, name="slime-rollout-calls",
                                                daemon=True)  # a call stuck in user code never holds the process
                self._thread.start()
        try:
            return await future
        finally:
            with self._changed:
                self._waiting = collections.deque(w for w in self._waiting if w[1] is not future)

    def _call_when_asked(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closing or bool(self._waiting))
                if self._closing:
                    return
                rollout_id, self.calls = self.calls, self.calls + 1
            try:
                groups, answers = self._call(rollout_id)
            except Exception as err:  # noqa: BLE001 - the groups waiting fail with it, counted by the stream
                self._fail_waiting(err)
                continue
            with self._changed:
                self._finished.extend((group, answers) for group in groups)
                self._serve()

    def _call(self, rollout_id: int) -> tuple[list[list], list]:
        with http_calls.recording() as record:
            output = self.fn(self.args, rollout_id, self.source)
        groups = getattr(output, "samples", output)
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise TypeError(f"{self.where} must return RolloutFnTrainOutput(samples=[[Sample, ...], ...]) or a list "
                            f"of groups, got {type(output).__name__}")
        if not groups:
            raise ValueError(f"{self.where} returned no groups (rollout_id {rollout_id}); a call returns "
                             f"args.rollout_batch_size={self.args.rollout_batch_size} groups")
        return [_flat(group) for group in groups], record.calls

    def _serve(self) -> None:
        """Hand finished groups to the askers, oldest first (called holding `_changed`)."""
        while self._waiting and self._finished and not self._closing:
            (loop, future), item = self._waiting.popleft(), self._finished.popleft()
            loop.call_soon_threadsafe(self._deliver, future, item)

    def _deliver(self, future: asyncio.Future, item: tuple[list, list]) -> None:
        if not future.done():
            future.set_result(item)
            return
        with self._changed:  # the asker gave up meanwhile (its group timed out): the next one gets the group
            self._finished.appendleft(item)
            self._serve()

    def _fail_waiting(self, err: Exception) -> None:
        with self._changed:
            waiting, self._waiting = list(self._waiting), collections.deque()
            if self._closing:
                return
        for loop, future in waiting:
            loop.call_soon_threadsafe(_fail, future, err)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """No more calls; a call in progress may finish (at most `wait_s`), then the function's exit hooks run."""
        with self._changed:
            self._closing = True
            self._waiting.clear()
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(wait_s)
        for line in user_code.run_exit_hooks(self.fn):
            print(f"sluice: {self.where}: an exit hook failed: {line}", file=sys.stderr, flush=True)
        self._stop_serving_after(self._threads_left())

    def _threads_left(self) -> list[threading.Thread]:
        """Threads the function started that still run after its exit hooks (slime's fully-async worker drains its
        groups in flight for up to 30 s after its hook has waited 5 s for it)."""
        return [t for t in threading.enumerate()
                if t.ident not in self._threads_before and t is not self._thread and t.is_alive()]

    def _stop_serving_after(self, threads: list[threading.Thread]) -> None:
        """Serve the fleet to the function's threads until they end (their last requests authenticate), then stop."""
        def wait_then_close() -> None:
            for thread in threads:
                thread.join()
            self._serving.close()
        if not threads:
            self._serving.close()
            return
        threading.Thread(target=wait_then_close, name="slime-fleet-release", daemon=True).start()
        if self._thread is not None and self._thread.is_alive():
            print(f"sluice: {self.where}: call {self.calls - 1} still running {wait_s:g} s after the run's end; "
                  "left to finish on its own (its thread does not hold the process)", file=sys.stderr, flush=True)


def _flat(group: list) -> list:
    """A group as one list of samples (slime's fan-out groups hold a list of samples per prompt sample)."""
    return [s for item in group for s in (item if isinstance(item, list) else [item])]


def _fail(future: asyncio.Future, err: Exception) -> None:
    if not future.done():
        future.set_exception(err)
