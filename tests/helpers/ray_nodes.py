"""A Ray node the test starts itself: `ray start --block` (a head, or a worker joining one) in a session of its own,
stopped by its pid and then every pid left in that session (never `ray stop`, which ends every Ray on the machine)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers.processes import end_session, session_pids

RAY = str(Path(sys.executable).parent / "ray")


class RayNode:
    """`ray start --head --port` (no `head`) or `ray start --address head` with `num_cpus` CPUs and no GPU; `up()`
    waits for `Ray runtime started`, `stop()` ends the whole session (idempotent)."""

    def __init__(self, *, num_cpus: int, port: int | None = None, head: str | None = None,
                 node_ip: str | None = None):
        self.temp_dir = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.log = Path(self.temp_dir) / "ray_start.log"
        role = ["--address", head] if head else ["--head", f"--port={port}", "--include-dashboard=false",
                                                 f"--temp-dir={self.temp_dir}"]
        where = [f"--node-ip-address={node_ip}"] if node_ip else []
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen([RAY, "start", *role, *where, f"--num-cpus={num_cpus}", "--num-gpus=0",
                                      "--disable-usage-stats", "--block"],
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def up(self, timeout_s: float = 90) -> "RayNode":
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = self.log.read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"ray start did not come up:\n{said}")
            time.sleep(0.3)
        return self

    def die(self) -> None:
        """The node dies as a machine would: every process of it (`ray start`, raylet, its workers and actors)
        SIGKILLed at once, by pid."""
        for pid in session_pids(self.proc.pid):
            os.kill(pid, signal.SIGKILL)

    def stop(self, timeout_s: float = 30) -> list[int]:
        """SIGTERM to `ray start --block` (it stops its Ray processes), then SIGKILL to any pid of its session still
        alive after `timeout_s`, and its folder removed; returns those pids."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        left = end_session(self.proc.pid, timeout_s)
        self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # its Ray session folder and the log of `ray start`
        return left
