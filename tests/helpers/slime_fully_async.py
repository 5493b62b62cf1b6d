"""A fully-async rollout function in slime's `--rollout-function-path` form, written the way slime's fully-async
rollout is (its own code, not slime's): on the first call a background thread starts pulling
groups from the data source one at a time (a coroutine it runs with `slime.utils.async_utils.run`, on slime's one
background loop), generates and scores each with `generate_and_rm_group`, gives a group with
an aborted sample back to the data source and queues the others; every call takes `args.rollout_batch_size` finished
groups from that queue, which stays warm between calls. An atexit hook stops the worker, as slime's does. The lists
below record what happened, for tests/test_slime_fully_async.py."""
from __future__ import annotations

import asyncio
import atexit
import queue
import threading

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.types import Sample

CALLS: list[tuple[int, int]] = []  # (rollout_id, finished groups already waiting when the call began)
STARTED: list[int] = []  # the rollout_id of each call that started a worker
GIVEN_BACK: list[int] = []  # group_index of groups given back for an aborted sample
ERRORS: list[str] = []
REWARDS: list[dict] = []
WORKER_THREAD = "fully-async-worker"


class RolloutWorker:
    def __init__(self, args, data_source):
        self.args, self.data_source = args, data_source
        self.limit = args.rollout_batch_size  # groups generating at once, and finished ones waiting, at most
        self.finished: queue.Queue = queue.Queue()
        self.running = True
        self.thread = threading.Thread(target=lambda: run(self.keep_generating()), name=WORKER_THREAD,
                                       daemon=True)
        self.thread.start()

    async def keep_generating(self):
        state = GenerateState(self.args)
        generating: set[asyncio.Task] = set()
        while self.running:
            generating = {task for task in generating if not task.done()}
            while self.running and len(generating) < self.limit and self.finished.qsize() < self.limit:
                for group in self.data_source.get_samples(1):
                    task = asyncio.create_task(generate_and_rm_group(self.args, group,
                                                                     state.sampling_params.copy()))
                    task.add_done_callback(self.collect)
                    generating.add(task)
            await asyncio.sleep(0.05)
        if generating:
            await asyncio.wait(generating, timeout=20)

    def collect(self, task: asyncio.Task):
        if task.cancelled() or task.exception() is not None:
            ERRORS.append("cancelled" if task.cancelled() else repr(task.exception()))
            return
        group = task.result()
        if any(sample.status == Sample.Status.ABORTED for sample in group):
            GIVEN_BACK.append(group[0].group_index)
            self.data_source.add_samples([group])
        else:
            self.finished.put(group)

    def stop(self):
        self.running = False
        self.thread.join(timeout=30)


_worker: RolloutWorker | None = None
_worker_lock = threading.Lock()


def stop_worker():
    global _worker
    with _worker_lock:
        if _worker is not None:
            _worker.stop()
            _worker = None


atexit.register(stop_worker)


def generate_rollout_fully_async(args, rollout_id, data_source, evaluation=False):
    global _worker
    if evaluation:
        raise ValueError("the fully-async rollout does not evaluate")
    with _worker_lock:
        if _worker is None or not _worker.thread.is_alive():
            _worker = RolloutWorker(args, data_source)
            STARTED.append(rollout_id)
        worker = _worker
    CALLS.append((rollout_id, worker.finished.qsize()))
    groups = []
    while len(groups) < args.rollout_batch_size:
        try:
            groups.append(worker.finished.get(timeout=1.0))
        except queue.Empty:
            if not worker.thread.is_alive():
                raise RuntimeError("the rollout worker stopped") from None
    return RolloutFnTrainOutput(samples=sorted(groups, key=lambda group: group[0].index))


async def reward_func(args, sample, **kwargs):
    """The share of digits in the answer, plus 1 when it holds the label."""
    REWARDS.append({"label": sample.label, "response": sample.response, "n": len(sample.loss_mask)})
    answer = sample.response
    return sum(ch.isdigit() for ch in answer) / max(1, len(answer)) + float(str(sample.label) in answer)
