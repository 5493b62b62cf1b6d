"""Partial samples survive a restart: a checkpoint taken while a group generates keeps each sample's tokens so far
(generation paused with mode "abort" hands them back), and after a restart the group continues from them. On a
deterministic engine the continued group equals one that was never interrupted, token for token."""
import asyncio
import json

import pytest

from glue.engine_client import EngineClient
from glue.rollout import RolloutManager

SAMPLING = {"max_new_tokens": 160, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(engine_processes, tiny_model_dir):
    return engine_processes.start(tiny_model_dir, "--enable-deterministic-inference")


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
