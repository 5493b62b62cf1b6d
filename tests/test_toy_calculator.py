"""The token-level calculator task of the learning table (rollout_fns/envs/toy_calculator.py): its episodes through
the real multi-turn rollout function, with a scripted client in place of the engine (the task has no model to learn
here; `make learning-table` trains it for real)."""
from __future__ import annotations

import asyncio
from itertools import islice

import pytest

from glue.types import SampleStatus
from rollout_fns.envs import Action
from rollout_fns.envs.toy_calculator import ToyCalculatorTask
from rollout_fns.multi_turn import run_episode


class ScriptedContext:
    """The parts of RolloutContext an episode reads; /generate answers one scripted token per call."""

    def __init__(self, task: ToyCalculatorTask, tokens: list[int]):
        self.task, self.tokens = task, list(tokens)
        self.client, self.group_id, self.max_resumes, self.partial_rollouts = self, 0, 2, "resume"
        self.sampling_params, self.routed_experts, self.error_masking = {"max_new_tokens": 4}, None, False

    def sampling_for(self, index: int) -> dict:
        return dict(self.sampling_params)

    def routing_request(self, sample) -> dict:
        return {}

    async def generate(self, tokens: list[int], params: dict) -> dict:
        turn = self.tokens.pop(0)  # one scripted turn
        return {"output_ids": turn, "meta_info": {"output_token_logprobs": [[-1.0, t, None] for t in turn],
                                                  "finish_reason": {"type": "length"}, "weight_version": "0"}}

    @property
    def reward_fn(self):
        return self.task.reward


def episode(task: ToyCalculatorTask, prompt: dict, tokens: list[int]):
    return asyncio.run(run_episode(ScriptedContext(task, tokens), task, prompt, 0))


def test_calling_the_tool_then_copying_its_answer_earns_the_whole_reward():
    task = ToyCalculatorTask(latency_s=(0.0, 0.0))
    prompt = {"prompt_tokens": [0, 4 + 2, 4 + 3], "a": 2, "b": 3}
    sample = episode(task, prompt, [[3, 9, 9, 9], [13, 13, 13, 13]])  # the answer is (2 + 3) mod 4 = 1: token 13
    assert sample.response_tokens == [3, 9, 9, 9, 13, 13, 13, 13, 13]  # call turn, the tool's answer, the answer
    assert sample.loss_mask == [1, 1, 1, 1, 0, 1, 1, 1, 1]  # the observation is not trained on
    assert sample.reward == pytest.approx(0.2 + 0.8)
    assert sample.status is SampleStatus.COMPLETED


def test_answers_earn_the_answer_share_per_right_token_with_or_without_the_tool():
    task = ToyCalculatorTask(latency_s=(0.0, 0.0))
    prompt = {"prompt_tokens": [0, 4, 5], "a": 0, "b": 1}  # the answer is token 13
    assert episode(task, prompt, [[13, 13, 13, 13]]).reward == pytest.approx(0.8)
    assert episode(task, prompt, [[13, 14, 13, 1]]).reward == pytest.approx(0.8 * 2 / 4)
    assert episode(task, prompt, [[13]]).reward == pytest.approx(0.8 / 4)  # missing tokens count as misses
    assert episode(task, prompt, [[3], [3, 13, 14, 14]]).reward == pytest.approx(0.2 + 0.8 / 4)


def test_the_turn_after_a_call_is_the_answer_even_if_it_calls_again():
    task = ToyCalculatorTask(latency_s=(0.0, 0.0))
    sample = episode(task, {"prompt_tokens": [0, 4, 4], "a": 0, "b": 0}, [[3], [3, 3, 3, 3]])
    assert sample.reward == pytest.approx(0.2)
    assert sample.status is SampleStatus.COMPLETED and len(sample.metadata["env_rewards"]) == 2


def test_the_tool_waits_its_latency_and_prompts_follow_the_seed():
    task = ToyCalculatorTask(latency_s=(0.05, 0.05))
    env = task.make_env({"a": 1, "b": 1})
    asyncio.run(env.reset({"a": 1, "b": 1}))
    loop = asyncio.new_event_loop()
    started = loop.time()
    result = loop.run_until_complete(env.step(Action(turn=0, tokens=[3], text="")))
    assert loop.time() - started >= 0.05 and result.observation == [12 + 2]
    loop.close()
    first = list(islice(task.prompts(7), 5))
    assert first == list(islice(task.prompts(7), 5))
    assert all(p["prompt_tokens"] == [0, 4 + p["a"], 4 + p["b"]] for p in first)


def test_overlapping_token_ranges_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="call_id"):
        ToyCalculatorTask(call_id=5)
    with pytest.raises(ValueError, match="vocab_size"):
        ToyCalculatorTask(vocab_size=15)
