"""Engines on any node: `EngineHost` is a small Ray actor pinned to an engine's placement-group bundle; it starts the
engine process on that bundle's node (address and free port picked there), and stops it by pid. `RemoteEngine` is
the fleet's handle on it, with the same methods as a process the fleet started itself."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from glue.fleet.placing import ray_death_reason
from glue.fleet.processes import ManagedProcess, free_ports
from glue.fleet.spanning import resolve_dist_init


class EngineHost:
    """Actor body: owns one engine process on this node. The process is a new session (stopped as a group) that
    gets SIGTERM when this actor's process dies, so killing the actor never leaves the engine running."""

    def __init__(self) -> None:
        self._engine: Any = None

    def start(self, *, name: str, command: Sequence[str], model_path: str, args: Sequence[str],
              env: dict[str, str] | None, log_path: str, cwd: str,
              bind: str | None = None) -> tuple[str, int, list[str]]:
        """Start the engine on `bind` (default: this node's address) and a port free here (and, for node rank 0
        of an engine that spans nodes, its --dist-init-addr: this node's address and a block of free ports); returns
        (url, pid, command line)."""
        import ray

        host = bind or ray.util.get_node_ip_address()
        port = free_ports(1, host)[0]
        cmd = [*command, "--model-path", model_path, "--host", host, "--port", str(port),
               *resolve_dist_init(args, host)]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        url = f"http://{host}:{port}"
        self._engine = ManagedProcess(f"{name} ({url})", cmd, Path(log_path), env, url=url,
                                cwd=cwd if os.path.isdir(cwd) else None)  # relative paths mean the driver's cwd
        return url, self._engine.pid, cmd

    def exit_code(self) -> int | None:
        return self._engine.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        return self._engine.log_tail(lines)

    def terminate(self) -> None:
        self._engine.terminate()

    def stop(self, grace_s: float = 0.0) -> None:
        """Wait up to `grace_s` for a terminated engine to exit, then SIGKILL its group and reap it."""
        if self._engine is not None:
            self._engine.wait(grace_s)
            self._engine.kill()
            self._engine = None


class HostDiedAtStart(RuntimeError):
    """An engine's host actor died as it started: its bundle is on a node that is gone and that Ray has not yet
    marked dead (glue.fleet.placing); started again, it gets the bundle once Ray has placed it elsewhere."""


class NotPlaced(RuntimeError):
    """An engine's host actor got no bundle within its placement timeout: its node is gone and no other node has
    room for the bundle."""


class RemoteEngine:
    """Driver-side handle: starts an `EngineHost` with `actor_options` and the engine in it, then answers the
    fleet's calls (check_alive, log_tail, terminate, wait, kill) by asking the actor. The host waits at most
    `placement_timeout_s` (None: as long as it takes) for its bundle (one whose node was lost and that no other node
    has room for never comes)."""

    def __init__(self, name: str, *, command: Sequence[str], model_path: str, args: Sequence[str],
                 env: dict[str, str] | None, log_path: Path, actor_options: dict[str, Any], bind: str | None = None,
                 placement_timeout_s: float | None = 300.0):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        self.name, self.log_path = name, log_path
        self._actor = ray.remote(EngineHost).options(**actor_options).remote()
        try:
            self.url, self.pid, self.cmd = ray.get(self._actor.start.remote(
                name=name, command=list(command), model_path=model_path, args=list(args), env=env,
                log_path=str(Path(log_path).resolve()), cwd=os.getcwd(), bind=bind), timeout=placement_timeout_s)
        except GetTimeoutError:
            ray.kill(self._actor)
            raise NotPlaced(f"{name} did not start on its placement-group bundle within {placement_timeout_s:g} s "
                            "(is its node gone, with no other node that has room for it?)") from None
        except RayActorError as err:
            ray.kill(self._actor)
            raise HostDiedAtStart(f"{name}'s host actor died as it started ({ray_death_reason(str(err))})") from err
        except BaseException:
            ray.kill(self._actor)
            raise
        self.name = f"{name} ({self.url})"

    @property
    def pids(self) -> list[int]:
        return [self.pid]

    def log_tail(self, lines: int = 30) -> str:
        import ray

        return ray.get(self._actor.log_tail.remote(lines))

    def exit_code(self) -> int | None:
        """The engine's exit code, None while it runs (-1 when its host actor is gone, and the engine with it)."""
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(self._actor.exit_code.remote())
        except RayActorError:
            return -1

    def check_alive(self) -> None:
        code = self.exit_code()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with code {code} during start-up; command: {' '.join(self.cmd)}\n"
                               f"last lines of {self.log_path}:\n{self.log_tail()}")

    def terminate(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(self._actor.terminate.remote())
        except RayActorError:  # the actor (and with it the engine) is already gone
            pass

    def wait(self, timeout: float) -> None:
        self._grace = timeout  # the actor waits, in kill(): one round trip instead of polling from here

    def kill(self) -> None:
        """Stop the engine through the actor, then end the actor. If the actor is already gone, its engine got
        SIGTERM when it died (PR_SET_PDEATHSIG); there is nothing left to ask."""
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(self._actor.stop.remote(getattr(self, "_grace", 0.0)))
        except RayActorError:
            pass
        ray.kill(self._actor)
