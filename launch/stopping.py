"""SIGINT and SIGTERM during a run. Once training runs, the first signal asks the loop to stop after the step in
progress (nothing more is trained, every process is stopped, exit 0); a second one, or any during start-up, stops at
once (KeyboardInterrupt unwinds the run's ExitStack; exit 130). While the processes are being stopped, signals are
only acknowledged: an interrupted clean-up would leave processes (or a thread blocked on them) behind."""
from __future__ import annotations

import signal
import sys
import threading


class StopSignals:
    """`with StopSignals() as stop:` ... `stop.armed = True` once training runs, `stop.stopping = True` once the
    clean-up begins; `stop()` says a stop was asked."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: str | None = None  # the signal's name, once one came while armed
        self.armed = False
        self.stopping = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __call__(self) -> bool:
        return self.requested is not None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            print(f"\nsluice: {name}: already stopping the processes it started", file=sys.stderr, flush=True)
            return
        if not self.armed or self.requested is not None:
            raise KeyboardInterrupt(name)
        self.requested = name
        print(f"\nsluice: {name}: stopping after the step in progress (send it again to stop at once)",
              file=sys.stderr, flush=True)
