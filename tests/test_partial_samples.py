"""Partial samples survive a restart: a checkpoint taken while a group generates keeps each sample's tokens so far
(generation paused with mode "abort" hands them back), and after a restart the group continues from them. On a
deterministic engine the continued group equals one that was never interrupted, token for token."""
import asyncio
import json

import pytest

from glue.fleet.engine_client import EngineClient
from glue.rollout.manager import RolloutManager

SAMPLING = {"max_new_tokens": 160, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(engine_processes, tiny_model_dir):
    return engine_processes.start_sglang_stand_in(tiny_model_dir, "--enable-deterministic-inference")


def manager(client: EngineClient) -> RolloutManager:
    return RolloutManager(function_path="rollout_fns.single_turn:generate_group",
                          task_path="rollout_fns.toy_tasks:EchoTask", client=client, sampling_params=SAMPLING,
                          prompts_per_step=1, samples_per_prompt=4, seed=5, deterministic=True)


def tokens(group) -> list:
    return [(s.response_tokens, s.rollout_logprobs, s.versions, s.status.value) for s in group.samples]


def test_a_group_checkpointed_mid_generation_continues_from_its_tokens_to_the_uninterrupted_result(engine):
    async def scenario():
        client = EngineClient(engine, [engine])
        started = asyncio.get_running_loop().time()
        uninterrupted = await manager(client).next_group()[1]
        took = asyncio.get_running_loop().time() - started

        interrupted = manager(client)
        task = asyncio.ensure_future(interrupted.next_group()[1])
        await asyncio.sleep(took / 4)
        await asyncio.to_thread(client.pause_generation, "abort")
        assert await client.calls_settled(timeout_s=30)
        snapshot = json.loads(json.dumps(interrupted.partial_samples([0])))  # as a checkpoint stores it
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(client.continue_generation)

        restarted = manager(client)
        restarted.resume(groups_drawn=1, reissue=[0], partial=snapshot)
        continued = await restarted.next_group()[1]
        await client.close()
        return uninterrupted, snapshot, continued

    uninterrupted, snapshot, continued = asyncio.run(scenario())
    held = [len(s["response_tokens"]) for s in snapshot["0"]]
    print("tokens held at the checkpoint:", held)
    assert len(held) == 4 and any(0 < n < 160 for n in held)  # caught part-way
    for saved, done in zip(snapshot["0"], uninterrupted.samples):
        assert saved["response_tokens"] == done.response_tokens[:len(saved["response_tokens"])]
    assert tokens(continued) == tokens(uninterrupted)
    assert [s.scalar_reward for s in continued.samples] == [s.scalar_reward for s in uninterrupted.samples]


def test_a_call_that_reaches_the_engine_after_its_pause_does_not_hold_up_the_settling(engine):
    """A generate started before the client's pause but reaching the engine only after the abort went through
    (still in the router) is held there until continue_generation. Here the engine is paused first by another
    client and the held call waits in its queue; the client's own pause (in_place, so it does not abort that
    queued call the way a real abort would have before the call arrived) makes it a call from before the pause.
    Waiting for such a call stalled every mid-run checkpoint of an async run for the full 60 s; now the settling
    ends once no call has come back for quiet_s, and the held call completes after continue."""
    async def scenario():
        client, other = EngineClient(engine, [engine]), EngineClient(engine, [engine])
        await asyncio.to_thread(other.pause_generation, "abort")
        held = asyncio.ensure_future(client.generate([0, 4, 5], {"max_new_tokens": 3, "temperature": 0.0}))
        await asyncio.sleep(0.5)  # it reached the paused engine and waits there
        await asyncio.to_thread(client.pause_generation, "in_place")
        loop = asyncio.get_running_loop()
        started = loop.time()
        settled = await client.calls_settled(timeout_s=30)  # quiet_s: 1 s
        waited = loop.time() - started
        assert not held.done()
        await asyncio.to_thread(client.continue_generation)
        answer = await asyncio.wait_for(held, timeout=30)
        await client.close()
        await other.close()
        return settled, waited, answer

    settled, waited, answer = asyncio.run(scenario())
    assert settled is False and 1.0 <= waited < 5
    assert len(answer["output_ids"]) == 3 and answer["meta_info"]["finish_reason"]["type"] == "length"
