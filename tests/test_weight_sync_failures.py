"""A weight sync that fails says what failed, at once: the first failing call is raised (not the timeouts it caused
in the calls waiting for it), the members still inside a broadcast leave it, and an engine's refusal arrives with
the engine's own message."""
from __future__ import annotations

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
    senders = [threading.Thread(target=broadcast_bucket, args=(groups[r], torch.zeros(1 << 20, dtype=torch.uint8)),
                                kwargs={"src": 0}) for r in (0, 2)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(10)
    for group in groups.values():
        destroy_process_group(group)


@pytest.fixture
def unused_port() -> int:
    return free_port()
