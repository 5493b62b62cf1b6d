"""The rollout fleet: N inference engines (the embedded engine on CPU, SGLang servers on GPU) registered with the
real sgl-router. Rollout functions reach the engines through `router_url`; control calls go to `engine_urls`.
The fleet owns the processes: it starts them, waits until they serve, and stops them by pid."""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable, Sequence

EMBEDDED_ENGINE = (sys.executable, "-m", "glue.embedded_engine")
SGLANG_SERVER = (sys.executable, "-m", "sglang.launch_server")  # the GPU engine; same --model-path/--host/--port
ROUTER = (sys.executable, "-m", "sglang_router.launch_router")


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


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, ""


def _die_with_parent() -> None:
    """Child-side (preexec): SIGTERM this process if the driver dies without running atexit (SIGKILL, segfault).
    Linux delivers it when the *thread* that forked exits, so it is only set up from the main thread."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class _Managed:
    """One started process: its role (for messages), pid, and log file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, extra_env: dict[str, str] | None = None):
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self._log: IO[bytes] = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
        on_main_thread = threading.current_thread() is threading.main_thread()
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env,
                                         preexec_fn=_die_with_parent if on_main_thread else None)
        except OSError as err:
            self._log.close()
            raise RuntimeError(f"cannot start {name}: {err}; command: {' '.join(cmd)}") from err

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) or "(log is empty)"

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

    def close_log(self) -> None:
        self._log.close()


