"""Processes below a run or in a session, read from /proc."""
from __future__ import annotations

from conftest import live_processes


def live_children(pid: int) -> list[str]:
    """Processes (not zombies) whose parent is `pid`, as 'pid command' strings."""
    return [f"{p} {name}" for p, (name, fields) in live_processes().items() if int(fields[1]) == pid]


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    return [pid for pid, (_, fields) in live_processes().items() if int(fields[3]) == sid]


def end_session(sid: int, timeout_s: float, poll_s: float = 0.2) -> list[int]:
    """Wait up to `timeout_s` for session `sid` to empty, then SIGKILL by pid whatever of it is still alive (so nothing
    outlives a test); returns those pids."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(poll_s)
    left = session_pids(sid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left
