"""Rollout-manager doubles the loop's tests drive: scripted groups on a scripted engine, groups that never finish,
and the checkpoint half of the stream's `GroupSource` for managers whose runs never take a checkpoint."""
from __future__ import annotations

import asyncio

from glue.types import Group, Sample


class NumberedPrompts:
    """A task's prompt half: prompts [0, 1], [0, 2], ... for ever (whatever the seed)."""

    def prompts(self, seed):
        n = 0
        while True:
            n += 1
            yield {"prompt_tokens": [0, n]}


class RewardOne(NumberedPrompts):
    """NumberedPrompts whose every sample scores 1.0."""

    def reward(self, sample):
        return 1.0


async def two_token_group(ctx, prompt, num_samples):
    """A rollout function (`helpers.managers:two_token_group`): each sample answers two tokens at version 0, scored
    by the task."""
    from glue.rollout.manager import score

    samples = []
    for i in range(num_samples):
        sample = Sample(prompt_tokens=list(prompt["prompt_tokens"]), group_id=ctx.group_id, index=i)
        sample.append_response([5 + i, 6], [-0.5, -0.5], version=0)
        await score(ctx, sample)
        samples.append(sample)
    return samples


class NeverCheckpointed:
    """The checkpoint half of the stream's `GroupSource`, for test managers whose runs never take a checkpoint."""

    groups_drawn, partial_rollouts = 0, "restart"

    def partial_samples(self, group_ids):
        return {}

    def resume(self, groups_drawn, reissue, partial=None):
        raise AssertionError("this test manager is never resumed")


class ScriptedManager(NeverCheckpointed):
    def __init__(self, engine, tokens=3):
        self.engine, self.tokens, self.next_id = engine, tokens, 0

    def next_group(self):
        gid, self.next_id = self.next_id, self.next_id + 1
        return gid, self._generate(gid)

    async def _generate(self, gid):
        samples = [Sample(prompt_tokens=[0, 1], group_id=gid, index=i) for i in range(2)]
        slow = 8 if self.engine.rng.random() < 0.2 else 1  # a straggler now and then, to tempt overtaking
        for _ in range(self.tokens):
            await asyncio.sleep(slow * self.engine.rng.uniform(0, self.engine.latency))
            for s in samples:
                s.append_response([2], [-1.0], self.engine.version)
        for i, s in enumerate(samples):
            s.reward = float(i)
        return Group(group_id=gid, samples=samples)


class HangingGroups:
    """A rollout manager whose groups never finish (they are still generating when the checkpoint is taken)."""

    partial_rollouts = "resume"

    def __init__(self):
        self.groups_drawn, self._reissue = 0, []

    def next_group(self):
        if self._reissue:
            group_id = self._reissue.pop(0)
        else:
            group_id, self.groups_drawn = self.groups_drawn, self.groups_drawn + 1
        return group_id, asyncio.Event().wait()

    def partial_samples(self, group_ids):
        return {}

    def resume(self, groups_drawn, reissue, partial):
        self.groups_drawn, self._reissue = groups_drawn, list(reissue)
