"""A weight sync that fails says what failed, at once: the first failing call is raised (not the timeouts it caused
in the calls waiting for it), the members still inside a broadcast leave it, and an engine's refusal arrives with
the engine's own message."""
from __future__ import annotations

import contextlib
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import free_port

from weight_sync.broadcast import BroadcastAborted, abort_key, broadcast_bucket
from weight_sync.engine_calls import WeightSyncError, run_together
from weight_sync.process_group import create_process_group, destroy_process_group


def test_the_first_failure_is_raised_at_once_and_the_others_are_told_to_leave():
    left = threading.Event()
    told = []

    def refuses():
        time.sleep(0.1)
        raise WeightSyncError("engine refused: must run between begin_weight_update() and end_weight_update()")

    def waits_in_a_collective():  # returns only once told to leave, then fails the way a left collective does
        if not left.wait(20):
            return "finished"
        raise BroadcastAborted("left the broadcast")

    def on_failure():
        told.append(time.perf_counter())
        left.set()

    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="begin_weight_update"):
        run_together([waits_in_a_collective, refuses], timeout_s=20, on_failure=on_failure)
    assert time.perf_counter() - t0 < 5, "the refusal waited for the other call instead of surfacing at once"
    assert len(told) == 1


def test_calls_that_outlive_the_timeout_raise_instead_of_hanging():
    release = threading.Event()
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="did not finish within 0.5 s"):
        run_together([lambda: release.wait(10)], timeout_s=0.5, on_failure=release.set)
    assert time.perf_counter() - t0 < 5


def test_a_member_waiting_in_a_broadcast_leaves_it_when_the_abort_key_is_set(unused_port):
    """Rank 1 waits for a bucket that rank 2 will never take part in (it refused); the driver sets the group's
    abort key and rank 1 leaves within a second instead of waiting out the 60 s collective timeout."""
    port, name = unused_port, "aborted_group"
    groups: dict[int, object] = {}

    def join(rank: int) -> None:
        groups[rank] = create_process_group(master_address="127.0.0.1", master_port=port, rank=rank, world_size=3,
                                            group_name=name, backend="gloo", timeout_s=60)

    joiners = [threading.Thread(target=join, args=(r,)) for r in (1, 2)]
    for thread in joiners:
        thread.start()
    join(0)
    for thread in joiners:
        thread.join()
    outcome: dict[str, object] = {}

    def receive() -> None:
        t0 = time.perf_counter()
        try:
            broadcast_bucket(groups[1], torch.empty(1 << 20, dtype=torch.uint8), src=0)
            outcome["result"] = "received"
        except BroadcastAborted as err:
            outcome["result"] = err
        outcome["s"] = time.perf_counter() - t0

    receiver = threading.Thread(target=receive)
    receiver.start()
    time.sleep(0.5)
    assert receiver.is_alive(), "rank 1 should still be waiting for the source"
    driver = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    driver.set(abort_key(name), "1")
    receiver.join(10)
    assert not receiver.is_alive()
    assert isinstance(outcome["result"], BroadcastAborted)
    assert outcome["s"] < 5
    # The abandoned receive is still queued in gloo; ranks 0 and 2 complete it so tearing the group down does not
    # wait out the 60 s timeout (a real source leaves the group the same way: the whole group is destroyed).
    def complete(rank: int) -> None:
        with contextlib.suppress(BroadcastAborted):  # the abort key is still set: they complete it and leave
            broadcast_bucket(groups[rank], torch.zeros(1 << 20, dtype=torch.uint8), src=0)

    senders = [threading.Thread(target=complete, args=(r,)) for r in (0, 2)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(10)
    for group in groups.values():
        destroy_process_group(group)


@pytest.fixture
def unused_port() -> int:
    return free_port()


class FlakySource:
    """A LocalWeightSource whose next `failures` bucket sends fail the way a broken weight group does on the
    trainer's side (gloo's error); everything else is the real source's."""

    def __init__(self, source, failures: int = 0):
        self.source, self.failures = source, failures

    def __getattr__(self, name):
        return getattr(self.source, name)

    def send_weight_bucket(self, channel: str, index: int):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("[gloo] Connection closed by peer")
        return self.source.send_weight_bucket(channel, index)


def test_a_failed_transfer_is_sent_again_on_groups_built_anew_up_to_sync_max_retries(engine_processes, tiny_model_dir,
                                                                                      capsys):
    """An embedded engine, a real broadcast bridge whose source fails a bucket's broadcast once: the engine
    waiting in it leaves at the bridge's abort key, the bridge builds the group again and the sync goes through. A
    fault that outlasts `max_retries` is raised after them, and the next sync still works."""
    from transformers import AutoModelForCausalLM

    from glue.loop.config import SyncConfig
    from weight_sync.bridge import make_bridge
    from weight_sync.engine_calls import weight_version
    from weight_sync.sender import LocalWeightSource

    urls = [engine_processes.start(tiny_model_dir, "--num-threads", "1")]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    source = FlakySource(LocalWeightSource({n: p.detach().clone() for n, p in model.named_parameters()}))
    bridge = make_bridge(SyncConfig(transport="broadcast", max_retries=2, timeout_s=30.0), source=source,
                         engine_urls=urls)
    try:
        bridge.sync(1)
        group = bridge.transport.groups[tuple(urls)]
        source.failures = 1
        started = time.perf_counter()
        bridge.sync(2)
        took = time.perf_counter() - started
        assert [weight_version(u, 10) for u in urls] == ["2"] and bridge.sync_retries == 1
        assert bridge.transport.groups[tuple(urls)] != group  # a new group
        retried = [line for line in capsys.readouterr().err.splitlines() if "goes again" in line]
        assert retried == ["sluice: the weight sync to version 2 failed ([gloo] Connection closed by peer); every "
                           "engine answers, so the weight groups are built anew and it goes again (1 of at most 2 "
                           "retries, sync.max_retries)"]
        source.failures = 3  # one more than the retries
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            bridge.sync(3)
        assert bridge.sync_retries == 3 and bridge.last_sync["retries"] == 1.0  # the last sync that went through
        bridge.sync(4)
        assert [weight_version(u, 10) for u in urls] == ["4"]
        print(f"the retried sync took {took:.1f} s")
    finally:
        bridge.close()
