"""A node that is lost takes its engines and trainer ranks with it. Ray keeps the node's placement-group bundles
there until it marks the node dead, so what is started again on them meanwhile dies as it starts and is started
again (glue.fleet.placing); once Ray has placed the bundles elsewhere it runs. Where no node has room, an engine's
host waits `cluster.placement_timeout_s` and gives up (NotPlaced): the watch then asks the run to stop with its
checkpoint, since the trainer is whole, and the run ends with that line. Here with doubles for the fleet and the
starts (a two-node cluster with a raylet killed is `make soak`'s node loss; the host's timeout on real Ray is in
tests/test_engine_host.py)."""
import asyncio

import pytest

from glue.fleet.engine_host import HostDiedAtStart, NotPlaced
from glue.fleet.placing import start_until_placed
from glue.fleet.watch import FleetWatch
from launch.run.stopping import StopSignals


def test_what_dies_as_it_starts_is_started_again_until_it_runs_or_its_time_is_up(capsys):
    starts = []

    def start():
        starts.append(1)
        if len(starts) < 3:
            raise HostDiedAtStart("engine 1's host actor died as it started (its node is gone)")
        return "engine 1"

    assert start_until_placed(start, dies=(HostDiedAtStart,), what="engine 1", timeout_s=5, pause_s=0) == "engine 1"
    assert len(starts) == 3
    assert capsys.readouterr().out.count("sluice: engine 1 died as it started (engine 1's host actor died as it "
                                         "started (its node is gone)); starting it again in 0 s") == 2

    def never():
        raise HostDiedAtStart("again")

    with pytest.raises(HostDiedAtStart, match="again"):
        start_until_placed(never, dies=(HostDiedAtStart,), what="engine 1", timeout_s=0.3, pause_s=0.1)

    def other():  # any other failure is not a lost node's: it rises at once
        starts.append(1)
        raise ValueError("a bad flag")

    starts.clear()
    with pytest.raises(ValueError):
        start_until_placed(other, dies=(HostDiedAtStart,), what="engine 1", timeout_s=5, pause_s=0)
    assert len(starts) == 1


class LostEngineFleet:
    """Engine 1 of two is gone with its node, and nothing has room for its bundle."""

    name, router_url = "", "http://127.0.0.1:1"
    engine_urls = ["http://127.0.0.1:2", "http://127.0.0.1:3"]

    def router_exit(self):
        return None

    def router_answers(self, timeout_s):
        return True

    def dead_engines(self):
        return [1]

    def engine_exit(self, index):
        return f"engine {index} ({self.engine_urls[index]}) exited with code -1; its log: runs/x/logs/engine_1.log"

    def exited(self):
        return [self.engine_exit(1)]


def test_an_engine_with_no_room_left_asks_the_run_to_stop_with_its_checkpoint_and_is_not_repaired_again():
    repairs, asked = [], []

    def repair(index):
        repairs.append(index)
        raise NotPlaced(f"engine {index} did not start on its placement-group bundle within 120 s (is its node "
                        "gone, with no other node that has room for it?)")

    async def step_then_checkpoint():  # the loop: once the stop is asked, its step ends with a checkpoint
        while not asked:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # more watch polls, which must leave the given-up engine alone
        return 7

    async def watched():
        watch = FleetWatch(LostEngineFleet(), repair=repair, poll_s=0.05, health_interval_s=3600,
                           stop_for_fault=asked.append)
        last = await watch.run(asyncio.ensure_future(step_then_checkpoint()), stopping=lambda: bool(asked))
        return last, watch

    last, watch = asyncio.run(watched())
    assert last == 7 and repairs == [1], repairs  # tried once, then left alone; the run went to its checkpoint
    assert asked == ["engine 1 (http://127.0.0.1:3) exited with code -1; its log: runs/x/logs/engine_1.log; its "
                     "restart failed: engine 1 did not start on its placement-group bundle within 120 s (is its node "
                     "gone, with no other node that has room for it?)"]
    assert not watch._dead_engines()  # a pause or sync no longer waits for its repair

    async def no_stop():  # a watch with no stop to ask ends the run with the line, as before
        watch = FleetWatch(LostEngineFleet(), repair=repair, poll_s=0.05, health_interval_s=3600)
        await watch.run(asyncio.ensure_future(asyncio.sleep(5)))

    from glue.fleet.fleet import ProcessDied
    with pytest.raises(ProcessDied, match=r"^engine 1 .* its restart failed: engine 1 did not start on its "):
        asyncio.run(no_stop())


def test_a_fault_asks_the_stop_a_signal_asks_and_is_kept_for_the_runs_last_line(capsys):
    stop = StopSignals(grace_s=30)
    assert not stop()
    stop.for_fault("engine 1 (…) exited with code -1; its restart failed: …")
    assert stop() and stop.fault == "engine 1 (…) exited with code -1; its restart failed: …"
    assert stop.requested_at is not None  # the grace of a stop runs from here, as for a signal
    stop.for_fault("a second fault")  # the first one's stop is under way: nothing changes
    assert stop.fault.startswith("engine 1")
    assert capsys.readouterr().err.strip() == ("sluice: engine 1 (…) exited with code -1; its restart failed: …: "
                                               "stopping after the step in progress, with its checkpoint")


def test_the_repair_of_one_engine_of_a_lost_node_takes_the_others_of_that_node_off_the_bridge_with_it():
    """Two engines gone at once: the first one's repair rebuilds the bridge's channel without it, which would fail
    on the second (it answers nothing), so both leave the channel in one go; the second's own repair then finds it
    gone already."""
    from glue.fleet.repairs import engine_repair

    urls = ["http://e0", "http://e1", "http://e2"]

    class Bridge:
        def __init__(self):
            self.engine_urls = list(urls)

        def remove_engine(self, url, *also):
            self.engine_urls = [u for u in self.engine_urls if u not in {url, *also}]
            if set(self.engine_urls) & {"http://e1", "http://e2"}:  # a channel rebuilt to a dead engine
                raise ConnectionRefusedError(f"{self.engine_urls}: connecting the channel failed")

        def is_behind_source(self):
            return False

        def add_engine(self, url):
            self.engine_urls.append(url)

    class Fleet:
        engine_urls = list(urls)

        def dead_engines(self):
            return [i for i, u in enumerate(self.engine_urls) if u in ("http://e1", "http://e2")]

        def replace_engine(self, index, prepare):
            self.engine_urls[index] = f"http://new{index}"
            prepare(self.engine_urls[index])

    bridge, fleet = Bridge(), Fleet()
    repair = engine_repair(fleet, bridge)
    repair(1)
    repair(2)
    assert bridge.engine_urls == ["http://e0", "http://new1", "http://new2"]
