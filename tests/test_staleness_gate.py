"""The staleness gate and the rollout buffer on scripted traces (pure bookkeeping), then the whole loop on an
event loop with a scripted engine whose tokens take the version it holds at each token, and random latency."""
import asyncio
import random

import pytest

from glue.loop.buffer import RolloutBuffer
from glue.loop.colocation import Disaggregated
from glue.loop.controller import LoopParts, run_loop
from glue.metrics.logger import MetricsLogger, read_metrics
from glue.loop.staleness import StalenessGate, StalenessStats
from glue.loop.stream import RolloutFailed, RolloutStream
from glue.types import Group, Sample, SampleStatus
from loss import LossConfig
from helpers.fleet import ScriptedBridge, ScriptedFleet
from helpers.managers import ScriptedManager


def test_sync_mode_admits_one_steps_groups_per_version_and_syncs_after_every_step():
    gate = StalenessGate(groups_per_step=3, max_staleness=0)
    assert [gate.admit() for _ in range(3)] == [0, 0, 0]  # deadline: trained at version 0
    assert not gate.can_admit()
    gate.trained(1)
    assert gate.should_sync() and not gate.can_admit()
    gate.synced(1)
    assert gate.capacity == 3 and not gate.should_sync()


def test_async_admission_is_the_capacity_form_with_the_engines_version():
    gate = StalenessGate(groups_per_step=2, max_staleness=2)
    assert gate.capacity == 6  # (2 + 0 + 1) * 2
    deadlines = [gate.admit() for _ in range(6)]
    assert deadlines == [2] * 6 and not gate.can_admit()
    gate.trained(1)
    assert not gate.can_admit(), "training alone must not admit more: the engines still hold version 0"
    gate.synced(1)
    assert gate.capacity == 2 and gate.admit() == 3
    gate.give_back()  # a group that failed as a whole frees its place
    assert gate.capacity == 2


def test_a_group_is_too_stale_once_the_trainer_is_past_its_deadline():
    gate = StalenessGate(groups_per_step=1, max_staleness=1)
    deadline = gate.admit()
    assert deadline == 1
    gate.trained(1)
    assert not gate.is_too_stale([0, 1])
    gate.trained(2)
    assert gate.is_too_stale([0, 1]) and not gate.is_too_stale([1, 2])
    assert gate.token_staleness([0, 1, 2]) == [2, 1, 0]


def test_an_interval_beyond_max_staleness_plus_one_is_refused_because_it_would_deadlock():
    with pytest.raises(ValueError, match="sync.interval=3 must be in"):
        StalenessGate(groups_per_step=1, max_staleness=1, interval=3)
    assert StalenessGate(groups_per_step=1, max_staleness=3, interval=4).interval == 4


def test_mu_grpo_stages_sync_once_per_stage_of_k_steps():
    k = 4
    gate = StalenessGate(groups_per_step=1, max_staleness=k - 1, interval=k)
    syncs = []
    for step in range(1, 13):
        gate.trained(step)
        if gate.should_sync():
            gate.synced(step)
            syncs.append(step)
    assert syncs == [4, 8, 12]


def group(gid, versions, reward=1.0, status=SampleStatus.COMPLETED, n=2):
    samples = []
    for i in range(n):
        s = Sample(prompt_tokens=[0, 1], group_id=gid, index=i, reward=reward * i, status=status)
        for v in versions:
            s.append_response([2], [-1.0], v)
        samples.append(s)
    return Group(group_id=gid, samples=samples)


def test_the_buffer_waits_for_a_due_group_still_generating_then_takes_due_groups_first():
    gate = StalenessGate(groups_per_step=2, max_staleness=1)
    buf = RolloutBuffer(groups_per_step=2, order="newest_first")
    for gid in range(4):
        buf.started(gid, deadline=gate.admit(), start_version=0)
    gate.trained(1)  # every group (deadline 1) is now due
    buf.finished(group(1, [0]))
    buf.finished(group(2, [0]))
    buf.finished(group(3, [0]))
    assert not buf.is_ready(gate), "group 0 is due and still generating"
    buf.finished(group(0, [0]))
    groups, withheld = buf.take(gate)
    # all four are due: earliest deadline, then finish order; newest_first only orders groups not yet due
    assert [g.group_id for g in groups] == [1, 2] and not withheld
    assert sorted(e.group_id for e in buf.in_queue) == [0, 3]


