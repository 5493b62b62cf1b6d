"""Processes below a run or in a session, read from /proc."""
from __future__ import annotations

from conftest import live_processes


def live_children(pid: int) -> list[str]:
    """Processes (not zombies) whose parent is `pid`, as 'pid command' strings."""
    return [f"{p} {name}" for p, (name, fields) in live_processes().items() if int(fields[1]) == pid]


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    return [pid for pid, (_, fields) in live_processes().items() if int(fields[3]) == sid]
