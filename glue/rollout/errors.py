"""What a run says when user code fails during rollout (a rollout function, a task's reward, a tool): the console
shows the first failure of each kind (exception type x the user's function) with its traceback, pointing at the
user's file:line, and collapses the repeats into counts; `runs/<name>/logs/rollout_errors.log` gets every failure
with its traceback and group. Empty responses are warned of once (their count is `rollout/empty_responses`)."""
from __future__ import annotations

import sys
import sysconfig
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Callable

ROLLOUT_ERRORS_LOG = "rollout_errors.log"  # in runs/<name>/logs/
GLUE_DIR = str(Path(__file__).resolve().parents[1])  # sluice's own glue/: never the user's frame
LIBRARY_DIRS = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib",
                                                                              "platlib")})


def to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `err`'s traceback in user code: not sluice's glue/, the standard library or an
    installed package (a verifier that calls a library raises at the user's call into it). None without one."""
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        path = str(Path(frame.filename).resolve()) if not frame.filename.startswith("<") else ""
        if path and not path.startswith(GLUE_DIR + "/") and not path.startswith(LIBRARY_DIRS):
            return frame
    return None


class RolloutErrors:
    """`record(err, ...)` for each failure; `log_path` None: console only (tests, tools). Thread-safe: plain reward
    functions fail on the reward threads."""

    def __init__(self, log_path: str | Path | None = None, *, echo: Callable[[str], None] = to_stderr):
        self.log_path = Path(log_path) if log_path is not None else None
        self.echo = echo
        self.counts: Counter[tuple[str, str]] = Counter()  # (exception type, function) -> failures so far
        self.empty_warned = False
        self._lock = threading.Lock()

    def record(self, err: BaseException, *, where: str, group_id: int, sample_index: int | None = None) -> str:
        """Log one failure of user code, echo it as the console rules say, and return its one-line summary
        (`where: Type: message`) for the group's or sample's error."""
        frame = user_frame(err)
        name = type(err).__name__
        line = f"{where}: {name}: {(str(err).strip().splitlines() or [''])[0]}"
        at = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else "no frame of user code"
        trace = "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()
        who = f"group {group_id}" + (f" sample {sample_index}" if sample_index is not None else "")
        with self._lock:
            kind = (name, frame.name if frame is not None else where)
            self.counts[kind] += 1
            count = self.counts[kind]
            self._log(f"{who} failed: {line}\n  at {at}\n{trace}")
        if count == 1:
            self.echo(f"sluice: {who} failed: {line}\n  at {at}{self._also()}\n{_indent(trace)}")
        elif count & (count - 1) == 0:  # 2, 4, 8, ...: one line per doubling, not one per failure
            self.echo(f"sluice: {name} in {kind[1]} at {at}: {count} times so far (latest: {who}){self._also()}")
        return line

    def record_line(self, line: str, *, group_id: int, kind: str) -> None:
        """A failure with no traceback to show (a group cut by its timeout, one left too small): logged as one line,
        echoed the first time of its `kind` and then at each doubling of its count."""
        with self._lock:
            self._log(f"group {group_id} failed: {line}")
            self.counts[(kind, "")] += 1
            count = self.counts[(kind, "")]
        if count == 1:
            self.echo(f"sluice: group {group_id} failed: {line}")
        elif count & (count - 1) == 0:
            self.echo(f"sluice: group {group_id} failed: {line} ({count} groups so far{self._also()})")

    def warn_empty(self, group_id: int, count: int) -> None:
        """Once per run: samples that will be trained with no response tokens."""
        with self._lock:
            if self.empty_warned:
                return
            self.empty_warned = True
        self.echo(f"sluice: group {group_id}: {count} samples have empty responses (no tokens) and are trained on "
                  "their reward; counted in rollout/empty_responses (warned once)")

    def _also(self) -> str:
        return f"; every failure with its traceback in {self.log_path}" if self.log_path is not None else ""

    def _log(self, block: str) -> None:
        if self.log_path is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as handle:
            handle.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {block}\n")


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
