"""glue.rewards.isolated: calls in killable worker processes, for reward code that can hang holding the GIL."""
from __future__ import annotations

import os
import threading
import time

import pytest

from conftest import is_alive
from glue.rewards.isolated import DeadlineExceeded, IsolatedPool, WorkerDied


@pytest.fixture
def pool():
    pool = IsolatedPool(2)
    yield pool
    pool.close()


def test_a_call_returns_the_value_and_reraises_the_exception_in_the_same_worker(pool):
    assert pool.call(divmod, 17, 5, timeout_s=30) == (3, 2)
    with pytest.raises(ZeroDivisionError):
        pool.call(divmod, 1, 0, timeout_s=30)
    assert pool.call(sorted, [3, 1, 2], timeout_s=30, reverse=True) == [3, 2, 1]  # keywords travel too
    assert pool.started == 1 and len(pool.pids()) == 1
    assert pool.pids()[0] != os.getpid()


def test_a_stray_print_in_the_worker_does_not_corrupt_its_answer(pool):
    assert pool.call(print, "a line on the worker's stdout", timeout_s=30) is None
    assert pool.call(len, "four", timeout_s=30) == 4


def test_a_call_stuck_in_one_c_call_holding_the_gil_is_killed_at_its_deadline(pool):
    """`sum(range(10**15))` runs in one C loop that checks for no signal: SIGALRM and other threads would wait for
    it (hours). The deadline kills its process; the caller's own threads kept running meanwhile; the next call gets
    a fresh worker."""
    assert pool.call(abs, -1, timeout_s=30) == 1  # a started worker: its start-up is not part of the deadline
    (stuck_pid,) = pool.pids()
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.05)

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(DeadlineExceeded, match="ran past 1 s; killed"):
            pool.call(sum, range(10**15), timeout_s=1.0)
    finally:
        done.set()
        ticker.join()
    assert 1.0 <= time.monotonic() - t0 < 20
    assert len(ticks) >= 10  # this process was never frozen
    assert not is_alive(stuck_pid)
    assert pool.call(abs, -2, timeout_s=30) == 2
    assert pool.started == 2 and stuck_pid not in pool.pids()


def test_a_worker_killed_from_outside_fails_its_call_and_is_replaced(pool):
    pool.call(abs, 0, timeout_s=30)
    (pid,) = pool.pids()
    failure = {}

    def call():
        try:
            pool.call(sum, range(10**15), timeout_s=60)
        except WorkerDied as e:
            failure["error"] = e

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)
    os.kill(pid, 9)
    caller.join(timeout=30)
    assert "exited (code -9)" in str(failure["error"])
    assert pool.call(abs, -3, timeout_s=30) == 3 and pool.pids() != [pid]


def test_calls_beyond_the_pool_size_wait_for_a_worker_and_close_stops_every_worker(pool):
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(pool.call(pow, i, 2, timeout_s=60)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1, 4, 9, 16, 25]
    assert pool.started <= 2
    pids = pool.pids()
    pool.close()
    assert pids and not any(is_alive(pid) for pid in pids)


def test_a_pool_needs_at_least_one_worker():
    with pytest.raises(ValueError, match="at least 1"):
        IsolatedPool(0)


def test_a_call_past_its_deadline_goes_again_in_a_fresh_worker_when_asked_so_a_stopped_worker_costs_no_answer(pool):
    """Every idle worker SIGSTOPped (a hung reward worker, the machine's fault, not the call's): with `tries=2` the
    call that met the stopped worker is killed at its deadline and answered by a worker started for it; a call that
    holds every worker it meets still raises, after `tries` deadlines."""
    import signal

    assert pool.call(abs, -1, timeout_s=30) == 1
    (stopped,) = pool.pids()
    os.kill(stopped, signal.SIGSTOP)
    try:
        assert pool.call(abs, -3, timeout_s=1.0, tries=2) == 3
    finally:
        if is_alive(stopped):
            os.kill(stopped, signal.SIGCONT)
    assert not is_alive(stopped) and pool.started == 2
    os.kill(pool.pids()[0], signal.SIGSTOP)  # without a second try the stopped worker's deadline is the answer
    with pytest.raises(DeadlineExceeded):
        pool.call(abs, -4, timeout_s=1.0)
    started = pool.started
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        pool.call(sum, range(10**15), timeout_s=1.0, tries=2)
    assert pool.started == started + 2 and time.monotonic() - t0 >= 2.0  # two workers, each killed at its deadline
