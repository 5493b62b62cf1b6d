"""A resumed stream issues the groups that were generating again under the staleness bound they were admitted with
(issue 26 item 4): their tokens are as old as they were, so a fresh deadline from the resumed version would let
them train over-stale (stale_policy keep) or be dropped (drop)."""
import asyncio

from glue.buffer import RolloutBuffer
from glue.staleness import StalenessGate
from glue.stream import RolloutStream


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

    def partial_samples(self, ids):
        return {}

    def resume(self, groups_drawn, reissue, partial):
        self.groups_drawn, self._reissue = groups_drawn, list(reissue)


def stream_at(version: int) -> RolloutStream:
    gate = StalenessGate(groups_per_step=1, max_staleness=3)
    gate.v_train = gate.v_engine = version
    return RolloutStream(manager=HangingGroups(), gate=gate, buffer=RolloutBuffer(groups_per_step=1), max_groups=8,
                         max_concurrent=1)


def test_a_group_issued_again_after_a_resume_keeps_the_deadline_and_start_version_it_was_admitted_with():
    async def scenario():
        before = stream_at(version=2)  # group 0 admitted at engine version 2: deadline 2 + 3 = 5
        before.start()
        await asyncio.sleep(0.05)
        assert [(e.group_id, e.deadline, e.start_version) for e in before.buffer.in_flight] == [(0, 5, 2)]
        state = before.resume_state()
        await before.stop()
        after = stream_at(version=0)
        after.resume(state, version=4, trained_groups=4)  # the checkpoint: two steps later, same group in flight
        after.start()
        await asyncio.sleep(0.05)
        entries = [(e.group_id, e.deadline, e.start_version) for e in after.buffer.in_flight]
        await after.stop()
        return entries

    assert asyncio.run(scenario()) == [(0, 5, 2)]  # not (0, 7, 4): a fresh bound from the resumed version