def test_a_step_waits_rather_than_take_a_later_group_whose_place_an_earlier_one_still_generating_needs():
    # B = 1, max_staleness 2: groups 0, 1, 2 start on version 0 (deadline 2); step 0 trains group 2
    gate = StalenessGate(groups_per_step=1, max_staleness=2)
    buf = RolloutBuffer(groups_per_step=1)
    for gid in range(3):
        buf.started(gid, deadline=gate.admit(), start_version=0)
    buf.finished(group(2, [0]))
    assert [g.group_id for g in buf.take(gate)[0]] == [2]
    gate.trained(1)
    gate.synced(1)
    buf.started(3, deadline=gate.admit(), start_version=1)  # deadline 3
    buf.finished(group(3, [1]))
    # Groups 0 and 1 (deadline 2) still need steps 1 and 2: taking group 3 now would push one of them to step 3.
    assert not buf.is_ready(gate)
    buf.finished(group(1, [0]))
    assert [g.group_id for g in buf.take(gate)[0]] == [1]
    gate.trained(2)
    assert not buf.is_ready(gate), "group 0 is due at this step and still generating"
    buf.finished(group(0, [0]))
    assert [g.group_id for g in buf.take(gate)[0]] == [0]


def test_newest_first_surfaces_the_latest_finished_groups_that_are_not_due():
    gate = StalenessGate(groups_per_step=1, max_staleness=3)
    for order, expected in (("fifo", 0), ("newest_first", 2)):
        buf = RolloutBuffer(groups_per_step=1, order=order)
        for gid in range(3):
            buf.started(gid, deadline=3, start_version=0)
            buf.finished(group(gid, [0]))
        assert buf.take(gate)[0][0].group_id == expected


def test_too_stale_samples_are_withheld_and_counted_under_drop_and_trained_under_keep():
    for policy, expected in (("drop", {(5, 0), (5, 1)}), ("keep", set())):
        gate = StalenessGate(groups_per_step=1, max_staleness=0, admission=False)
        buf = RolloutBuffer(groups_per_step=1, stale_policy=policy)
        buf.started(5, deadline=gate.admit(), start_version=0)
        buf.finished(group(5, [0, 1]))
        gate.trained(1)
        gate.trained(2)
        _, withheld = buf.take(gate)
        assert withheld == expected and gate.dropped_stale == len(expected)


def test_withheld_samples_count_in_the_baseline_but_are_not_trained():
    from glue.loop.batch import build_train_batch

    g = group(0, [0], n=4)  # rewards 0, 1, 2, 3: mean 1.5
    batch, _ = build_train_batch([g], LossConfig(normalize_std=False), withheld={(0, 3)})
    assert batch.tokens.shape[0] == 3
    assert batch.advantages[:, 1].tolist() == [-1.5, -0.5, 0.5]


def test_a_sample_still_aborted_after_its_resumes_is_not_trained():
    from glue.loop.batch import build_train_batch

    g = group(0, [0], n=3)
    g.samples[2].status = SampleStatus.ABORTED
    batch, _ = build_train_batch([g], LossConfig(normalize_std=False))
    assert batch.tokens.shape[0] == 2


def test_staleness_stats_give_max_mean_and_a_histogram():
    stats = StalenessStats()
    stats.add([0, 0, 1, 3])
    assert stats.metrics() == {"staleness/max": 3.0, "staleness/mean": 1.0, "staleness/hist_0": 0.5,
                               "staleness/hist_1": 0.25, "staleness/hist_3": 0.25}


# ---- the whole loop on a scripted engine ----
class ScriptedEngine:
    """Tokens take the version the engine holds when each is produced; a sync swaps the version."""

    def __init__(self, latency, seed):
        self.version, self.latency, self.rng = 0, latency, random.Random(seed)