class RolloutFleet:
    """Start N engines and the sgl-router in front of them; `stop()` (idempotent, also at exit) ends them all.

    `engine_command` is the program before the flags: the embedded engine by default, `SGLANG_SERVER` on GPU.
    The fleet appends `--model-path --host --port` and then `engine_args` (pass-through flags such as
    `--num-threads 1` or SGLang's `--tp 2`); `router_args` are appended to the router's command line.
    """

    def __init__(self, *, model_path: str, num_engines: int = 2, host: str = "127.0.0.1",
                 router_policy: str = "round_robin", engine_startup_timeout_s: float = 120,
                 engine_args: Sequence[str] = (), router_args: Sequence[str] = (), log_dir: str | Path | None = None,
                 engine_command: Sequence[str] = EMBEDDED_ENGINE, router_command: Sequence[str] = ROUTER,
                 router_startup_timeout_s: float = 60, stop_grace_s: float = 10,
                 engine_env: Sequence[dict[str, str]] = ()):
        if num_engines < 1:
            raise ValueError(f"RolloutFleet: num_engines must be >= 1, got {num_engines}")
        self.model_path, self.num_engines, self.host = str(model_path), num_engines, host
        self.router_policy = router_policy
        self.engine_startup_timeout_s = engine_startup_timeout_s
        self.router_startup_timeout_s = router_startup_timeout_s
        self.engine_args, self.router_args = list(engine_args), list(router_args)
        self.engine_env = list(engine_env)  # per engine index, e.g. its CUDA_VISIBLE_DEVICES from the placement
        self.engine_command, self.router_command = list(engine_command), list(router_command)
        self.stop_grace_s = stop_grace_s
        self.log_dir = Path(log_dir) if log_dir is not None else Path.cwd() / "fleet-logs"
        self.engine_urls: list[str] = []
        self.router_url: str | None = None
        self._engines: list[_Managed] = []
        self._router: _Managed | None = None
        self.started_pids: list[int] = []  # every pid this fleet ever started (kept after stop, for checks)

    @property
    def pids(self) -> list[int]:
        """Pids of every process this fleet started (engines, then the router)."""
        return [m.proc.pid for m in self._processes()]

    def _processes(self) -> list[_Managed]:
        return self._engines + ([self._router] if self._router else [])

    def __enter__(self) -> "RolloutFleet":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the engines, wait until each serves /health, then start the router and wait until it has
        registered every engine. On any failure everything started so far is stopped before the error rises."""
        if self._engines:
            raise RuntimeError("RolloutFleet.start() called twice; call stop() first")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            self._start_engines()
            self._wait_engines_healthy()
            self._start_router()
            self._wait_router_ready()
        except BaseException:
            self.stop()
            raise

    def _start_engines(self) -> None:
        ports = free_ports(self.num_engines + 1, self.host)
        self._router_port = ports[-1]
        for i, port in enumerate(ports[:-1]):
            url = f"http://{self.host}:{port}"
            cmd = [*self.engine_command, "--model-path", self.model_path, "--host", self.host, "--port", str(port),
                   *self.engine_args]
            env = self.engine_env[i] if i < len(self.engine_env) else None
            self._engines.append(_Managed(f"engine {i} ({url})", cmd, self.log_dir / f"engine_{i}.log", env))
            self.engine_urls.append(url)
            self.started_pids.append(self._engines[-1].proc.pid)

    def _wait_engines_healthy(self) -> None:
        deadline = time.monotonic() + self.engine_startup_timeout_s
        pending = dict(zip(self.engine_urls, self._engines))
        while pending:
            for url, engine in list(pending.items()):
                engine.check_alive()
                if _http_get(f"{url}/health")[0] == 200:
                    del pending[url]
            if pending and time.monotonic() > deadline:
                url, engine = next(iter(pending.items()))
                raise TimeoutError(
                    f"engine at {url} did not answer GET /health within engine_startup_timeout_s="
                    f"{self.engine_startup_timeout_s:g} s (raise it for big models); command: "
                    f"{' '.join(engine.cmd)}\nlast lines of {engine.log_path}:\n{engine.log_tail()}"
                )
            time.sleep(0.2)

    def _start_router(self) -> None:
        self.router_url = f"http://{self.host}:{self._router_port}"
        cmd = [*self.router_command, "--host", self.host, "--port", str(self._router_port),
               "--policy", self.router_policy, "--worker-urls", *self.engine_urls, *self.router_args]
        if "--prometheus-port" not in self.router_args:
            # The router's metrics exporter has a fixed default port: two routers on one machine would collide.
            cmd += ["--prometheus-port", str(free_ports(1, self.host)[0])]
        self._router = _Managed(f"router ({self.router_url})", cmd, self.log_dir / "router.log")
        self.started_pids.append(self._router.proc.pid)

    def registered_workers(self) -> dict[str, bool]:
        """The router's view: worker url -> is_healthy (empty if the router does not answer yet)."""
        status, body = _http_get(f"{self.router_url}/workers")
        if status != 200:
            return {}
        return {w["url"].rstrip("/"): bool(w.get("is_healthy")) for w in json.loads(body).get("workers", [])}

    def _wait_router_ready(self) -> None:
        deadline = time.monotonic() + self.router_startup_timeout_s
        while True:
            self._router.check_alive()
            workers = self.registered_workers()
            if all(workers.get(url) for url in self.engine_urls):
                return
            if time.monotonic() > deadline:
                missing = [u for u in self.engine_urls if not workers.get(u)]
                raise TimeoutError(
                    f"router at {self.router_url} had not registered healthy workers {missing} within "
                    f"{self.router_startup_timeout_s:g} s (its /workers shows {workers}); last lines of "
                    f"{self._router.log_path}:\n{self._router.log_tail()}"
                )
            time.sleep(0.2)

    def add_engine(self, prepare: Callable[[str], None] | None = None) -> str:
        """Start one more engine (late, or replacing one that died), wait until it serves, let `prepare(url)` bring
        it to the current weights (e.g. `WeightBridge.add_engine`), and only then register it with the router
        (`POST /workers`); returns its url. If `prepare` fails the engine is stopped and never routed to."""
        if self._router is None:
            raise RuntimeError("RolloutFleet.add_engine needs a started fleet; call start() first")
        i, port = len(self._engines), free_ports(1, self.host)[0]
        url = f"http://{self.host}:{port}"
        cmd = [*self.engine_command, "--model-path", self.model_path, "--host", self.host, "--port", str(port),
               *self.engine_args]
        self._engines.append(_Managed(f"engine {i} ({url})", cmd, self.log_dir / f"engine_{i}.log"))
        self.engine_urls.append(url)
        self.started_pids.append(self._engines[-1].proc.pid)
        try:
            self._wait_engines_healthy()
            if prepare is not None:
                prepare(url)
            request = urllib.request.Request(f"{self.router_url}/workers", data=json.dumps({"url": url}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30):
                pass
            self._wait_router_ready()
        except BaseException:
            engine = self._engines.pop()
            self.engine_urls.remove(url)
            engine.signal_group(signal.SIGKILL)
            engine.proc.wait()
            engine.close_log()
            raise
        return url

    def stop(self) -> None:
        """SIGTERM every process group this fleet started (router first), SIGKILL what is left after
        `stop_grace_s`; safe to call twice."""
        procs = ([self._router] if self._router else []) + self._engines[::-1]
        for m in procs:
            if m.proc.poll() is None:
                m.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for m in procs:
            try:
                m.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            m.signal_group(signal.SIGKILL)  # also reaps children the leader left behind in its group
            m.proc.wait()
            m.close_log()
        self._engines, self._router = [], None
        self.engine_urls, self.router_url = [], None
        atexit.unregister(self.stop)
