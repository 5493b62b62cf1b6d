"""The fleet watch's deep health sweep at fleet scale: every engine probed at once (bounded), so a sweep over many
engines with some hung takes about one timeout, not one per engine, and it holds no lock a weight sync needs."""
from __future__ import annotations

import threading
import time

from glue.fleet.watch import FleetWatch
from helpers.fleet import StandInFleet


def timed_sweep(watch: FleetWatch) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    hung = watch._hung_engines()
    return hung, time.perf_counter() - t0


def test_a_sweep_over_64_engines_with_4_hung_takes_about_one_timeout_and_finds_the_hung_ones():
    fleet = StandInFleet(64, hung={3, 17, 40, 63}, hang_s=30)
    try:
        watch = FleetWatch(fleet, repair=lambda index: None, health_timeout_s=1.0, health_failures=2)
        first, first_s = timed_sweep(watch)
        second, second_s = timed_sweep(watch)
        assert first == [] and sorted(second) == [3, 17, 40, 63]
        assert max(first_s, second_s) <= 2 * watch.health_timeout_s, (first_s, second_s)  # one after another: 4 s
        assert all(watch._failed_checks[i] == 0 for i in range(64) if i not in {3, 17, 40, 63})
    finally:
        fleet.close()


def test_a_sync_never_waits_on_a_sweep_and_the_sweep_it_overlapped_is_dropped():
    fleet = StandInFleet(8, hung={1}, hang_s=30)
    try:
        watch = FleetWatch(fleet, repair=lambda index: None, health_timeout_s=2.0, health_failures=1)
        sweep: dict[str, object] = {}
        sweeper = threading.Thread(target=lambda: sweep.update(hung=watch._hung_engines()))
        sweeper.start()
        time.sleep(0.3)  # the sweep is waiting on the hung engine
        t0 = time.perf_counter()
        watch.guarded_sync(lambda: time.sleep(0.5))
        assert time.perf_counter() - t0 < 1.5, "the sync waited for the sweep"
        sweeper.join(10)
        assert sweep["hung"] == [] and watch._failed_checks == {}  # the overlapped sweep counted nothing
    finally:
        fleet.close()
