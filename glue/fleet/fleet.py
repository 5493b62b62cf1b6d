"""The rollout fleet: N inference engines (the embedded engine on CPU, SGLang servers on GPU) registered with the
real sgl-router. Rollout functions reach the engines through `router_url` (or, for what the router cannot carry,
directly through `serving_urls`: the engines that hold the fleet's weights); control calls go to `engine_urls`.
The fleet owns the processes: it starts them, waits until they serve, and stops them by pid."""
from __future__ import annotations

import atexit
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

from glue.fleet.engine_host import HostDiedAtStart, RemoteEngine
from glue.fleet.placing import start_until_placed
from glue.fleet.processes import ManagedProcess, engine_seed, free_ports
from glue.fleet.spanning import SpanningEngine, resolve_dist_init, start_spanning
from weight_sync.engine_calls import bearer

EMBEDDED_ENGINE = (sys.executable, "-m", "glue.embedded_engine")
SGLANG_SERVER = (sys.executable, "-m", "sglang.launch_server")  # the GPU engine; same --model-path/--host/--port
ROUTER = (sys.executable, "-m", "sglang_router.launch_router")


def _http_get(url: str, timeout: float = 2.0, key: str | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=bearer(key)), timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, ""


class ProcessDied(RuntimeError):
    """A process the run depends on (engine, router, trainer rank) is gone; the message names it and its log."""


def first_line(err: BaseException) -> str:
    """An error's first line, for the one-line records of faults ('' for an empty message)."""
    return (str(err).strip().splitlines() or [""])[0]


