"""Liveness while a pause or a sync waits on the engines (glue.fleet.liveness through the watch): an engine that
answers nothing is found in seconds and replaced, and the waiting call gives up at once instead of waiting out the
client's control timeout; an engine that is only slow, or paused and SGLang-strict, is left alone."""
import asyncio
import os
import signal
import threading
import time

import pytest

from conftest import is_alive
from glue.fleet.engine_client import EngineClient
from glue.fleet.fleet import RolloutFleet
from glue.fleet.repairs import fleet_repair
from glue.fleet.watch import FleetWatch
from helpers.fleet import SlowEngineFleet

CONTROL_TIMEOUT_S = 60.0  # the client's own wait on a pause: what the liveness probes must beat by far


@pytest.fixture
def strict_fleet(tiny_model_dir, tmp_path):
    """Two SGLang-strict embedded engines behind the real router: paused, they answer GET /health only after 20 s
    (503), as SGLang does."""
    with RolloutFleet(model_path=tiny_model_dir, num_engines=2, engine_args=["--num-threads", "1", "--sglang-strict"],
                      log_dir=tmp_path / "logs") as fleet:
        yield fleet


def liveness_watch(fleet, repair, **limits) -> FleetWatch:
    """A watch that probes every 0.5 s with a 1 s timeout, 2 silent probes in a row making an engine hung, over a
    client that would wait `CONTROL_TIMEOUT_S` for a pause."""
    client = EngineClient(getattr(fleet, "router_url", "http://router"), fleet.engine_urls,
                          control_timeout_s=CONTROL_TIMEOUT_S)
    return FleetWatch(fleet, repair=repair, client=client, poll_s=0.2, health_interval_s=0.5, health_timeout_s=1.0,
                      health_failures=2, **limits)


def control_threads_left(within_s: float) -> list[threading.Thread]:
    """The threads of control calls and liveness probes still alive after waiting up to `within_s` for them to end."""
    deadline = time.monotonic() + within_s
    while (left := [t for t in threading.enumerate() if t.name == "engine-control" or t.name.startswith("liveness")]):
        if time.monotonic() > deadline:
            return left
        time.sleep(0.05)
    return []


