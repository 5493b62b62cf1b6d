"""SIGINT and SIGTERM during a run. Once training runs, the first signal asks the loop to stop after the step in
progress, waiting for it at most `grace_s` (run.stop_grace_s): a step still waiting on groups then is cut, its
groups' samples so far checkpointed (nothing more is trained, every process is stopped, exit 0); a step still
training or syncing then is not cut, and a line says its checkpoint follows it. A second signal,
or any during start-up, stops at once (KeyboardInterrupt unwinds the run's ExitStack; exit 130). While the processes
are being stopped, signals are only acknowledged: an interrupted clean-up would leave processes (or a thread blocked
on them) behind."""
from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time


class StopSignals:
    """`with StopSignals(grace_s) as stop:` ... `stop.armed = True` once training runs, `stop.stopping = True` once
    the clean-up begins; `stop()` says a stop was asked, `await stop.grace_over()` returns once its grace ran out."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    POLL_S = 0.1  # how often grace_over looks at the clock (the handler runs between the loop's callbacks)
    LATE_S = 1.0  # after the grace, how long a cut may take to start before the step is said to be still running

    def __init__(self, grace_s: float | None = None) -> None:
        self.grace_s = grace_s  # None: the step in progress is always waited for (SFT: its steps never wait on groups)
        self.requested: str | None = None  # the signal's name, once one came while armed
        self.requested_at: float | None = None  # time.monotonic() of that signal
        self.armed = False
        self.stopping = False
        self.cut = False  # the grace ran out while the step waited on groups, and the wait was cut
        self.fault: str | None = None  # the line of a fault that asked the stop (`for_fault`); the run ends with it
        self._asked, self._closed = threading.Event(), threading.Event()  # a stop was asked; the context was left
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        if self.grace_s is not None:
            threading.Thread(target=self._say_when_still_running, name="stop-grace", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __call__(self) -> bool:
        return self.requested is not None

    async def grace_over(self) -> None:
        """Return once a stop was asked `grace_s` ago (never without one), saying that the step is being cut."""
        while (self.requested_at is None or self.grace_s is None
               or time.monotonic() < self.requested_at + self.grace_s):
            await asyncio.sleep(self.POLL_S)
        self.cut = True
        print(f"sluice: the step in progress did not finish within run.stop_grace_s={self.grace_s:g} s: cancelling "
              "the groups still generating; their samples so far go into the checkpoint", file=sys.stderr, flush=True)

    def for_fault(self, line: str) -> None:
        """A fault the run cannot repair that leaves the trainer whole (an engine whose node is gone, with no room
        for it elsewhere) asks the stop a signal asks: the step in progress ends and its checkpoint is written, so
        nothing trained is lost; the run then ends with `line` (exit 1). Called on the run's event loop."""
        if self.requested is not None:
            return
        self.fault, self.requested, self.requested_at = line, "a fault", time.monotonic()
        print(f"sluice: {line}: stopping after the step in progress, with its checkpoint", file=sys.stderr, flush=True)
        self._asked.set()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            print(f"\nsluice: {name}: already stopping the processes it started", file=sys.stderr, flush=True)
            return
        if not self.armed or self.requested is not None:
            raise KeyboardInterrupt(name)
        self.requested, self.requested_at = name, time.monotonic()
        grace = "" if self.grace_s is None else (f", or in {self.grace_s:g} s (run.stop_grace_s) with its unfinished "
                                                 "groups checkpointed")
        print(f"\nsluice: {name}: stopping after the step in progress{grace} (send it again to stop at once)",
              file=sys.stderr, flush=True)
        self._asked.set()

    def _say_when_still_running(self) -> None:
        """Once a stop's grace is over with nothing cut, the step is training, syncing or checkpointing, which cannot be
        cut without losing it; say so, since whoever sent the signal may be about to SIGKILL. (A thread of its own,
        started with the handlers: a signal handler only sets an event.)"""
        while not self._asked.wait(self.LATE_S):
            if self._closed.is_set():
                return
        if self._closed.wait(self.grace_s + self.LATE_S) or self.cut or self.stopping:
            return
        print(f"sluice: run.stop_grace_s={self.grace_s:g} s has passed and the step in progress is training, syncing "
              "weights or writing its checkpoint, which is not cut: the checkpoint follows it (a SIGKILL before then "
              "loses the steps since the last checkpoint)", file=sys.stderr, flush=True)


def cancel_tasks(loop: asyncio.AbstractEventLoop, timeout_s: float = 30.0) -> None:
    """Cancel every task still pending on `loop` (the loop, the stream, groups, the fleet watch) and let them unwind,
    so that no task is destroyed pending when the loop closes ("Task was destroyed but it is pending!", "Event loop
    is closed" from their finally blocks). Each is cancelled once (a second cancel would cut its clean-up short); a
    task that ignores its cancellation is left after `timeout_s`."""
    deadline, cancelled = time.monotonic() + timeout_s, set()
    while True:
        pending = {task for task in asyncio.all_tasks(loop) if not task.done()}
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            break
        for task in pending - cancelled:
            task.cancel()
        cancelled |= pending
        try:
            loop.run_until_complete(asyncio.wait(pending, timeout=left))
        except KeyboardInterrupt:  # a task the signal landed in re-raises it to whoever awaited it: go on unwinding
            continue
    for task in cancelled:  # retrieved, so none is reported as "exception was never retrieved"
        if task.done() and not task.cancelled():
            task.exception()


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close the run's event loop on every way out, its pending tasks cancelled first."""
    if not loop.is_closed():
        cancel_tasks(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
