"""Per-step metrics: one JSON object per line in `runs/<name>/metrics.jsonl`, plus the timers that fill `time/*`."""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Iterator


class MetricsLogger:
    """Appends one JSON record per step; values must be plain numbers or strings (tensors are converted)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict[str, Any]) -> None:
        clean = {key: _plain(value) for key, value in record.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(clean) + "\n")


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep it visible instead of failing the run
    return value


class StepTimer:
    """`with timer("rollout"): ...` records wall seconds as `time/rollout_s`."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.metrics[f"time/{phase}_s"] = time.perf_counter() - start


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file, in step order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def learning_summary(records: list[dict[str, Any]], window: int = 5) -> str:
    """One line saying whether reward moved: mean `rollout/reward_mean` over the first and last `window` steps."""
    rewards = [r["rollout/reward_mean"] for r in records if isinstance(r.get("rollout/reward_mean"), (int, float))]
    if not rewards:
        return "no rollout/reward_mean recorded"
    n = min(window, len(rewards))
    first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
    return f"reward_mean: first {n} steps {first:.3f} -> last {n} steps {last:.3f} ({last - first:+.3f})"
