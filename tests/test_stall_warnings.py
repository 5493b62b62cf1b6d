"""Hangs speak: a step that waits on groups longer than rollout.stall_warning_s says how many are outstanding, the
oldest one's age, the rollout function and task, and says it again each time the wait doubles. The real rollout
stream and manager run a rollout function whose tool sleeps."""
import asyncio
import re
import time

import pytest

from glue.loop.buffer import RolloutBuffer
from glue.loop.stall import StallWarnings
from glue.loop.staleness import StalenessGate
from glue.loop.stream import RolloutStream
from glue.rollout.config import RolloutConfig
from glue.rollout.manager import RolloutManager, score
from glue.types import Sample
from helpers.managers import NumberedPrompts


class SlowToolTask(NumberedPrompts):
    """Prompts [0, n], reward 1.0; its tool takes `tool_s` seconds."""

    def __init__(self, tool_s: float):
        self.tool_s = tool_s

    def reward(self, sample):
        return 1.0

    async def tool(self):
        await asyncio.sleep(self.tool_s)


async def slow_tool_group(ctx, prompt, num_samples):
    samples = []
    for i in range(num_samples):
        sample = Sample(prompt_tokens=list(prompt["prompt_tokens"]), group_id=ctx.group_id, index=i)
        sample.append_response([3, 4], [-0.5, -0.5], version=0)
        samples.append(sample)
    await ctx.task.tool()
    for sample in samples:
        await score(ctx, sample)
    return samples


def wait_for_one_step(tool_s: float, stall_warning_s: float) -> tuple[list[tuple[float, str]], int]:
    """Run a stream of two groups per step until its first step is ready; returns ((seconds, line) said, groups)."""
    said = []
    manager = RolloutManager(function_path="test_stall_warnings:slow_tool_group",
                             task_path="test_stall_warnings:SlowToolTask", task_args={"tool_s": tool_s}, client=None,
                             sampling_params={}, prompts_per_step=2, samples_per_prompt=2, seed=0)
    stalls = StallWarnings(after_s=stall_warning_s, group_timeout_s=600,
                           source="rollout function 'test_stall_warnings:slow_tool_group', task "
                                  "'test_stall_warnings:SlowToolTask'",
                           echo=lambda line: said.append((time.monotonic() - started, line)))
    stream = RolloutStream(manager=manager, gate=StalenessGate(groups_per_step=2, max_staleness=0),
                           buffer=RolloutBuffer(groups_per_step=2), max_groups=2, stalls=stalls)

    async def one_step():
        stream.start()
        try:
            groups, _ = await stream.next_batch()
            return len(groups)
        finally:
            await stream.stop()

    started = time.monotonic()
    return said, asyncio.run(one_step())


def test_a_step_waiting_on_a_slow_tool_says_what_it_waits_for_then_again_at_each_doubling():
    said, groups = wait_for_one_step(tool_s=1.3, stall_warning_s=0.2)
    assert groups == 2
    assert len(said) >= 3, said
    first = said[0][1]
    assert re.fullmatch(r"sluice: the step has waited 0\.\d s on groups: 2 outstanding, the oldest for 0\.\d s "
                        r"\(rollout function 'test_stall_warnings:slow_tool_group', task "
                        r"'test_stall_warnings:SlowToolTask'\); rollout\.group_timeout_s=600 cuts a group; next "
                        r"notice at 0\.4 s", first), first
    # backoff: the notices come after 0.2, 0.4, 0.8 s of waiting, each naming the next
    assert [re.search(r"next notice at ([\d.]+) s", line)[1] for _, line in said[:3]] == ["0.4", "0.8", "1.6"]
    assert [t >= bound for (t, _), bound in zip(said, [0.2, 0.4, 0.8])] == [True] * 3
    waited = [float(re.search(r"waited ([\d.]+) s", line)[1]) for _, line in said[:3]]
    oldest = [float(re.search(r"the oldest for ([\d.]+) s", line)[1]) for _, line in said[:3]]
    assert waited == sorted(waited) and all(o >= w - 0.1 for o, w in zip(oldest, waited)), said


def test_a_step_that_finishes_before_stall_warning_s_says_nothing():
    said, groups = wait_for_one_step(tool_s=0.05, stall_warning_s=2.0)
    assert groups == 2 and said == []


def test_the_group_timeout_defaults_to_600_s_and_a_stall_is_said_after_60_s():
    cfg = RolloutConfig()
    assert (cfg.group_timeout_s, cfg.stall_warning_s) == (600.0, 60.0)
    with pytest.raises(ValueError, match="rollout.stall_warning_s must be > 0"):
        RolloutConfig(stall_warning_s=0)
