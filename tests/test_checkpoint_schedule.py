"""When checkpoints are written (glue.loop.checkpoint.Checkpoints.due): every run.save_interval steps, and at the first
step boundary run.save_interval_s seconds after the last checkpoint, so a kill loses a bounded stretch of training
whatever a step takes; checked by the decision function with a clock of its own and by the loop itself. A requested
stop goes from the train step straight to its checkpoint, without the weight sync."""
import asyncio

import pytest

from glue.loop.buffer import RolloutBuffer
from glue.loop.checkpoint import Checkpoints
from glue.loop.colocation import Disaggregated
from glue.loop.controller import LoopHooks, LoopParts, run_loop
from glue.loop.staleness import StalenessGate
from glue.loop.stream import RolloutStream
from glue.metrics.logger import MetricsLogger
from glue.rollout.manager import RolloutManager
from launch.config import RunConfig
from loss import LossConfig


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_checkpoint_is_due_once_save_interval_s_has_passed_since_the_last_one(tmp_path):
    clock = Clock()
    checkpoints = Checkpoints(tmp_path, interval=50, interval_s=1800, clock=clock)
    clock.now = 1799.0
    assert not checkpoints.due(7, last=False)
    clock.now = 1800.0
    assert checkpoints.due(7, last=False)
    checkpoints.save(7, lambda folder: None, {})
    clock.now = 3000.0  # 1,200 s after the checkpoint at 1,800 s
    assert not checkpoints.due(8, last=False)
    assert checkpoints.due(50, last=False) and checkpoints.due(9, last=True)  # the step schedule and the end stay
    for off in (0, None):
        clock.now = 10**6
        assert not Checkpoints(tmp_path, interval=50, interval_s=off, clock=clock).due(7, last=False)


def test_save_interval_s_defaults_to_half_an_hour_and_is_checked():
    assert RunConfig().save_interval_s == 1800.0
    assert RunConfig(save_interval_s=None).save_interval_s is None
    with pytest.raises(ValueError, match="run.save_interval_s must be >= 0 seconds"):
        RunConfig(save_interval_s=-1)


class SlowTrainer:
    """Each train step takes 700 s of the checkpoints' clock."""

    def __init__(self, clock):
        self.clock, self.version = clock, 0

    def train_step(self, batch):
        self.clock.now += 700
        self.version += 1
        return {"train/loss": 0.0}

    def save_checkpoint(self, directory):
        pass


class Bridge:
    def __init__(self):
        self.synced = []

    def sync(self, version):
        self.synced.append(version)


class Fleet:
    def pause_generation(self, mode="retract"):
        pass

    def continue_generation(self):
        pass

    async def calls_settled(self):
        return True


def loop_parts(tmp_path, clock, bridge, **hooks):
    manager = RolloutManager(function_path="helpers.managers:two_token_group",
                             task_path="helpers.managers:RewardOne", client=None, sampling_params={},
                             prompts_per_step=1, samples_per_prompt=2, seed=0)
    stream = RolloutStream(manager=manager, gate=StalenessGate(groups_per_step=1, max_staleness=0),
                           buffer=RolloutBuffer(groups_per_step=1, stale_policy="keep"), max_groups=6)
    checkpoints = Checkpoints(tmp_path / "ckpt", keep=10, interval=50, interval_s=1800, clock=clock)
    return LoopParts(stream=stream, trainer=SlowTrainer(clock), fleet=Fleet(), phases=Disaggregated(bridge),
                     logger=MetricsLogger(tmp_path / "metrics.jsonl"), checkpoints=checkpoints,
                     hooks=LoopHooks(**hooks))


def test_the_loop_checkpoints_on_the_clock_between_the_step_schedule(tmp_path):
    # steps of 700 s, run.save_interval 50 never reached in 6 steps, run.save_interval_s 1800: a checkpoint after
    # step 3 (2,100 s) and step 6 (the last; 2,100 s after the one before)
    parts = loop_parts(tmp_path, Clock(), Bridge())
    assert asyncio.run(run_loop(parts, num_steps=6, loss_cfg=LossConfig())) == 6
    assert [p.name for p in parts.checkpoints.all()] == ["step_00000003", "step_00000006"]


def test_a_requested_stop_goes_from_the_train_step_straight_to_its_checkpoint_without_a_weight_sync(tmp_path):
    bridge, asked = Bridge(), []
    parts = loop_parts(tmp_path, Clock(), bridge, stop=lambda: len(asked) > 0)
    parts.trainer.train_step = lambda batch, train=parts.trainer.train_step: (asked.append(1), train(batch))[1]
    assert asyncio.run(run_loop(parts, num_steps=6, loss_cfg=LossConfig())) == 1
    assert bridge.synced == []  # the engines are not brought to version 1: a resume does that
    assert [p.name for p in parts.checkpoints.all()] == ["step_00000001"]