class ScriptedTrainer:
    def __init__(self):
        self.version, self.trained_versions = 0, []

    def train_step(self, batch):
        self.trained_versions.append((self.version, batch.versions[batch.logprob_mask > 0].tolist()))
        self.version += 1
        return {"weights/version": float(self.version)}


def run_scripted(tmp_path, *, max_staleness, interval=1, steps=12, groups_per_step=2, latency=0.02, seed=0,
                 stale_policy="keep"):
    engine = ScriptedEngine(latency, seed)
    gate = StalenessGate(groups_per_step=groups_per_step, max_staleness=max_staleness, interval=interval)
    stream = RolloutStream(manager=ScriptedManager(engine), gate=gate, max_groups=steps * groups_per_step,
                           buffer=RolloutBuffer(groups_per_step=groups_per_step, stale_policy=stale_policy))
    trainer, fleet, bridge = ScriptedTrainer(), ScriptedFleet(), ScriptedBridge(engine)
    logger = MetricsLogger(tmp_path / f"m{max_staleness}_{interval}_{seed}.jsonl")
    parts = LoopParts(stream=stream, trainer=trainer, fleet=fleet, phases=Disaggregated(bridge), logger=logger)
    asyncio.run(run_loop(parts, num_steps=steps, loss_cfg=LossConfig(), pause_mode="abort"))
    return trainer, bridge, fleet, read_metrics(logger.path)


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_under_random_latency_no_trained_token_is_staler_than_the_bound(tmp_path, max_staleness):
    for seed in range(5):
        trainer, bridge, fleet, records = run_scripted(tmp_path, max_staleness=max_staleness, seed=seed)
        worst = max(v_train - v for v_train, versions in trainer.trained_versions for v in versions)
        assert worst <= max_staleness
        assert [r["staleness/max"] for r in records] == [
            max(v_train - v for v in versions) for v_train, versions in trainer.trained_versions]
        assert all(r["async/dropped_stale"] == 0 for r in records)
        assert fleet.calls[:2] == [("pause", "abort"), ("continue",)]
    if max_staleness == 0:  # sync mode: every token comes from the weights being trained
        assert all(set(versions) == {v_train} for v_train, versions in trainer.trained_versions)
    else:  # async: the run did use its allowance somewhere
        assert any(r["staleness/max"] > 0 for r in records)


def test_the_loop_syncs_after_every_step_by_default_and_once_per_stage_for_mu_grpo(tmp_path):
    _, bridge, _, records = run_scripted(tmp_path, max_staleness=1, steps=6)
    assert bridge.versions == [1, 2, 3, 4, 5, 6]
    _, bridge, _, records = run_scripted(tmp_path, max_staleness=3, interval=4, steps=8)
    assert bridge.versions == [4, 8]
    assert [r["weights/lag"] for r in records] == [1, 2, 3, 0, 1, 2, 3, 0]


def test_every_step_records_the_wall_clock_since_training_started_for_curves_by_time(tmp_path):
    _, _, _, records = run_scripted(tmp_path, max_staleness=1, steps=5)
    elapsed = [r["time/elapsed_s"] for r in records]
    assert all(later > earlier for earlier, later in zip(elapsed, elapsed[1:]))
    # each step's own time fits between the clock's readings: the clock counts every step and nothing twice
    assert elapsed[0] >= records[0]["time/step_s"]
    assert all(b - a >= r["time/step_s"] - 1e-6 for a, b, r in zip(elapsed, elapsed[1:], records[1:]))
    assert elapsed[-1] == pytest.approx(sum(r["time/step_s"] for r in records), abs=0.05)


def test_a_rollout_function_error_reaches_the_loop_and_stops_every_group(tmp_path):
    engine = ScriptedEngine(0.01, 0)

    class Failing(ScriptedManager):
        async def _generate(self, gid):
            if gid == 3:
                raise RuntimeError("tool crashed in group 3")
            return await super()._generate(gid)

    gate = StalenessGate(groups_per_step=2, max_staleness=1)
    stream = RolloutStream(manager=Failing(engine), gate=gate, buffer=RolloutBuffer(groups_per_step=2), max_groups=20)

    async def main():
        with pytest.raises(RuntimeError, match="group 3"):
            await run_loop(LoopParts(stream=stream, trainer=ScriptedTrainer(), fleet=ScriptedFleet(),
                                     phases=Disaggregated(ScriptedBridge(engine)),
                                     logger=MetricsLogger(tmp_path / "m.jsonl")),
                           num_steps=10, loss_cfg=LossConfig())
        assert not stream._tasks and stream._producer.done()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not pending, pending

    asyncio.run(main())