class RolloutFleet:
    """Start N engines and the sgl-router in front of them; `stop()` (idempotent, also at exit) ends them all.

    `engine_command` is the program before the flags: the embedded engine by default, `SGLANG_SERVER` on GPU.
    The fleet appends `--model-path --host --port` and then `engine_args` (pass-through flags such as
    `--num-threads 1` or SGLang's `--tp 2`); `router_args` are appended to the router's command line.
    With `engine_hosts` (Ray actor options per engine, `launch.run.cluster.Placement.actor_options`), engine i is
    started on its placement-group bundle's node by a `glue.fleet.engine_host` actor (listening on `engine_bind`, default
    that node's address); without, as a child of this process.
    `api_key` / `admin_api_key` start every engine with SGLang's `--api-key` / `--admin-api-key`; the router gets
    `--api-key` too (it then asks clients for that key and sends it to the engines), and the fleet's own calls
    carry it.
    `seed` (the launcher passes run.seed) gives engine i's n-th start `--random-seed engine_seed(seed, i, n)`; without
    it engines pick their own (SGLang and the embedded engine draw a random one).
    `name` names a fleet beside the policy's ("teacher", "judge") in its processes' names, so a line about one of
    them (`teacher engine 0 (url) exited ...`) says whose it is; the policy's fleet has none.
    `engine_nodes` > 1: each engine spans that many nodes, a server process per node (glue.fleet.spanning): node
    rank 0 on `engine_hosts[i]` / `engine_env[i]` is the engine's url, node rank k on `rank_hosts[i][k - 1]` with
    `rank_env[i][k - 1]`; the engine is dead when any of them is, and a replacement restarts them all.
    """

    def __init__(self, *, model_path: str, num_engines: int = 2, host: str = "127.0.0.1",
                 router_policy: str = "round_robin", engine_startup_timeout_s: float = 120,
                 engine_args: Sequence[str] = (), router_args: Sequence[str] = (), log_dir: str | Path | None = None,
                 engine_command: Sequence[str] = EMBEDDED_ENGINE, router_command: Sequence[str] = ROUTER,
                 router_startup_timeout_s: float = 60, stop_grace_s: float = 10,
                 engine_env: Sequence[dict[str, str]] = (), engine_hosts: Sequence[dict[str, Any]] = (),
                 api_key: str | None = None, admin_api_key: str | None = None, engine_bind: str | None = None,
                 seed: int | str | None = None, name: str = "", engine_nodes: int = 1,
                 rank_hosts: Sequence[Sequence[dict[str, Any]]] = (),
                 rank_env: Sequence[Sequence[dict[str, str]]] = (), placement_timeout_s: float | None = 300.0):
        if num_engines < 1:
            raise ValueError(f"RolloutFleet: num_engines must be >= 1, got {num_engines}")
        self.model_path, self.num_engines, self.host = str(model_path), num_engines, host
        self.name = name
        self._prefix = f"{name} " if name else ""
        self.router_policy = router_policy
        self.engine_startup_timeout_s = engine_startup_timeout_s
        self.router_startup_timeout_s = router_startup_timeout_s
        self.api_key, self.admin_api_key = api_key, admin_api_key
        # `--flag=value`: a key may begin with '-', which a separate argument would turn into a flag
        key_args = [*([f"--api-key={api_key}"] if api_key else []),
                    *([f"--admin-api-key={admin_api_key}"] if admin_api_key else [])]
        self.engine_args = list(engine_args) + key_args
        self.router_args = list(router_args) + ([f"--api-key={api_key}"] if api_key else [])
        self.engine_env = list(engine_env)  # per engine index, e.g. its CUDA_VISIBLE_DEVICES from the placement
        self.engine_hosts = list(engine_hosts)
        self.engine_nodes, self.rank_hosts, self.rank_env = engine_nodes, list(rank_hosts), list(rank_env)
        self.engine_bind = engine_bind  # engines on host actors listen here (default: their node's address)
        self.placement_timeout_s = placement_timeout_s  # a host actor's wait for its bundle (None: no end)
        if self.engine_hosts and len(self.engine_hosts) != num_engines:
            raise ValueError(f"RolloutFleet: {len(self.engine_hosts)} engine_hosts for {num_engines} engines")
        self.engine_command, self.router_command = list(engine_command), list(router_command)
        self.stop_grace_s = stop_grace_s
        self.log_dir = Path(log_dir) if log_dir is not None else Path.cwd() / "fleet-logs"
        self.engine_urls: list[str] = []
        # engine_urls less the engines being started or replaced: a url joins once its engine holds the current
        # weights and the router routes to it, so a request sent to an engine directly (R3) never meets stale weights
        self.serving_urls: list[str] = []
        self.router_url: str | None = None
        self._engines: list[ManagedProcess] = []
        self._router: ManagedProcess | None = None
        self.started_pids: list[int] = []  # every pid this fleet ever started (kept after stop, for checks)
        self.restarts = 0  # engines replaced by replace_engine
        # each engine start gets its own --random-seed (engine_seed); None: no flag (SGLang draws one at random)
        self.seed = seed
        self._launches: dict[int, int] = {}
        self._metrics_port: int | None = None  # the router's Prometheus exporter
        self.router_restarts = 0  # routers replaced by restart_router
        self._router_retries_seen = 0  # the running router's smg_worker_retries_total when last read
        self._retries_of_old_routers = 0  # the same, summed over the routers replaced

    @property
    def pids(self) -> list[int]:
        """Pids of every process this fleet started (engines, each with its node ranks, then the router)."""
        return [pid for m in self._processes() for pid in m.pids]

    def node_pids(self, index: int) -> list[int]:
        """The pids of engine `index`'s processes, node rank 0 first (one for an engine on one node)."""
        return self._engines[index].pids

    def _processes(self) -> list[ManagedProcess]:
        return self._engines + ([self._router] if self._router else [])

    def __enter__(self) -> "RolloutFleet":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, on_phase: Callable[[str, str], None] | None = None) -> None:
        """Start the engines, wait until each serves /health, then start the router and wait until it has
        registered every engine; `on_phase(phase, detail)` hears when the engines, then the router, are ready.
        On any failure everything started so far is stopped before the error rises."""
        if self._engines:
            raise RuntimeError("RolloutFleet.start() called twice; call stop() first")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        say = on_phase or (lambda phase, detail: None)
        try:
            self._start_engines()
            self._wait_engines_healthy()
            over = f", each over {self.engine_nodes} nodes (a server per node)" if self.engine_nodes > 1 else ""
            say("engines", f"{self.num_engines} engines serve /health{over} (logs: {self.log_dir}/engine_*.log)")
            self._start_router()
            self._wait_router_ready()
            self.serving_urls[:] = self.engine_urls
            say("router", f"sgl-router at {self.router_url} routes to {self.num_engines} engines "
                          f"(policy {self.router_policy})")
        except BaseException:
            self.stop()
            raise

    def _start_engines(self) -> None:
        ports = free_ports(self.num_engines + 1, self.host)
        self._router_port = ports[-1]
        for i, port in enumerate(ports[:-1]):
            self._engines.append(self._launch_engine(i, port))
            self.engine_urls.append(self._engines[-1].url)

    def _launch_engine(self, i: int, port: int | None = None) -> Any:
        """Start engine i: through its host actor on its bundle's node (which picks the address and port there),
        or as a child process on `self.host:port`. A late engine (i >= num_engines) reuses the bundle of engine
        i % num_engines; a replacement keeps its index, bundle and log file."""
        launch = self._launches[i] = self._launches.get(i, -1) + 1
        args = [*self.engine_args, *([f"--random-seed={engine_seed(self.seed, i, launch)}"]
                                     if self.seed is not None else [])]
        if self.engine_nodes == 1:
            engine = self._start_process(i, 0, args, port)
        else:
            engine = start_spanning(lambda k, flags: self._start_process(i, k, [*args, *flags], port if k == 0
                                                                         else None), self.engine_nodes)
        self.started_pids.extend(engine.pids)
        return engine

    def _start_process(self, i: int, rank: int, args: list[str], port: int | None) -> Any:
        """Node rank `rank`'s process of engine i (the engine's only one on one node): on its host actor, or here."""
        name = f"{self._prefix}engine {i}" + (f" node rank {rank}" if rank else "")
        log_path = self.log_dir / (f"engine_{i}.log" if rank == 0 else f"engine_{i}_node_{rank}.log")
        if rank == 0:
            env = self.engine_env[i % len(self.engine_env)] if self.engine_env else None
        else:
            env = self.rank_env[i % len(self.rank_env)][rank - 1] if self.rank_env else None
        hosts = self.engine_hosts if rank == 0 else [h[rank - 1] for h in self.rank_hosts]
        if hosts:
            return RemoteEngine(name, command=self.engine_command, model_path=self.model_path, args=args, env=env,
                                log_path=log_path, actor_options=hosts[i % len(hosts)], bind=self.engine_bind,
                                placement_timeout_s=self.placement_timeout_s)
        port = port or free_ports(1, self.host)[0]
        url = f"http://{self.host}:{port}"
        cmd = [*self.engine_command, "--model-path", self.model_path, "--host", self.host, "--port", str(port),
               *resolve_dist_init(args, self.host)]
        return ManagedProcess(f"{name} ({url if rank == 0 else self.host})", cmd, log_path, env, url=url)

    def _wait_engines_healthy(self, indices: Sequence[int] | None = None) -> None:
        """Wait until engines `indices` (default: all) answer GET /health."""
        deadline = time.monotonic() + self.engine_startup_timeout_s
        pending = {self.engine_urls[i]: self._engines[i]
                   for i in (range(len(self._engines)) if indices is None else indices)}
        while pending:
            for url, engine in list(pending.items()):
                engine.check_alive()
                if _http_get(f"{url}/health", key=self.api_key)[0] == 200:
                    del pending[url]
            if pending and time.monotonic() > deadline:
                url, engine = next(iter(pending.items()))
                raise TimeoutError(
                    f"engine at {url} did not answer GET /health within engine_startup_timeout_s="
                    f"{self.engine_startup_timeout_s:g} s (raise it for big models); command: "
                    f"{' '.join(engine.cmd)}\nlast lines of {engine.log_path}:\n{engine.log_tail()}"
                )
            time.sleep(0.2)

    def _start_router(self, worker_urls: Sequence[str] | None = None) -> None:
        """Start the router on the fleet's port with `worker_urls` (default: every engine); a restart keeps the
        port of its metrics exporter too."""
        self.router_url = f"http://{self.host}:{self._router_port}"
        cmd = [*self.router_command, "--host", self.host, "--port", str(self._router_port),
               "--policy", self.router_policy, "--worker-urls",
               *(self.engine_urls if worker_urls is None else worker_urls), *self.router_args]
        if "--prometheus-port" in self.router_args:
            self._metrics_port = int(self.router_args[self.router_args.index("--prometheus-port") + 1])
        else:  # the router's metrics exporter has a fixed default port: two routers on one machine would collide
            self._metrics_port = self._metrics_port or free_ports(1, self.host)[0]
            cmd += ["--prometheus-port", str(self._metrics_port)]
        self._router = ManagedProcess(f"{self._prefix}router ({self.router_url})", cmd, self.log_dir / "router.log")
        self.started_pids.append(self._router.proc.pid)

    def registered_workers(self) -> dict[str, bool]:
        """The router's view: worker url -> is_healthy (empty if the router does not answer yet)."""
        status, body = _http_get(f"{self.router_url}/workers", key=self.api_key)
        if status != 200:
            return {}
        return {w["url"].rstrip("/"): bool(w.get("is_healthy")) for w in json.loads(body).get("workers", [])}

    def _wait_router_ready(self, urls: Sequence[str] | None = None) -> None:
        """Wait until the router lists engines `urls` (default: every engine) as healthy."""
        urls = self.engine_urls if urls is None else urls
        deadline = time.monotonic() + self.router_startup_timeout_s
        while True:
            self._router.check_alive()
            workers = self.registered_workers()
            if all(workers.get(url) for url in urls):
                return
            if time.monotonic() > deadline:
                missing = [u for u in urls if not workers.get(u)]
                raise TimeoutError(
                    f"router at {self.router_url} had not registered healthy workers {missing} within "
                    f"{self.router_startup_timeout_s:g} s (its /workers shows {workers}); last lines of "
                    f"{self._router.log_path}:\n{self._router.log_tail()}"
                )
            time.sleep(0.2)

    def add_engine(self, prepare: Callable[[str], None] | None = None) -> str:
        """Start one more engine (late, or replacing one that died), wait until it serves, let `prepare(url)` bring
        it to the current weights (e.g. `WeightBridge.add_engine`), and only then register it with the router
        (`POST /workers`) and add it to `serving_urls`; returns its url. If `prepare` fails the engine is stopped and never routed to."""
        if self._router is None:
            raise RuntimeError("RolloutFleet.add_engine needs a started fleet; call start() first")
        self._engines.append(self._launch_engine(len(self._engines)))
        self.engine_urls.append(self._engines[-1].url)
        try:
            self._route_to(len(self._engines) - 1, prepare)
        except BaseException:
            self.engine_urls.pop()
            self._engines.pop().kill()
            raise
        self.serving_urls.append(self.engine_urls[-1])
        return self.engine_urls[-1]

    def replace_engine(self, index: int, prepare: Callable[[str], None] | None = None) -> str:
        """Engine `index` died or stopped answering: take it off the router, kill what is left of it, start a new
        one in its place (same index, bundle and log file; a new port), bring it to the current weights with
        `prepare(url)` and only then route to it (and add it to `serving_urls`). Returns the new url;
        `engine_urls[index]` is updated in place, so every holder of the list (bridge, colocation) sees it. If the new engine cannot be brought up the
        error rises and the slot holds the stopped engine."""
        if self._router is None:
            raise RuntimeError("RolloutFleet.replace_engine needs a started fleet; call start() first")
        if self.engine_urls[index] in self.serving_urls:
            self.serving_urls.remove(self.engine_urls[index])
        self._unregister(self.engine_urls[index])
        self._engines[index].kill()
        # its node may be the one that is gone: a host that dies as it starts is started again until Ray has placed
        # the bundle on a node with room (or placement_timeout_s has passed)
        self._engines[index] = start_until_placed(lambda: self._launch_engine(index), dies=(HostDiedAtStart,),
                                                  what=f"{self._prefix}engine {index}",
                                                  timeout_s=self.placement_timeout_s)
        self.engine_urls[index] = self._engines[index].url
        self.restarts += 1
        try:
            self._route_to(index, prepare)
        except BaseException:
            self._engines[index].kill()
            raise
        self.serving_urls.append(self.engine_urls[index])
        return self.engine_urls[index]

    def leave_out(self, index: int) -> None:
        """Engine `index` is gone and will not be replaced (the run stops): no pause, continue or direct request
        goes to it any more (`serving_urls`)."""
        if self.engine_urls[index] in self.serving_urls:
            self.serving_urls.remove(self.engine_urls[index])

    def _route_to(self, index: int, prepare: Callable[[str], None] | None) -> None:
        """A just-started engine: wait until it serves, `prepare(url)`, register it with the router."""
        url = self.engine_urls[index]
        self._wait_engines_healthy([index])
        if prepare is not None:
            prepare(url)
        worker = {"url": url, **({"api_key": self.api_key} if self.api_key else {})}  # the router's key for it
        request = urllib.request.Request(f"{self.router_url}/workers", data=json.dumps(worker).encode(),
                                         headers={"Content-Type": "application/json", **bearer(self.api_key)})
        with urllib.request.urlopen(request, timeout=30):
            pass
        self._wait_router_ready()

    def _unregister(self, url: str) -> None:
        """Take `url` off the router (`DELETE /workers/<id>`), so it stops sending requests there; a no-op when the
        router does not list it."""
        status, body = _http_get(f"{self.router_url}/workers", key=self.api_key)
        ids = [w["id"] for w in json.loads(body).get("workers", []) if w["url"].rstrip("/") == url] if status == 200 else []
        for worker_id in ids:
            request = urllib.request.Request(f"{self.router_url}/workers/{worker_id}", method="DELETE",
                                             headers=bearer(self.api_key))
            with urllib.request.urlopen(request, timeout=30):
                pass

    def dead_engines(self) -> list[int]:
        """Indices of the engines that are no longer running."""
        return [i for i, m in enumerate(self._engines) if m.exit_code() is not None]

    def router_retries(self) -> int:
        """Requests the routers sent again to another engine after one failed (`smg_worker_retries_total`): how
        generation survives an engine that dies mid-request. A router that was replaced counts with what it had
        when last read; one whose metrics cannot be read counts as last read."""
        status, text = _http_get(f"http://127.0.0.1:{self._metrics_port}/metrics")  # the router runs here
        if status == 200:
            self._router_retries_seen = int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                                if line.startswith("smg_worker_retries_total")))
        return self._retries_of_old_routers + self._router_retries_seen

    def router_exit(self) -> str | None:
        """The `exited()` line of the router, or None while it runs."""
        return self._exit_line(self._router) if self._router.exit_code() is not None else None

    def router_answers(self, timeout_s: float) -> bool:
        """Whether the router answers GET /health with 200 within `timeout_s` (a stopped one answers nothing)."""
        return _http_get(f"{self.router_url}/health", timeout=timeout_s, key=self.api_key)[0] == 200

    def restart_router(self) -> list[str]:
        """The router died or hangs: SIGKILL what is left of it (by pid), start a new one on the same port with
        every engine that serves (`serving_urls`, less any that exited) and wait until it routes to them; returns
        their urls. An engine being replaced meanwhile registers itself with the new router (`_route_to`)."""
        if self._router is None:
            raise RuntimeError("RolloutFleet.restart_router needs a started fleet; call start() first")
        self._router.kill()
        self._retries_of_old_routers += self._router_retries_seen
        self._router_retries_seen = 0
        dead = {self.engine_urls[i] for i in self.dead_engines()}
        live = [url for url in self.serving_urls if url not in dead]
        self._start_router(live)
        self.router_restarts += 1
        self._wait_router_ready(live)
        return live

    def exited(self) -> list[str]:
        """One line per started process (engine or router) that is no longer running: its name, exit code, log."""
        return [self._exit_line(m) for m in self._processes() if m.exit_code() is not None]

    def engine_exit(self, index: int) -> str:
        """The `exited()` line of engine `index`."""
        return self._exit_line(self._engines[index])

    @staticmethod
    def _exit_line(m: Any) -> str:
        """`<name> exited with code <c>; its log: <path>`, for each node rank that exited of an engine that spans
        nodes."""
        gone = m.exited() if isinstance(m, SpanningEngine) else [m]
        return "; ".join(f"{p.name} exited with code {p.exit_code()}; its log: {p.log_path}" for p in gone)

    def stop(self) -> None:
        """SIGTERM every process group this fleet started (router first), SIGKILL what is left after
        `stop_grace_s`; safe to call twice."""
        procs = ([self._router] if self._router else []) + self._engines[::-1]
        for m in procs:
            m.terminate()
        deadline = time.monotonic() + self.stop_grace_s
        for m in procs:
            m.wait(max(0.0, deadline - time.monotonic()))
            m.kill()
        self._engines, self._router = [], None
        self.engine_urls, self.serving_urls, self.router_url = [], [], None
        atexit.unregister(self.stop)
