"""Dynamic sampling (DAPO, `rollout.dynamic_sampling`): a group whose rewards are all equal is dropped when it
finishes, its place goes to a new prompt, the drop is counted per step, and too many drops stop the run with one
line. Sync and async alike, since it happens at admission to the buffer."""
from __future__ import annotations

import asyncio
import random

import pytest

from glue.loop.buffer import RolloutBuffer
from glue.loop.colocation import Disaggregated
from glue.loop.controller import LoopParts, run_loop
from glue.metrics.logger import MetricsLogger, read_metrics
from glue.loop.staleness import StalenessGate
from glue.loop.stream import RolloutFailed, RolloutStream
from glue.types import Group, Sample, SampleStatus
from loss import LossConfig
from helpers.fleet import ScriptedBridge, ScriptedFleet
from helpers.managers import NeverCheckpointed


class Engine:
    version = 0


class Manager(NeverCheckpointed):
    """Groups of 3 samples; a group whose id `is_flat` has rewards (1, 1, 1), others (0, 1, 0.5)."""

    def __init__(self, engine, is_flat, seed=0):
        self.engine, self.is_flat, self.next_id, self.rng = engine, is_flat, 0, random.Random(seed)

    def next_group(self):
        gid, self.next_id = self.next_id, self.next_id + 1
        return gid, self._generate(gid)

    async def _generate(self, gid):
        samples = [Sample(prompt_tokens=[0, 1], group_id=gid, index=i) for i in range(3)]
        await asyncio.sleep(self.rng.uniform(0, 0.01))
        for i, s in enumerate(samples):
            s.append_response([2, 3], [-1.0, -1.0], self.engine.version)
            s.reward = 1.0 if self.is_flat(gid) else [0.0, 1.0, 0.5][i]
        return Group(group_id=gid, samples=samples)


class Trainer:
    def __init__(self):
        self.version, self.batches = 0, []

    def train_step(self, batch):
        self.batches.append(batch)
        self.version += 1
        return {}


def run(tmp_path, is_flat, *, dynamic_sampling=True, max_staleness=0, steps=5, per_step=4, max_filtered_frac=0.9):
    engine = Engine()
    manager = Manager(engine, is_flat)
    gate = StalenessGate(groups_per_step=per_step, max_staleness=max_staleness)
    stream = RolloutStream(manager=manager, gate=gate, buffer=RolloutBuffer(groups_per_step=per_step),
                           max_groups=steps * per_step, dynamic_sampling=dynamic_sampling,
                           max_filtered_frac=max_filtered_frac)
    trainer, logger = Trainer(), MetricsLogger(tmp_path / f"m{max_staleness}{dynamic_sampling}.jsonl")
    parts = LoopParts(stream=stream, trainer=trainer, fleet=ScriptedFleet(),
                      phases=Disaggregated(ScriptedBridge(engine)), logger=logger)
    asyncio.run(run_loop(parts, num_steps=steps, loss_cfg=LossConfig()))
    return stream, trainer, manager, read_metrics(logger.path)


def trained_ids(records):
    ids = []
    for r in records:
        for part in r["rollout/group_ids"].split(","):
            a, _, b = part.partition("-")
            ids += list(range(int(a), int(b or a) + 1))
    return ids


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_groups_with_equal_rewards_are_dropped_replaced_and_counted_per_step(tmp_path, max_staleness):
    stream, trainer, manager, records = run(tmp_path, lambda gid: gid % 3 == 0, max_staleness=max_staleness)
    ids = trained_ids(records)
    assert len(ids) == 5 * 4 and not [i for i in ids if i % 3 == 0]  # full steps, no flat group trained
    assert all(r["rollout/zero_std_group_frac"] == 0 for r in records)
    assert all(r["rollout/num_samples"] == 4 * 3 for r in records)
    filtered = sum(r["rollout/filtered_groups"] for r in records)
    assert filtered == stream.filtered_groups >= len([i for i in range(max(ids)) if i % 3 == 0])
    # every drawn group was trained, dropped, or is still in flight / waiting at the end (async)
    assert manager.next_id == len(ids) + filtered + len(stream.buffer.entries)
    if max_staleness == 0:
        assert records[0]["rollout/filtered_groups"] == 2  # ids 0 and 3 went before the first 4 good ones (1 2 4 5)


def test_without_dynamic_sampling_flat_groups_are_trained_and_nothing_is_filtered(tmp_path):
    _, _, _, records = run(tmp_path, lambda gid: gid % 3 == 0, dynamic_sampling=False)
    assert sorted(trained_ids(records)) == list(range(20))
    assert all(r["rollout/filtered_groups"] == 0 for r in records)
    assert any(r["rollout/zero_std_group_frac"] > 0 for r in records)


def test_a_failed_group_is_not_counted_as_filtered(tmp_path):
    stream = RolloutStream(manager=None, gate=StalenessGate(groups_per_step=2, max_staleness=0),
                           buffer=RolloutBuffer(groups_per_step=2), max_groups=4, dynamic_sampling=True)
    stream.buffer.started(0, deadline=0, start_version=0)
    stream.gate.admit()
    failed = Group(group_id=0, error="boom",
                   samples=[Sample(prompt_tokens=[1], status=SampleStatus.FAILED, reward=0.0) for _ in range(2)])
    stream._accept(failed)
    assert (stream.failed_groups, stream.filtered_groups, stream.gate.admitted) == (1, 0, 0)


def test_too_many_flat_groups_for_a_step_stop_the_run_with_one_line(tmp_path):
    # every group flat: with max_filtered_frac 0.75 and 4 groups a step, the 13th drop is over the bound (13 > 12.75)
    with pytest.raises(RolloutFailed, match=r"^13 groups had all-equal rewards and were dropped "
                                            r"\(rollout.dynamic_sampling\) while a step of 4 was collected, more "
                                            r"than rollout.max_filtered_frac=0.75 of them; .*dynamic_sampling=false$"):
        run(tmp_path, lambda gid: True, max_filtered_frac=0.75)


def test_a_step_with_many_drops_but_within_the_bound_still_trains(tmp_path):
    # ids 0..11 flat (12 drops <= 0.75 x (12 + 4)): the first step waits for 4 good groups and the run finishes
    stream, trainer, _, records = run(tmp_path, lambda gid: gid < 12, max_filtered_frac=0.75, steps=2)
    assert [r["rollout/filtered_groups"] for r in records] == [12, 0]
    assert len(trainer.batches) == 2 and min(trained_ids(records)) == 12