class FailsSome(ScriptedManager):
    """Groups whose id is in `failing` come back failed, as glue.rollout.manager.RolloutManager returns them when the
    user's function raises or times out: every sample FAILED, `error` set."""

    def __init__(self, engine, failing):
        super().__init__(engine)
        self.failing = failing

    async def _generate(self, gid):
        group = await super()._generate(gid)
        if self.failing(gid):
            for s in group.samples:
                s.status = SampleStatus.FAILED
            group.error = f"RuntimeError: sandbox {gid} crashed"
        return group


def run_failing(tmp_path, failing, *, steps=6, max_staleness=1):
    engine = ScriptedEngine(0.005, 0)
    gate = StalenessGate(groups_per_step=4, max_staleness=max_staleness)
    stream = RolloutStream(manager=FailsSome(engine, failing), gate=gate, buffer=RolloutBuffer(groups_per_step=4),
                           max_groups=steps * 4, max_failed_frac=0.5)
    trainer, logger = ScriptedTrainer(), MetricsLogger(tmp_path / "failing.jsonl")
    parts = LoopParts(stream=stream, trainer=trainer, fleet=ScriptedFleet(),
                      phases=Disaggregated(ScriptedBridge(engine)), logger=logger)
    asyncio.run(run_loop(parts, num_steps=steps, loss_cfg=LossConfig()))
    return stream, trainer, read_metrics(logger.path)


def test_a_failed_group_is_counted_and_replaced_and_the_run_finishes(tmp_path):
    stream, trainer, records = run_failing(tmp_path, lambda gid: gid % 8 == 3)
    assert len(records) == 6 and len(trainer.trained_versions) == 6  # every step trained a full batch
    assert all(len(versions) == 4 * 2 * 3 for _, versions in trainer.trained_versions)  # 4 groups x 2 samples x 3
    assert sum(r["rollout/failed_groups"] for r in records) == stream.failed_groups >= 2  # ids 3, 11, (19)


def test_more_failed_groups_than_max_failed_frac_of_a_step_stop_the_run_naming_the_first(tmp_path):
    with pytest.raises(RolloutFailed, match=r"5 groups failed while a step of 4 was collected, more than "
                                            r"rollout.max_failed_frac=0.5 of them; first: group (\d+): RuntimeError: "
                                            r"sandbox \1 crashed"):
        run_failing(tmp_path, lambda gid: True)


def test_with_colocated_placement_the_weight_transfer_is_timed_as_sync_not_rollout(tmp_path):
    """Colocated placement moves the weights when it hands the devices back to the engines; that is sync time."""
    import time

    from glue.loop.colocation import Colocated

    engine = ScriptedEngine(0.0, 0)

    class SlowBridge(ScriptedBridge):
        def sync(self, version):
            time.sleep(0.3)
            super().sync(version)

    class Offloadable(ScriptedTrainer):
        def offload(self):
            return 0

        def onload(self):
            return 1

    trainer = Offloadable()
    phases = Colocated(trainer=trainer, bridge=SlowBridge(engine), engine_urls=[])
    gate = StalenessGate(groups_per_step=1, max_staleness=0)
    stream = RolloutStream(manager=ScriptedManager(engine), gate=gate, buffer=RolloutBuffer(groups_per_step=1),
                           max_groups=3)
    logger = MetricsLogger(tmp_path / "colocated.jsonl")
    parts = LoopParts(stream=stream, trainer=trainer, fleet=ScriptedFleet(), phases=phases, logger=logger)
    asyncio.run(run_loop(parts, num_steps=3, loss_cfg=LossConfig()))
    records = read_metrics(logger.path)
    assert all(r["time/sync_s"] >= 0.3 and r["time/rollout_s"] < 0.3 for r in records), records
    assert engine.version == 3
