"""Ctrl-C is bounded: the first signal's grace (run.stop_grace_s) running out cuts a step that waits on a hung group,
checkpointing the finished groups and the hung group's samples so far for a resume; the run's event loop closes with
no task left pending (no "Task was destroyed", "Event loop is closed"). The real-process runs are in
test_stop_grace_runs.py."""
import asyncio
import json
import os
import signal
import time

import pytest

from glue.loop.buffer import RolloutBuffer
from glue.loop.checkpoint import Checkpoints
from glue.loop.colocation import Disaggregated
from glue.loop.controller import LoopHooks, LoopParts, run_loop
from glue.loop.staleness import StalenessGate
from glue.loop.stream import RolloutStream
from glue.metrics.logger import MetricsLogger
from glue.rollout.manager import RolloutManager, score
from glue.types import Sample
from launch.config import RunConfig
from launch.run.stopping import StopSignals, cancel_tasks, close_loop
from loss import LossConfig
from helpers.managers import NumberedPrompts


class HungSecondGroupTask(NumberedPrompts):
    """Prompts [0, n], reward 1.0; the tool of group 1 never returns."""

    def reward(self, sample):
        return 1.0

    async def tool(self, group_id):
        if group_id == 1:
            await asyncio.Event().wait()


async def tracked_group(ctx, prompt, num_samples):
    samples = []
    for i in range(num_samples):
        sample = ctx.track(Sample(prompt_tokens=list(prompt["prompt_tokens"]), group_id=ctx.group_id, index=i))
        sample.append_response([5 + i, 6], [-0.5, -0.5], version=0)
        await score(ctx, sample)
        samples.append(sample)
    await ctx.task.tool(ctx.group_id)
    return samples


class Fleet:
    def __init__(self):
        self.calls = []

    def pause_generation(self, mode="retract"):
        self.calls.append(f"pause {mode}")

    def continue_generation(self):
        self.calls.append("continue")

    async def calls_settled(self):
        return True


class Trainer:
    version = 0

    def train_step(self, batch):
        raise AssertionError("the cut step must not train")

    def save_checkpoint(self, directory):
        with open(os.path.join(directory, "trainer.txt"), "w") as handle:
            handle.write("v0")


async def grace_over_after(seconds):
    await asyncio.sleep(seconds)


def test_a_stop_whose_grace_runs_out_cuts_the_step_and_checkpoints_what_its_groups_had(tmp_path, capsys):
    manager = RolloutManager(function_path="test_stop_grace:tracked_group",
                             task_path="test_stop_grace:HungSecondGroupTask", client=None, sampling_params={}, prompts_per_step=2, samples_per_prompt=2, seed=0)
    stream = RolloutStream(manager=manager, gate=StalenessGate(groups_per_step=2, max_staleness=0),
                           buffer=RolloutBuffer(groups_per_step=2), max_groups=4)
    fleet = Fleet()
    parts = LoopParts(stream=stream, trainer=Trainer(), fleet=fleet, phases=Disaggregated(None),
                      logger=MetricsLogger(tmp_path / "metrics.jsonl"), checkpoints=Checkpoints(tmp_path / "ckpt"),
                      hooks=LoopHooks(stop=lambda: True, stop_grace_over=lambda: grace_over_after(0.3)))
    started = time.monotonic()
    last = asyncio.run(run_loop(parts, num_steps=2, loss_cfg=LossConfig()))
    assert last == 0 and time.monotonic() - started < 5
    checkpoint = tmp_path / "ckpt" / "step_00000000"
    state = json.loads((checkpoint / "state.json").read_text())
    assert (checkpoint / "trainer.txt").read_text() == "v0"
    assert [e["group"]["group_id"] for e in state["finished"]] == [0]  # back in the buffer on resume
    assert state["reissue"] == [1] and state["groups_drawn"] == 2
    partial = {int(gid): [(d["index"], d["response_tokens"], d["reward"]) for d in samples]
               for gid, samples in state["partial"].items()}
    assert partial == {1: [(0, [5, 6], 1.0), (1, [6, 6], 1.0)]}  # the hung group's finished samples, kept
    assert fleet.calls == ["pause abort", "continue"]
    assert not stream._tasks, "the hung group is cancelled when the loop ends"
    assert capsys.readouterr().err.strip() == (
        f"sluice: checkpoint {checkpoint} (the last step trained): 1 finished groups kept whole, 1 still generating "
        "issued again on resume with 2 samples' tokens so far; the cut step is trained after the resume")


async def signal_then_grace(stop, sig) -> float:
    """Send `sig` to this process, then wait for `stop`'s grace; returns the seconds waited."""
    os.kill(os.getpid(), sig)
    await asyncio.sleep(0)
    sent = time.monotonic()
    await stop.grace_over()
    return time.monotonic() - sent


