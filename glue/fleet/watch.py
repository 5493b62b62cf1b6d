"""Keeps the rollout fleet serving while the loop trains: an engine that dies, or stops generating, is replaced.

Beside the loop, every `poll_s` the watch looks at the processes the fleet started, and every
`health_interval_s` asks every engine at once for one token (`GET /health_generate`, SGLang's deep health check;
at most `PROBES_AT_ONCE` in flight, and outside the sync lock, so a sync never waits on a sweep). An engine
that exited, or failed `health_failures` checks in a row, is restarted in its place: taken off the router, a new
process started on its bundle, brought to the weights the others hold, and only then routed to
(`RolloutFleet.replace_engine` with `WeightBridge.add_engine`). Its in-flight requests are not lost: the router sends
a request that failed on a dead engine to another one (counted in `fault/reissued_requests`, with the client's own
retries of the router's 502-504). The generated tokens of those requests went down with the engine; they start
again from the prompt (or from the tokens a partial rollout already holds).

A weight sync and a repair never overlap (`lock`); a sync that meets a dead engine waits for the repair and runs
again (`guarded_sync`), and so does one that meets a hung engine. The sweep is off while sluice syncs or holds
generation paused, so in an async run a hang is usually met first by the next sync's pause: while a pause or a
continue waits, every engine is asked GET /model_info every `health_interval_s` (glue.fleet.liveness), and one that
answers nothing `health_failures` times in a row ends the wait at once and is replaced like one that died (after a
call that failed otherwise, every engine is asked once).
A repair gathers the trainer's weights only between train steps and checkpoints (`trainer_turn`, `guarded_train`), and
a new engine gets the version the fleet holds (`glue.fleet.repairs.engine_repair`). The loop pauses generation through the watch (`pause_generation` / `continue_generation`,
for syncs and checkpoints): a paused SGLang engine answers /health_generate 503 after ~20 s and marks itself
unhealthy, so no engine is probed while sluice holds it paused, and a probe that a pause overtook does not count.

The router is watched too: one that exited, or failed `health_failures` checks of GET /health in a row (a stopped
one answers nothing), is SIGKILLed by pid and a new one started on the same port with every engine that serves
(`RolloutFleet.restart_router`), up to `max_router_restarts` times. The requests it held are lost with it; the client
sends each again (its retries of a connection error, in `fault/reissued_requests`), and the new router takes them.

A trainer rank dying raises ProcessDied for the run to restart the trainer group (launch.run.trainer_restart, in
either placement). The router or an engine past its restarts, or any engine fault when there is nothing to restart
with (`repair=None`, e.g. colocated placement), ends the run with ProcessDied: one line naming what died and its
log. An engine whose replacement gets no placement-group bundle (its node is gone and no other has room:
glue.fleet.placing) asks the run instead to stop after the step in progress with its checkpoint (`stop_for_fault`):
the trainer is whole, so nothing trained is lost, and the run then ends with that line.

The fleets beside the policy's (a teacher's, a judge's) are watched by a FleetWatch each, of this same class, passed
to the policy's watch as `beside`: its `run` watches them all. Their engines never take weights from the trainer, so
their repair is the replacement alone (`glue.fleet.repairs.fleet_repair`), and their faults count under their fleet's name
(`fault/teacher_engine_restarts`).
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from glue.fleet.engine_host import NotPlaced
from glue.fleet.fleet import ProcessDied, _http_get, first_line
from glue.fleet.liveness import PROBES_AT_ONCE, EnginesSilent, call_while_live, silent_engines

HEALTH_FAILURES = 3  # failed deep health checks in a row that make an engine count as hung


class FleetWatch:
    """`repair(index)` replaces engine `index` (blocking; None: faults end the run). `client` (its
    `connect_retries`) adds the client's retries to the router's in `fault/reissued_requests`; the loop pauses and
    continues generation through the watch, which passes the calls on to `client`. `beside`: the watches of the
    fleets beside this one (teacher, judge), run and counted with it. A fleet with a `name` ("teacher") has its
    lines and metrics named after it."""

    def __init__(self, fleet: Any, *, repair: Callable[[int], None] | None, client: Any = None,
                 max_restarts: int = 3, poll_s: float = 2.0, health_interval_s: float = 10.0,
                 health_timeout_s: float = 60.0, health_failures: int = HEALTH_FAILURES,
                 trainer_turn: threading.Lock | None = None, beside: Sequence["FleetWatch"] = (),
                 max_router_restarts: int = 3, stop_for_fault: Callable[[str], None] | None = None):
        self.fleet, self.repair, self.client = fleet, repair, client
        self.beside = list(beside)
        self._prefix = f"{fleet.name} " if fleet.name else ""  # "teacher engine 0", "teacher router"
        self.trainer_turn = trainer_turn or threading.Lock()  # train steps and a repair's weight gathering take turns
        self.max_restarts, self.poll_s = max_restarts, poll_s
        self.health_interval_s, self.health_timeout_s, self.health_failures = (health_interval_s, health_timeout_s,
                                                                               health_failures)
        self.lock = threading.Lock()  # held by a weight sync and by a repair: never both at once
        self.restarts = 0
        self.recovery_s: list[float] = []  # seconds from detection to the new engine serving, per restart
        self.max_router_restarts, self.router_restarts = max_router_restarts, 0
        self.router_recovery_s: list[float] = []  # seconds from detection to the new router serving, per restart
        self._router_failed_checks = 0
        self._failed_checks: dict[int, int] = {}
        # engines a failed sync found answering nothing; rebound, never changed in place (two threads read it)
        self._unanswering: frozenset[int] = frozenset()
        self._syncing = False
        self._paused = False  # sluice holds generation paused (pause_generation until continue_generation)
        self._pauses = 0  # pause_generation calls so far: a health probe that a pause overtook says nothing
        self._lock_holds = 0  # syncs and repairs so far: a sweep that one overlapped says nothing either
        self._ended = threading.Event()  # the watch stopped (gave up, or the run is over): a waiting sync stops too
        self._stopping: Callable[[], bool] = lambda: False  # a stop was asked (run's `stopping`): nothing is repaired
        self._repair: asyncio.Future | None = None  # the repair running in a worker thread, if any
        # an engine whose node is gone with no room left for its bundle: the run is asked to stop with a checkpoint
        # (`stop_for_fault(line)`: the trainer is whole) and the engine, off the router, bridge and serving list, is
        # left alone meanwhile; None: such a fault ends the run like any other
        self.stop_for_fault = stop_for_fault
        self._given_up: frozenset[int] = frozenset()

    # ---- what the loop calls
    async def run(self, training: asyncio.Future, stopping: Callable[[], bool] = lambda: False) -> Any:
        """Await `training` while watching; a fault that cannot be repaired cancels it and raises ProcessDied (as
        does a training error once a process died, or a dead trainer rank), instead of a traceback from whichever
        call met the death first. Once `stopping()` (a stop was asked) a process that exits is no fault: the signal
        may have reached it too (`ray job stop` signals every process below the driver), and the stop goes on to its
        checkpoint, which needs the trainer, not the router."""
        from ray.exceptions import RayActorError

        watches = [self, *self.beside]
        for watch in watches:  # a run after a trainer restart watches again
            watch._ended.clear()
            watch._stopping = stopping
        watchdogs = [asyncio.ensure_future(w._watch()) for w in watches]
        try:
            watching = {training, *watchdogs}
            while True:
                await asyncio.wait(watching, return_when=asyncio.FIRST_COMPLETED)
                ended = {w for w in watching - {training} if w.done()}
                if training.done() or not ended or not stopping():
                    break
                for watchdog in ended:
                    reason = str(watchdog.exception() or "").strip().splitlines()[:1]
                    print(f"sluice: {reason[0] if reason else 'a watched process ended'} (after the stop was asked): "
                          "not repaired; the stop goes on to its checkpoint", file=sys.stderr, flush=True)
                watching -= ended
            if not training.done():
                training.cancel()
                await asyncio.gather(training, return_exceptions=True)
                for watchdog in watchdogs:
                    if watchdog.done():
                        watchdog.result()  # a watch only ends by raising: the fault it could not repair
            try:
                return training.result()
            except ProcessDied:  # a trainer rank's death, named with its node and log by the TrainerGroup
                raise
            except RayActorError as err:
                raise ProcessDied(f"a trainer rank died: {str(err).strip().splitlines()[0]}") from err
            except Exception as err:
                dead = [line for w in watches for line in w.fleet.exited()]
                if dead:
                    raise ProcessDied(self._beyond_repair("; ".join(dead))) from err
                raise
        finally:
            for watchdog in watchdogs:
                watchdog.cancel()
            repairs = [w._repair for w in watches if w._repair is not None]
            await asyncio.gather(*watchdogs, *repairs, return_exceptions=True)

    def guarded_sync(self, sync: Callable[[], Any]) -> Any:
        """Run a weight sync (blocking, in a worker thread) while no repair runs; if it fails because an engine
        died, wait for the watch to replace it and sync again (the new engine holds the previous weights, the
        others may hold part of the new ones under the old tag and stay paused until then)."""
        self._syncing = True
        try:
            for attempt in range(self.max_restarts + 1):
                with self.lock:
                    self._lock_holds += 1
                    try:
                        return sync()
                    except Exception as err:
                        if self.repair is None or attempt == self.max_restarts or not self.engine_fault_seen(err):
                            raise
                self._wait_for_repair()
        finally:
            self._syncing = False

    def guarded_train(self, call: Callable[[], Any]) -> Any:
        """Run a trainer call whose collectives must not meet a repair's (a train step, a checkpoint; blocking, in a
        worker thread): a repair gathers the weights for its new engine only between them (`engine_repair`)."""
        with self.trainer_turn:
            return call()

    def pause_generation(self, mode: str = "retract") -> None:
        """`client.pause_generation(mode)`; until `continue_generation` returns, no engine is probed. Outside a
        sync (a checkpoint's pause) a call that fails on an engine that died or hangs waits for its repair and goes
        again (inside one, `guarded_sync` does that for the whole sync)."""
        self._paused, self._pauses = True, self._pauses + 1
        self._through_repairs(lambda: self.client.pause_generation(mode))

    def continue_generation(self) -> None:
        """`client.continue_generation()`, through repairs as `pause_generation`; probes resume once it succeeded
        (a failed one leaves the engines paused)."""
        self._through_repairs(self.client.continue_generation)
        self._paused = False

    def _through_repairs(self, call: Callable[[], Any]) -> Any:
        if self._syncing:
            return self._while_live(call)
        for attempt in range(self.max_restarts + 1):
            try:
                return self._while_live(call)
            except Exception as err:
                if self.repair is None or attempt == self.max_restarts or self._ended.is_set() or not (
                        self.engine_fault_seen(err)):
                    raise  # `_ended`: the watch is not running (a trainer restart), so no repair is coming
            self._wait_for_repair()

    def _while_live(self, call: Callable[[], Any]) -> Any:
        """`call()`, given up once an engine is silent to `health_failures` probes in a row (glue.fleet.liveness)."""
        return call_while_live(call, self.fleet.engine_urls, interval_s=self.health_interval_s,
                               timeout_s=self.health_timeout_s, failures=self.health_failures,
                               key=getattr(self.fleet, "api_key", None))

    def faulty_engines(self) -> list[str]:
        """The urls of the engines that exited or answer nothing at all, asked now (every engine GET /model_info)."""
        self._hang_seen()
        return [self.fleet.engine_urls[index] for index in sorted({*self._dead_engines(), *self._unanswering})]

    def engine_fault_seen(self, err: Exception | None = None) -> bool:
        """After a call to the engines failed (with `err`): did one of them die, or does one answer nothing at all
        (then handed to the watch to replace)? One found silent while the call waited (EnginesSilent) is not asked
        again (unless its slot holds another engine by now)."""
        if isinstance(err, EnginesSilent):
            urls = self.fleet.engine_urls
            found = {i for i in err.indices if i < len(urls) and urls[i] == err.urls[i]}
            self._unanswering = self._unanswering | found
            return True
        return self._death_seen() or self._hang_seen()

    async def calls_settled(self, **kwargs: Any) -> bool:
        """`client.calls_settled`: the checkpoint's wait for the aborted requests (glue.loop.stream.checkpoint_state)."""
        return await self.client.calls_settled(**kwargs)

    def metrics(self) -> dict[str, float]:
        """Run totals: engines restarted, requests sent again (by the router or the client); those of the fleets
        beside as `fault/<name>_engine_restarts` and `fault/<name>_reissued_requests`."""
        reissued = self.fleet.router_retries() + (self.client.connect_retries if self.client is not None else 0)
        name = self._prefix.replace(" ", "_")
        return {f"fault/{name}engine_restarts": float(self.restarts), f"fault/{name}reissued_requests": float(reissued),
                f"fault/{name}router_restarts": float(self.router_restarts),
                **{k: v for w in self.beside for k, v in w.metrics().items()}}

    # ---- the watch
    async def _watch(self) -> None:
        try:
            await self._watch_until_fault()
        finally:
            self._ended.set()

    async def _watch_until_fault(self) -> None:
        next_check = next_router_check = time.monotonic() + self.health_interval_s
        while True:
            await asyncio.sleep(self.poll_s)
            if router_gone := await asyncio.to_thread(self.fleet.router_exit):
                await self._restart_router(router_gone)
            elif time.monotonic() >= next_router_check:
                if await asyncio.to_thread(self._router_hangs):
                    await self._restart_router(f"{self._prefix}router ({self.fleet.router_url}) failed "
                                               f"{self.health_failures} health checks in a row (GET /health, "
                                               f"{self.health_timeout_s:g} s each)")
                next_router_check = time.monotonic() + self.health_interval_s
            for index in await asyncio.to_thread(self._dead_engines):
                await self._replace(index, self.fleet.engine_exit(index))
            for index in sorted(self._unanswering):
                await self._replace(index, self._silent_line(index, " while a pause or weight sync waited on it"))
            if self.repair is not None and not self._syncing and time.monotonic() >= next_check:
                for index in await asyncio.to_thread(self._hung_engines):
                    await self._replace(index, f"{self._prefix}engine {index} ({self.fleet.engine_urls[index]}) failed "
                                               f"{self.health_failures} deep health checks in a row (GET "
                                               f"/health_generate, {self.health_timeout_s:g} s each)")
                next_check = time.monotonic() + self.health_interval_s

    def _hung_engines(self) -> list[int]:
        """Ask every engine for a token, up to `PROBES_AT_ONCE` at a time, so a sweep takes about one
        `health_timeout_s` however many engines there are; the ones that have now failed `health_failures` checks
        in a row. The sweep holds no lock, so a sync never waits on it; a sweep that a pause (every sync pauses
        first), a sync or a repair overlapped says nothing and is dropped."""
        if self._paused or self.lock.locked():
            return []  # a sync or a repair is under way: engines may be busy loading weights
        urls, pauses, holds = list(self.fleet.engine_urls), self._pauses, self._lock_holds
        key = getattr(self.fleet, "api_key", None)

        def healthy(url: str) -> bool:
            return _http_get(f"{url}/health_generate", timeout=self.health_timeout_s, key=key)[0] == 200

        with ThreadPoolExecutor(max_workers=max(1, min(len(urls), PROBES_AT_ONCE)),
                                thread_name_prefix="health-probe") as pool:
            answers = list(pool.map(healthy, urls))
        if self._paused or (self._pauses, self._lock_holds) != (pauses, holds) or self.lock.locked():
            return []
        for index, ok in enumerate(answers):
            self._failed_checks[index] = 0 if ok else self._failed_checks.get(index, 0) + 1
        return [i for i, n in self._failed_checks.items() if n >= self.health_failures]

    async def _replace(self, index: int, why: str) -> None:
        started = self._repair_begins(index, why)
        # shielded: a run that ends meanwhile waits for the repair (run's finally) instead of racing it with stop()
        self._repair = asyncio.ensure_future(asyncio.to_thread(self._repair_locked, index))
        try:
            await asyncio.shield(self._repair)
        except NotPlaced as err:
            if self.stop_for_fault is None:
                raise ProcessDied(f"{why}; its restart failed: {first_line(err)}") from err
            self._given_up = self._given_up | {index}
            self.stop_for_fault(f"{why}; its restart failed: {first_line(err)}")
            return
        except Exception as err:
            raise ProcessDied(f"{why}; its restart failed: {first_line(err)}") from err
        self._repair_ends(index, started)

    def repair_now(self) -> int:
        """Replace, here and now (blocking), every engine that exited or answers nothing at all, as the watch would;
        returns how many. For the times the watch does not run: while the trainer group is restarted
        (launch.run.trainer_restart), whose resync would otherwise fail on such an engine and end the run."""
        faulty = {index: self.fleet.engine_exit(index) for index in self._dead_engines()}
        if not faulty and (self._unanswering or self._hang_seen()):
            faulty = {index: self._silent_line(index) for index in self._unanswering}
        for index, why in sorted(faulty.items()):
            started = self._repair_begins(index, why)
            try:
                self._repair_locked(index)
            except Exception as err:
                raise ProcessDied(f"{why}; its restart failed: {first_line(err)}") from err
            self._repair_ends(index, started)
        return len(faulty)

    def _silent_line(self, index: int, when: str = "") -> str:  # an engine that answered nothing at all, `when`
        return (f"{self._prefix}engine {index} ({self.fleet.engine_urls[index]}) answered nothing{when}, not even GET "
                f"/model_info within {self.health_timeout_s:g} s")

    def _repair_begins(self, index: int, why: str) -> float:
        """Count the restart and say it, or raise ProcessDied when none may follow; returns when it began."""
        if self._stopping():  # the stop's signal may have reached it too: the run goes to its checkpoint, not a repair
            self.fleet.leave_out(index)  # which pauses generation: on the engines that still serve
            raise ProcessDied(why)
        if self.repair is None or self.restarts >= self.max_restarts:
            raise ProcessDied(self._beyond_repair(why))
        self.restarts += 1
        self._failed_checks[index] = 0
        self._unanswering = self._unanswering - {index}
        print(f"sluice: {why}; restarting it ({self.restarts} of at most {self.max_restarts} restarts)", flush=True)
        return time.monotonic()

    def _repair_ends(self, index: int, started: float) -> None:
        self.recovery_s.append(time.monotonic() - started)
        weights = "its weights" if self._prefix else "the current weights"  # a fleet beside never changes them
        print(f"sluice: {self._prefix}engine {index} serves again at {self.fleet.engine_urls[index]} with {weights}, "
              f"{self.recovery_s[-1]:.1f} s after the fault was seen", flush=True)

    def _router_hangs(self) -> bool:
        """One health check of the router; True once `health_failures` in a row failed. Its /health says only that
        the router itself serves, so a paused fleet does not fail it."""
        ok = self.fleet.router_answers(self.health_timeout_s)
        self._router_failed_checks = 0 if ok else self._router_failed_checks + 1
        return self._router_failed_checks >= self.health_failures

    async def _restart_router(self, why: str) -> None:
        """A new router on the same port with every serving engine (`RolloutFleet.restart_router`), or ProcessDied
        once `max_router_restarts` are used up."""
        if self._stopping():
            raise ProcessDied(why)
        if self.router_restarts >= self.max_router_restarts:
            raise ProcessDied(f"{why} (rollout.max_router_restarts={self.max_router_restarts} restarts used up)")
        self.router_restarts += 1
        self._router_failed_checks = 0
        print(f"sluice: {why}; starting a new router on its port ({self.router_restarts} of at most "
              f"{self.max_router_restarts} restarts)", flush=True)
        started = time.monotonic()
        try:
            live = await asyncio.to_thread(self.fleet.restart_router)
        except Exception as err:
            raise ProcessDied(f"{why}; its restart failed: {first_line(err)}") from err
        self.router_recovery_s.append(time.monotonic() - started)
        print(f"sluice: a new {self._prefix}router serves again on :{self.fleet.router_url.rsplit(':', 1)[1]} with "
              f"{len(live)} engines, {self.router_recovery_s[-1]:.1f} s after the fault was seen", flush=True)

    def _beyond_repair(self, why: str) -> str:
        """`why`, and why no restart follows when restarts were possible but are used up."""
        if self.repair is None or self.restarts < self.max_restarts:
            return why
        return f"{why} (rollout.max_engine_restarts={self.max_restarts} restarts used up)"

    def _repair_locked(self, index: int) -> None:
        with self.lock:
            self._lock_holds += 1
            self.repair(index)

    def _dead_engines(self) -> list[int]:
        """The engines that exited, less those given up for lack of room (`stop_for_fault`)."""
        return [index for index in self.fleet.dead_engines() if index not in self._given_up]

    def _death_seen(self, within_s: float = 3.0) -> bool:
        """Did an engine die? A sync call can fail on a dying engine's socket a moment before its exit shows."""
        deadline = time.monotonic() + within_s
        while not self._dead_engines():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def _hang_seen(self) -> bool:
        """Did an engine hang? Every engine is asked GET /model_info at once (glue.fleet.liveness); one that gives no
        answer at all within `health_timeout_s` is handed to the watch to replace."""
        found = silent_engines(self.fleet.engine_urls, self.health_timeout_s, getattr(self.fleet, "api_key", None))
        self._unanswering = self._unanswering | found
        return bool(found)

    def _wait_for_repair(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while ((self._dead_engines() or self._unanswering) and not self._ended.is_set()
               and time.monotonic() < deadline):
            time.sleep(0.2)