@pytest.mark.slow
@pytest.mark.long  # ~30 s with the fleet's start and the real replacement; the silent double below stays in make test
def test_a_sync_whose_pause_meets_a_stopped_engine_has_it_replaced_long_before_the_control_timeout(strict_fleet,
                                                                                                  capfd):
    """The sync's pause waits on a SIGSTOPped engine (alive, answering nothing): the liveness probes find it silent
    twice in a row, the pause is given up, the watch replaces the engine and the sync goes again, all in seconds
    where the pause alone would wait 60. The other engine, paused and strict, is slow to GET /health but is not
    taken for hung. The pause left behind ends once the stopped engine is killed, quietly."""
    fleet = strict_fleet
    repairs_started: list[float] = []

    def repair(index: int) -> None:
        repairs_started.append(time.monotonic())
        fleet_repair(fleet)(index)

    watch = liveness_watch(fleet, repair)
    hung_pid, hung_url, other_url = fleet.pids[0], fleet.engine_urls[0], fleet.engine_urls[1]

    def sync() -> None:
        watch.pause_generation("retract")
        watch.continue_generation()

    async def scenario() -> None:
        await watch.run(asyncio.ensure_future(asyncio.to_thread(watch.guarded_sync, sync)))

    os.kill(hung_pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        asyncio.run(scenario())
    finally:
        if is_alive(hung_pid):
            os.kill(hung_pid, signal.SIGCONT)
    synced_s = time.monotonic() - started
    assert watch.restarts == 1 and not is_alive(hung_pid), "the stopped engine was not replaced"
    assert fleet.engine_urls[1] == other_url and fleet.engine_urls[0] != hung_url
    found_s = repairs_started[0] - started
    assert found_s < CONTROL_TIMEOUT_S / 6, f"the repair began {found_s:.1f} s after the pause met the hang"
    assert not watch._paused and not watch._unanswering
    assert control_threads_left(within_s=10) == [], "the pause left behind did not end once the engine was killed"
    assert "Traceback" not in capfd.readouterr().err
    print(f"repair began {found_s:.1f} s after the sync's pause met the stopped engine; the sync ended after "
          f"{synced_s:.1f} s (control timeout {CONTROL_TIMEOUT_S:g} s)")


def test_a_sync_whose_pause_waits_on_a_silent_engine_gives_up_within_seconds_and_goes_again_after_its_repair(capfd):
    """The same through a stand-in engine that takes connections and answers nothing until its repair wakes it:
    the pause is given up after 2 silent probes, the engine handed to the repair, the sync runs again and the pause
    left behind ends quietly when the engine answers it."""
    fleet = SlowEngineFleet(silent=True)
    repairs_started: list[float] = []

    def repair(index: int) -> None:
        repairs_started.append(time.monotonic())
        fleet.wake()

    watch = liveness_watch(fleet, repair)
    pauses: list[str] = []

    def sync() -> None:
        watch.pause_generation("retract")
        pauses.append("answered")
        watch.continue_generation()

    async def scenario() -> None:
        await watch.run(asyncio.ensure_future(asyncio.to_thread(watch.guarded_sync, sync)))

    started = time.monotonic()
    try:
        asyncio.run(scenario())
    finally:
        fleet.close()
    found_s = repairs_started[0] - started
    assert watch.restarts == 1 and pauses == ["answered"] and not watch._paused
    assert found_s < CONTROL_TIMEOUT_S / 10, f"the repair began {found_s:.1f} s after the pause met the silence"
    assert control_threads_left(within_s=5) == [], "the pause left behind never ended"
    assert "Traceback" not in capfd.readouterr().err
    print(f"repair began {found_s:.1f} s after the pause met the silent engine (control timeout "
          f"{CONTROL_TIMEOUT_S:g} s)")


def test_a_sync_that_fails_while_the_engines_are_paused_ends_with_its_own_error_and_replaces_nothing():
    """After a failed sync every engine is asked whether it answers at all. A paused SGLang server answers GET
    /health only after 20 s (it generates a token for it), so a 1 s probe of that route took it for hung and had it
    replaced; GET /model_info answers at once."""
    fleet = SlowEngineFleet()
    repaired: list[int] = []
    watch = liveness_watch(fleet, repaired.append, max_restarts=1)

    def sync() -> None:
        watch.pause_generation("retract")
        raise RuntimeError("the transfer failed")

    async def scenario() -> None:
        await watch.run(asyncio.ensure_future(asyncio.to_thread(watch.guarded_sync, sync)))

    try:
        with pytest.raises(RuntimeError, match="^the transfer failed$"):
            asyncio.run(scenario())
    finally:
        fleet.close()
    assert repaired == [] and watch.restarts == 0 and not watch._unanswering


def test_an_engine_that_answers_its_pause_late_but_answers_liveness_probes_is_not_replaced():
    """A pause answered after 3 s (an SGLang server finishing a long batch first) by an engine that answers GET
    /model_info at once is waited for: the probes ran meanwhile, and none counted against it."""
    fleet = SlowEngineFleet(pause_s=3.0)
    repaired: list[int] = []
    watch = liveness_watch(fleet, repaired.append)
    took: list[float] = []

    async def checkpoint() -> None:
        started = time.monotonic()
        await asyncio.to_thread(watch.pause_generation, "abort")
        took.append(time.monotonic() - started)
        await asyncio.to_thread(watch.continue_generation)

    async def scenario() -> None:
        await watch.run(asyncio.ensure_future(checkpoint()))

    try:
        asyncio.run(scenario())
    finally:
        fleet.close()
    assert repaired == [] and watch.restarts == 0
    assert took[0] >= 3.0, "the pause did not wait for the engine's answer"
    assert fleet.info_probes >= 2, "no liveness probe was sent while the pause waited"
    print(f"pause answered after {took[0]:.1f} s, {fleet.info_probes} liveness probes meanwhile, none silent")


def test_the_liveness_probe_is_answered_at_once_by_a_paused_engine_and_never_by_a_silent_one():
    """`answers_at_all`, the probe of the watch and of the weight bridge after a failed transfer (engines paused)."""
    from weight_sync.engine_calls import answers_at_all, post_json

    paused, silent = SlowEngineFleet(), SlowEngineFleet(silent=True)
    try:
        post_json(f"{paused.engine_urls[0]}/pause_generation", {"mode": "abort"}, timeout_s=5)
        started = time.monotonic()
        assert answers_at_all(paused.engine_urls[0], timeout_s=1.0)
        assert time.monotonic() - started < 0.5
        assert not answers_at_all(silent.engine_urls[0], timeout_s=0.3)
    finally:
        paused.close()
        silent.close()
