"""Killable worker processes for reward code that can hang while holding the GIL (Math-Verify on a pathological
answer: sympy inside one long C call, where neither SIGALRM nor another thread gets a turn, so the whole driver
freezes). `IsolatedPool.call(fn, *args, timeout_s=...)` runs a picklable function in one of a few persistent
`python -m glue.rewards.isolated` children and kills that child once the deadline passes; the next call starts a fresh one.
"""
from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

HEADER = struct.Struct(">Q")  # every message: its byte length, then a pickle
READY = b"ready"
START_TIMEOUT_S = 120.0  # a fresh child imports its preloads (Math-Verify: sympy) before it counts as started
_POOLS: weakref.WeakSet[IsolatedPool] = weakref.WeakSet()


class DeadlineExceeded(TimeoutError):
    """The call ran past its deadline; its process was killed."""


class WorkerDied(RuntimeError):
    """The worker process exited in the middle of a call (killed from outside, out of memory, a crash)."""


class _Worker:
    """One child process and its two pipes. It owns the child by pid: `kill()` stops exactly that process."""

    def __init__(self, preload: Sequence[str]):
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        # Its own session: a Ctrl-C in the terminal reaches the driver, which stops this child itself.
        self.proc = subprocess.Popen([sys.executable, "-m", "glue.rewards.isolated", *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        try:
            ready = self._receive(time.monotonic() + START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        if ready != READY:
            self.kill()
            raise WorkerDied(f"isolated worker {self.proc.pid} sent {ready[:80]!r} instead of its ready message")

    def run(self, request: bytes, timeout_s: float) -> Any:
        """Send one pickled (fn, args, kwargs) and return the function's result or raise its exception; past
        `timeout_s` the child is killed and DeadlineExceeded raised."""
        assert self.proc.stdin is not None, "worker started without a stdin pipe"
        try:
            self.proc.stdin.write(HEADER.pack(len(request)) + request)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerDied(f"isolated worker {self.proc.pid} is gone (exit code {self.proc.poll()})") from None
        kind, value = pickle.loads(self._receive(time.monotonic() + timeout_s, timeout_s))
        if kind == "raise":
            raise value
        return value

    def _receive(self, deadline: float, timeout_s: float | None = None) -> bytes:
        header = self._read_exact(HEADER.size, deadline, timeout_s)
        return self._read_exact(HEADER.unpack(header)[0], deadline, timeout_s)

    def _read_exact(self, n: int, deadline: float, timeout_s: float | None) -> bytes:
        assert self.proc.stdout is not None, "worker started without a stdout pipe"
        fd, chunks, left = self.proc.stdout.fileno(), [], n
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.kill()
                limit = f"{timeout_s:g} s" if timeout_s is not None else f"{START_TIMEOUT_S:g} s to start"
                raise DeadlineExceeded(f"isolated worker {self.proc.pid} ran past {limit}; killed")
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                code = self.proc.wait()
                raise WorkerDied(f"isolated worker {self.proc.pid} exited (code {code}) in the middle of a call")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    @property
    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class IsolatedPool:
    """Up to `size` worker processes, started on first use and reused; `call` blocks while all are busy. A worker
    whose call timed out or died is replaced by the next call. `preload`: modules every worker imports before it
    takes calls (so an import's seconds never count against a deadline). Children are stopped by `close()`, at
    interpreter exit, and on their own when the driver is gone (their stdin closes)."""

    def __init__(self, size: int, preload: Sequence[str] = ()):
        if size < 1:
            raise ValueError(f"IsolatedPool size must be at least 1, got {size}")
        self.size, self.preload = size, tuple(preload)
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self.started = 0  # worker processes started so far (a replacement counts too)
        _POOLS.add(self)

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float, tries: int = 1, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a worker process, within `timeout_s` seconds (DeadlineExceeded past it). `fn`
        must be importable by the child (a module-level function) and its arguments and result picklable. `tries`
        > 1: a call past its deadline goes again, up to `tries` calls in all, each time in a worker started for it
        (not an idle one): the worker that ran out may have been stopped or starved rather than held by the call,
        and so may the others; a call that holds every worker it meets past its deadline still raises."""
        request = pickle.dumps((fn, args, kwargs))
        for attempt in range(tries):
            with self._slots:
                worker = self._take(fresh=attempt > 0)
                try:
                    return worker.run(request, timeout_s)
                except DeadlineExceeded:
                    if attempt == tries - 1:
                        raise
                finally:
                    self._give_back(worker)

    def _take(self, fresh: bool = False) -> _Worker:
        with self._lock:
            worker = self._idle.pop() if self._idle and not fresh else None
        is_new = worker is None
        if is_new:
            worker = _Worker(self.preload)  # started outside the lock: other calls go on meanwhile
        with self._lock:
            self.started += int(is_new)
            self._busy.add(worker)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if worker.is_alive:
                self._idle.append(worker)
                return
        worker.kill()  # reaps it and closes its pipes

    def pids(self) -> list[int]:
        """The live worker processes' ids."""
        with self._lock:
            return [w.proc.pid for w in [*self._idle, *self._busy] if w.is_alive]

    def close(self) -> None:
        """Stop every worker (a busy one too: its call then raises WorkerDied)."""
        with self._lock:
            workers, self._idle = [*self._idle, *self._busy], []
        for worker in workers:
            worker.kill()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


def _serve(preload: Sequence[str]) -> None:
    """The child's loop: read a request, run it, answer ("return", value) or ("raise", exception); exit at EOF."""
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when this process stops
    replies: BinaryIO = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the reply stream
    requests = sys.stdin.buffer
    for name in preload:
        importlib.import_module(name)
    _send(replies, READY)
    while True:
        header = requests.read(HEADER.size)
        if len(header) < HEADER.size:
            return  # the driver closed the pipe or is gone
        fn, args, kwargs = pickle.loads(requests.read(HEADER.unpack(header)[0]))
        try:
            reply = ("return", fn(*args, **kwargs))
        except Exception as e:  # answered to the caller, who re-raises it
            reply = ("raise", e)
        try:
            data = pickle.dumps(reply)
        except Exception as e:  # an unpicklable result or exception: say so instead of dying
            data = pickle.dumps(("raise", TypeError(f"the isolated call's {reply[0]} value cannot be pickled: {e}")))
        _send(replies, data)


def _send(stream: BinaryIO, data: bytes) -> None:
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
