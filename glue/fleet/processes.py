"""Processes sluice starts itself (engines, the router): free ports to start them on, a log that rotates, and
`ManagedProcess`, which owns one child by pid (its own session and process group, SIGTERM when the parent dies, a
rotating log). `glue.fleet.fleet` starts engines and the router with it; `glue.fleet.engine_host` does on other nodes.
`engine_seed`: each engine start's own --random-seed."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that were free a moment ago (all held open together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_block(count: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port p such that p .. p + count - 1 were all free a moment ago (held open together): SGLang's node rank 0
    binds its --dist-init-addr port and derives the next ones from it (server_args.PortArgs: port_base = the port + 1,
    then the detokenizer, rpc, metrics, scheduler and load-collector ports)."""
    for _ in range(tries):
        socks = [socket.socket()]
        try:
            socks[0].bind((host, 0))
            first = socks[0].getsockname()[1]
            if first + count > 65536:
                continue
            for port in range(first + 1, first + count):
                socks.append(socket.socket())
                socks[-1].bind((host, port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"found no {count} consecutive free ports on {host} in {tries} tries")


def _die_with_parent() -> None:
    """Child-side (preexec): SIGTERM this process if the driver dies without running atexit (SIGKILL, segfault).
    Linux delivers it when the *thread* that forked exits, so it is only set up from the main thread."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class RotatingLog:
    """A child's stdout and stderr, through a pipe, into `path`; once it holds `max_bytes` it becomes `path.1` (the
    older ones shift up to `path.<backups>`, the oldest is dropped), so a chatty process (the router logs a line per
    request) cannot fill the disk. `write_fd` is the pipe end to give the child."""

    def __init__(self, path: Path, max_bytes: int = 20 << 20, backups: int = 2):
        self.path, self.max_bytes, self.backups = Path(path), max_bytes, backups
        read_fd, self.write_fd = os.pipe()
        self._file: IO[bytes] = open(self.path, "ab")
        self._lock = threading.Lock()
        self._pump = threading.Thread(target=self._copy, args=(os.fdopen(read_fd, "rb", buffering=0),), daemon=True,
                                      name=f"log {self.path.name}")
        self._pump.start()

    def _copy(self, pipe: IO[bytes]) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.read(1 << 16), b""):
                with self._lock:
                    if self._file.tell() + len(chunk) >= self.max_bytes and b"\n" in chunk:
                        cut = chunk.rindex(b"\n") + 1  # files end on whole lines
                        self._file.write(chunk[:cut])
                        self._rotate()
                        chunk = chunk[cut:]
                    self._file.write(chunk)
                    self._file.flush()

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i - 1}") if i > 1 else self.path
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i}"))
        self._file = open(self.path, "ab")

    def tail(self, lines: int = 30) -> str:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
            text = self.path.read_text(errors="replace").splitlines()
            previous = self.path.with_name(f"{self.path.name}.1")
            if len(text) < lines and previous.exists():  # just rotated: the lines before are in the last backup
                text = previous.read_text(errors="replace").splitlines() + text
        return "\n".join(text[-lines:]) or "(log is empty)"

    def close(self, timeout: float = 5.0) -> None:
        """After the child exited: copy what is left in the pipe, then close the file."""
        self._pump.join(timeout)
        with self._lock:
            self._file.close()


class ManagedProcess:
    """One process started by this process: its role (for messages), url, pid, and rotating log. `glue.fleet.engine_host`
    keeps one inside a Ray actor for engines on other nodes, behind the same methods."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, extra_env: dict[str, str] | None = None,
                 url: str | None = None, cwd: str | None = None):
        self.name, self.cmd, self.log_path, self.url = name, cmd, log_path, url
        self._log = RotatingLog(log_path)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
        on_main_thread = threading.current_thread() is threading.main_thread()
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log.write_fd, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env, cwd=cwd,
                                         preexec_fn=_die_with_parent if on_main_thread else None)
        except OSError as err:
            os.close(self._log.write_fd)
            self._log.close()
            raise RuntimeError(f"cannot start {name}: {err}; command: {' '.join(cmd)}") from err
        os.close(self._log.write_fd)  # the child holds its copy; the pump sees EOF once the child is gone

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid]

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        return self._log.tail(lines)

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(
                f"{self.name} exited with code {code} during start-up; command: {' '.join(self.cmd)}\n"
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the process group id is the pid
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        """SIGTERM the process group if the process still runs."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL the group (also reaps children the leader left behind in it), reap, close the log."""
        self.signal_group(signal.SIGKILL)
        self.proc.wait()
        self._log.close()


def engine_seed(base: int | str, index: int, launch: int = 0) -> int:
    """SGLang's --random-seed for engine `index`'s `launch`-th start (0 first, +1 per replacement) in a fleet whose
    seed is `base`. Engines must not share a seed: an engine draws each request's sampling randomness from its
    seeded generator in arrival order, so two engines with one seed give their k-th requests the same draws, and
    with the router alternating a group's samples over them, pairs of samples of one prompt came out identical
    (about 40 % of the samples of the demo's groups). A run's seed still fixes every engine's. A fleet beside the
    policy's (teacher, judge) passes a base of its own, e.g. "<seed>:judge", so its engines draw other numbers."""
    return random.Random(f"sluice-engine:{base}:{index}:{launch}").randrange(1 << 30)
