"""A whole `python -m launch` run driven from outside, as `make chaos` and `make soak` drive theirs: the run in a
session of its own with its lines collected, its processes found by pid and command line, and what it trained read
back from its own record (metrics.jsonl and run.save_rollouts), not from what it says about itself."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from conftest import REPO_ROOT, descendants


class Session:
    """One `python -m launch` process in a session of its own; its stdout and stderr are collected line by line
    (and copied to `log`)."""

    def __init__(self, argv: list[str], log: Path):
        self.log = log.open("a")
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, start_new_session=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.log.write(line)
            self.log.flush()

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def repairs(self) -> list[str]:
        """Why the run restarted each engine (its `...; restarting it` lines), without urls and log paths."""
        found = [line[line.index("sluice: engine"):].split("; restarting it")[0] for line in list(self.lines)
                 if "; restarting it (" in line and "sluice: engine" in line]
        return [re.sub(r" \(http://\S+\)|; its log: \S+", "", why).removeprefix("sluice: ") for why in found]

    def processes(self, markers: tuple[bytes, ...], roots: tuple[int, ...] = ()) -> list[int]:
        """Processes below the run (and below `roots`: the Ray nodes of a cluster it attached to, whose workers
        start its engines) whose command line holds one of `markers`."""
        below = descendants(self.proc.pid).union(*(descendants(root) for root in roots))
        found = []
        for pid in below:
            try:
                cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
                if any(marker in cmdline for marker in markers):
                    found.append(pid)
            except OSError:
                continue
        return sorted(found)

    def engine_pids(self, roots: tuple[int, ...] = ()) -> list[int]:
        """The engines this run started: processes running glue.embedded_engine."""
        return self.processes((b"glue.embedded_engine",), roots)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.reader.join(timeout=10)
            self.log.close()

    def kill(self) -> None:
        """SIGKILL the run and everything below it (by pid, each one seen), if still running."""
        below = descendants(self.proc.pid) if self.proc.poll() is None else set()
        for pid in [self.proc.pid, *below]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a stopped process takes its SIGKILL only once continued
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.exists() else 0


def wait_until(condition, session: Session, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if session.proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {session.proc.returncode}) while waiting for {what}; "
                               f"last lines:\n" + "\n".join(session.lines[-15:]))
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s; last lines:\n" + "\n".join(session.lines[-15:]))
        time.sleep(0.1)


def trained_figures(run_dir: Path, *, groups: int, max_staleness: int) -> dict:
    """What the run's record says it trained (`groups` per step): steps, lost groups (group ids below the highest
    one drawn that no step trained), groups trained twice, tokens trained beyond `max_staleness` (each saved step's
    samples, against the trainer version it trained from: step - 1), steps whose weights/version is not the step."""
    from glue.metrics.logger import read_metrics

    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 1]
    steps = [r["step"] for r in records]
    trained_ids, over_stale, trained_tokens = [], 0, 0
    for step in steps:
        saved = json.loads((run_dir / "rollouts" / f"step_{step:08d}.json").read_text())
        withheld = {tuple(key) for key in saved["withheld"]}
        for group in saved["groups"]:
            trained_ids.append(group["group_id"])
            for s in group["samples"]:
                if s["status"] in ("failed", "aborted") or (s["group_id"], s["index"]) in withheld:
                    continue
                versions = [v for v, m in zip(s["versions"], s["loss_mask"]) if m]
                trained_tokens += len(versions)
                over_stale += sum((step - 1) - v > max_staleness for v in versions)
    drawn = range(max(max(trained_ids, default=-1) + 1, len(steps) * groups))  # every id up to the last trained
    return {
        "steps_completed": len(set(steps)),
        "logged_steps": steps,
        "lost_groups": len(set(drawn) - set(trained_ids)),
        "repeated_groups": len(trained_ids) - len(set(trained_ids)),
        "over_stale_tokens": over_stale,
        "trained_tokens": trained_tokens,
        "version_mismatches": sum(r["weights/version"] != r["step"] for r in records),
        "failed_groups": sum(r["rollout/failed_groups"] for r in records),
        "lost_samples": sum(r["rollout/lost_samples"] for r in records),
        "staleness_max": max((r["staleness/max"] for r in records), default=0.0),
        "aborts_without_routing": sum(r.get("rollout/aborts_without_routing", 0) for r in records),
        "routing_agreement_mean": mean([r["moe/routing_agreement"] for r in records if "moe/routing_agreement" in r]),
    }


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None
