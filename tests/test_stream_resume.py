"""A resumed stream issues the groups that were generating again under the staleness bound they were admitted with
(issue 26 item 4): their tokens are as old as they were, so a fresh deadline from the resumed version would let
them train over-stale (stale_policy keep) or be dropped (drop)."""
import asyncio

from glue.loop.buffer import RolloutBuffer
from glue.loop.staleness import StalenessGate
from glue.loop.stream import RolloutStream
from helpers.managers import HangingGroups


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


def finished_group(group_id: int, version: int) -> dict:
    """A checkpoint's record of a finished group waiting in the buffer, its tokens of `version`."""
    from glue.types import Group, Sample

    samples = [Sample(prompt_tokens=[1], response_tokens=[2], loss_mask=[1], rollout_logprobs=[-0.5],
                      versions=[version], reward=float(i), group_id=group_id, index=i) for i in range(2)]
    return {"group": Group(group_id=group_id, samples=samples).to_dict(), "deadline": version + 3,
            "start_version": version}


def test_the_first_step_after_a_resume_waits_for_an_issued_again_group_that_is_due_before_the_finished_ones():
    """Issue 26 item 12 (found by `make chaos`: a group of version-9 tokens trained at trainer version 12 under
    max_staleness 2). The first next_batch after a resume chose among the finished groups before the producer had
    issued the in-flight ones again, so their deadlines were not yet in the buffer and a later-due finished group
    took the place of one due now, which then trained over-stale. Group 0 (admitted at version 2, due by 5) is
    still generating at the checkpoint (version 5); finished group 1 is due by 8: step 6 must wait for group 0."""
    async def scenario():
        stream = stream_at(version=0)
        state = {"groups_drawn": 2, "finished": [finished_group(1, version=5)], "reissue": [0],
                 "admitted": {"0": [5, 2]}, "partial": {}}
        stream.resume(state, version=5, trained_groups=0)
        stream.start()  # as run_loop does: the first next_batch right after start, in the same task
        try:
            async with asyncio.timeout(0.2):  # not wait_for: its task would let the producer run first
                taken = [g.group_id for g in (await stream.next_batch())[0]]
        except TimeoutError:
            taken = None
        await stream.stop()
        return taken, [(e.group_id, e.deadline) for e in stream.buffer.in_flight]

    taken, in_flight = asyncio.run(scenario())
    assert taken is None, f"step 6 took group {taken} while group 0, due by step 6, was still generating"
    assert in_flight == [(0, 5)]
