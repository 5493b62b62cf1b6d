"""Starting a Ray actor on a placement-group bundle after a node was lost. Ray keeps the bundles of a node that went
away where they were until it has missed enough of the node's heartbeats to mark it dead; an actor started on such a
bundle meanwhile dies at once. Once the node is marked dead Ray places its bundles again, on a node with room, and an
actor started then waits until one has room. `start_until_placed` starts again what died as it started; the caller
bounds the wait for room (`ray.get(..., timeout=...)`) and names what did not get it."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

RETRY_PAUSE_S = 10.0  # between starts of an actor that died as it started (Ray's node-death notice takes ~30 s)


def start_until_placed(start: Callable[[], T], *, dies: tuple[type[BaseException], ...], what: str,
                       timeout_s: float | None, pause_s: float = RETRY_PAUSE_S) -> T:
    """`start()`; while it raises one of `dies` (what it started died as it started), start it again every `pause_s`
    until `timeout_s` from now (None: for as long as it takes), saying so each time; then the last error rises."""
    deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
    while True:
        try:
            return start()
        except dies as err:
            if time.monotonic() + pause_s > deadline:
                raise
            why = (str(err).strip().splitlines() or [""])[0]
            print(f"sluice: {what} died as it started ({why}); starting it again in {pause_s:g} s (Ray may still hold "
                  "its bundle on a lost node)", flush=True)
            time.sleep(pause_s)


def ray_death_reason(error: str) -> str:
    """Ray's word on a dead actor in one line: why it is dead and its pid (`The actor is dead because its worker
    process has died. Worker exit type: ... (pid 3263)`), without Ray's list of common causes; its first line when
    the text has another shape."""
    lines = [line.strip() for line in error.strip().splitlines()] or ["the actor is gone"]
    reason = next((line for line in lines if line.startswith("The actor is dead because")), lines[0])
    pid = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("pid:")), None)
    return reason.split(" Some common causes")[0] + (f" (pid {pid})" if pid else "")