def test_sigterm_with_stop_grace_s_0_cuts_the_wait_at_once(capsys):
    # run.stop_grace_s: 0 is how a run under a short kill timer (ray job stop's 3 s) checkpoints at once
    with StopSignals(grace_s=0) as stop:
        stop.armed = True
        assert asyncio.run(signal_then_grace(stop, signal.SIGTERM)) < 1 and stop.requested == "SIGTERM" and stop.cut
        time.sleep(stop.LATE_S + 0.3)
    err = capsys.readouterr().err
    assert "SIGTERM: stopping after the step in progress, or in 0 s (run.stop_grace_s)" in err
    assert "has passed" not in err  # the wait was cut: nothing is still running past the grace


def test_a_step_still_training_when_the_grace_is_over_says_its_checkpoint_follows_it(capsys):
    with StopSignals(grace_s=0.1) as stop:
        stop.armed = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1 + stop.LATE_S + 0.5)  # the loop is in a train step: nobody awaits grace_over
        stop.stopping = True
    assert ("sluice: run.stop_grace_s=0.1 s has passed and the step in progress is training, syncing weights or "
            "writing its checkpoint, which is not cut: the checkpoint follows it") in capsys.readouterr().err


def test_the_first_signal_starts_the_grace_and_a_second_stops_at_once():
    with StopSignals(grace_s=0.3) as stop:
        stop.armed = True
        waited = asyncio.run(signal_then_grace(stop, signal.SIGINT))
        assert stop.requested == "SIGINT" and 0.2 <= waited < 3
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)


def test_closing_the_run_loop_unwinds_every_pending_task_first():
    loop = asyncio.new_event_loop()
    unwound = []

    async def hung(name):
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.01)  # a clean-up that itself awaits: needs the loop still open
            unwound.append(name)

    async def parent():
        child = asyncio.ensure_future(hung("child"))
        await asyncio.wait({child})

    tasks = [loop.create_task(hung("a")), loop.create_task(parent())]
    loop.run_until_complete(asyncio.sleep(0.05))
    close_loop(loop)
    assert loop.is_closed() and sorted(unwound) == ["a", "child"] and all(t.done() for t in tasks)


def test_cancel_tasks_gives_up_on_a_task_that_ignores_cancellation_after_its_timeout():
    loop = asyncio.new_event_loop()
    ignoring = [True]

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if not ignoring[0]:
                    raise

    task = loop.create_task(stubborn())
    loop.run_until_complete(asyncio.sleep(0))
    started = time.monotonic()
    cancel_tasks(loop, timeout_s=0.3)
    assert not task.done() and time.monotonic() - started < 3
    ignoring[0] = False  # let the test's own loop go cleanly
    task.cancel()
    loop.run_until_complete(asyncio.wait({task}))
    loop.close()


def test_stop_grace_s_defaults_to_30_s_and_is_checked():
    assert RunConfig().stop_grace_s == 30.0
    with pytest.raises(ValueError, match="run.stop_grace_s must be >= 0"):
        RunConfig(stop_grace_s=-1)


class RouterGoesFleet:
    """A fleet whose router exits once `gone` is set (as under `ray job stop`, which signals every process below
    the driver)."""

    name, engine_urls = "", []

    def __init__(self):
        self.gone = False

    def router_exit(self):
        return "router (http://127.0.0.1:1) exited with code 0; its log: runs/x/logs/router.log" if self.gone else None

    def exited(self):
        return [self.router_exit()] if self.gone else []

    def dead_engines(self):
        return []

    def restart_router(self):
        raise AssertionError("a router that exits after the stop was asked is not restarted")


def test_a_process_that_exits_after_a_stop_was_asked_does_not_end_the_run_before_its_checkpoint(capsys):
    from glue.fleet.fleet import ProcessDied
    from glue.fleet.watch import FleetWatch

    async def stop_then_checkpoint(fleet, stopping):
        stopping.append(True)
        fleet.gone = True  # the same SIGTERM reached the router
        await asyncio.sleep(0.5)  # the checkpoint, which needs the trainer, not the router
        return 7

    async def watched(stopping):
        fleet = RouterGoesFleet()
        watch = FleetWatch(fleet, repair=None, poll_s=0.05, health_interval_s=3600)
        return await watch.run(asyncio.ensure_future(stop_then_checkpoint(fleet, stopping)),
                               stopping=lambda: bool(stopping))

    assert asyncio.run(watched([])) == 7
    assert capsys.readouterr().err.strip() == (
        "sluice: router (http://127.0.0.1:1) exited with code 0; its log: runs/x/logs/router.log (after the stop was "
        "asked): not repaired; the stop goes on to its checkpoint")

    async def unasked():  # without a stop the router's exit ends the run, as before
        fleet = RouterGoesFleet()
        fleet.gone = True
        watch = FleetWatch(fleet, repair=None, poll_s=0.05, health_interval_s=3600)
        return await watch.run(asyncio.ensure_future(asyncio.sleep(5)))

    with pytest.raises(ProcessDied, match="router .* exited with code 0"):
        asyncio.run(unasked())
