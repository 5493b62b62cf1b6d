"""One run per folder: a run holds `<run dir>/run.lock` for its life. The file names its holder (host, pid, start
time) and a heartbeat a daemon thread refreshes every `refresh_s`; another run is refused while it is fresh, and takes
it over only when it is stale (not refreshed for `STALE_AFTER` refreshes, or its pid is gone on this very host). Plain
files and renames only, no flock: it holds on NFS and the other shared file systems a multi-node run writes to, as long
as the hosts' clocks agree within the stale time."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

LOCK = "run.lock"
REFRESH_S = 10.0  # how often the holder refreshes its heartbeat
STALE_AFTER = 6  # refreshes missed before another run may take the lock over (60 s at the default)


def _raise_interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


class RunFolderHeld(RuntimeError):
    """Another live run holds the folder; the message names it (launch.cli: one line, exit 2)."""


def read_holder(run_dir: Path) -> dict | None:
    """The lock's holder as written, or None when there is no lock (or it is being replaced this very moment)."""
    try:
        return json.loads((run_dir / LOCK).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_stale(holder: dict, *, refresh_s: float, now: float | None = None) -> bool:
    """Whether `holder` has stopped holding: its heartbeat is `STALE_AFTER` refreshes old, or it ran on this host
    and its pid is gone."""
    now = time.time() if now is None else now
    if now - float(holder.get("refreshed", 0)) > STALE_AFTER * refresh_s:
        return True
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
    return False


def describe_holder(run_dir: Path, holder: dict, *, refresh_s: float) -> str:
    """`runs/x is held by run on host H pid P since T (refreshed 3 s ago); ...`: the refusal."""
    ago = max(0.0, time.time() - float(holder.get("refreshed", 0)))
    return (f"{run_dir} is held by run on host {holder.get('host')} pid {holder.get('pid')} since "
            f"{holder.get('started')} (refreshed {ago:.0f} s ago); wait for it to end or stop it, or start this one "
            f"under another run.name=... (a lock not refreshed for {STALE_AFTER * refresh_s:g} s is taken over; "
            f"{run_dir / LOCK})")


def check_folder_free(run_dir: Path, *, refresh_s: float = REFRESH_S) -> str:
    """Raise RunFolderHeld if a live run holds `run_dir`; else the line `--dry-run` prints. Takes nothing."""
    holder = read_holder(run_dir)
    if holder is not None and not is_stale(holder, refresh_s=refresh_s):
        raise RunFolderHeld(describe_holder(run_dir, holder, refresh_s=refresh_s))
    return (f"run folder: {run_dir} is free" if holder is None else
            f"run folder: {run_dir} has a stale lock (host {holder.get('host')} pid {holder.get('pid')}), which a run "
            "takes over")


class RunFolderLock:
    """`with RunFolderLock(run_dir):` the run's life; refused with RunFolderHeld while another live run holds it."""

    def __init__(self, run_dir: Path, *, refresh_s: float = REFRESH_S) -> None:
        self.run_dir, self.path, self.refresh_s = Path(run_dir), Path(run_dir) / LOCK, refresh_s
        self.token = uuid.uuid4().hex
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sigterm = None  # the SIGTERM handler to put back on exit, when this lock set one

    def __enter__(self) -> "RunFolderLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self._create():
            holder = read_holder(self.run_dir)
            if holder is not None and not is_stale(holder, refresh_s=self.refresh_s):
                raise RunFolderHeld(describe_holder(self.run_dir, holder, refresh_s=self.refresh_s))
            self._take_over(holder)
        self._thread = threading.Thread(target=self._heartbeat, name="run-folder-lock", daemon=True)
        self._thread.start()
        self._unwind_on_sigterm()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._holds():
            self.path.unlink(missing_ok=True)
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)

    def _unwind_on_sigterm(self) -> None:
        """Until something else handles SIGTERM (Ray, then launch.run.stopping), one ends the run by unwinding it, as
        Ctrl-C does, so the lock is released on the way out; the default would end the process where it stands."""
        self._sigterm = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)

    def _record(self) -> str:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": self.started,
                           "refreshed": time.time(), "token": self.token})

    def _create(self) -> bool:
        """Create the lock file if there is none (O_EXCL: of two runs creating it at once, one wins)."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(self._record())
        return True

    def _take_over(self, stale: dict | None) -> None:
        """Move the stale lock aside (a rename: of two runs taking it over at once, one moves it) and create ours."""
        if stale is not None:
            print(f"sluice: taking over the stale lock of {self.run_dir} (host {stale.get('host')} pid "
                  f"{stale.get('pid')} since {stale.get('started')}, refreshed "
                  f"{max(0.0, time.time() - float(stale.get('refreshed', 0))):.0f} s ago)", flush=True)
            aside = self.run_dir / f".{LOCK}.stale.{self.token}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:  # another run moved it first; whether it created one is _create's to find
                pass
            else:
                moved = json.loads(aside.read_text() or "{}")
                if moved.get("token") != stale.get("token"):  # another run took it over in between: put theirs back
                    os.rename(aside, self.path)
                    raise RunFolderHeld(describe_holder(self.run_dir, moved, refresh_s=self.refresh_s))
                aside.unlink()
        if not self._create():
            holder = read_holder(self.run_dir) or {}
            raise RunFolderHeld(describe_holder(self.run_dir, holder, refresh_s=self.refresh_s))

    def _holds(self) -> bool:
        holder = read_holder(self.run_dir)
        return holder is not None and holder.get("token") == self.token

    def _heartbeat(self) -> None:
        """Refresh the lock every refresh_s (write aside, rename over it); once another run has taken it over (this
        one stalled past the stale time), say so once and stop refreshing."""
        while not self._stop.wait(self.refresh_s):
            if not self._holds():
                print(f"sluice: warning: {self.path} was taken over by another run (this one did not refresh it for "
                      f"{STALE_AFTER * self.refresh_s:g} s); two runs now write {self.run_dir}", flush=True)
                return
            fresh = self.run_dir / f".{LOCK}.{self.token}"
            fresh.write_text(self._record())
            os.replace(fresh, self.path)
