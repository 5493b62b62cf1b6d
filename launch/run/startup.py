"""Start-up progress: one line per phase (model, ray, placement, engines, router, trainer, weights) with the seconds it took,
so the first minute of a run says what it is waiting for."""
from __future__ import annotations

import time


class StartupClock:
    """`clock("engines", "2 embedded engines serve /health")` prints `sluice: engines   4.1 s  2 embedded ...`,
    timed from the previous phase; `clock.finished(...)` prints the total."""

    def __init__(self) -> None:
        self.started = self.last = time.monotonic()

    def __call__(self, phase: str, detail: str) -> None:
        now = time.monotonic()
        print(f"sluice: {phase:<8}{now - self.last:6.1f} s  {detail}", flush=True)
        self.last = now

    def finished(self, detail: str) -> None:
        print(f"sluice: started in {time.monotonic() - self.started:.1f} s; {detail}", flush=True)
