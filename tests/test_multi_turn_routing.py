"""MoE routing replay (R3) in the multi-turn rollout: an embedded engine serving a tiny Qwen3-MoE runs episodes with
environment turns, and each sample's routing is checked against the HF model's own top-k over its whole token
sequence, tool tokens included. Doubles speaking SGLang's answer shape check a turn restarted after an abort and an
episode cut off before its last observation was run. The OpenAI-agent path refuses routing replay."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from glue.fleet.engine_client import EngineClient
from glue.rollout.manager import RolloutContext
from glue.rollout.routed_experts import RoutedExpertsLayout
from glue.types import SampleStatus
from rollout_fns.multi_turn import EpisodeConfig, generate_group
from helpers.cli import one_line_error
from helpers.routing import LAYOUT, reference_routing, rows, wire

OBSERVATION = [9, 10, 11]  # the token ids every environment step answers with


@pytest.fixture(scope="module")
def engine_url(engine_processes, tiny_moe_model_dir):
    return engine_processes.start_sglang_stand_in(tiny_moe_model_dir, "--num-threads", "1", "--enable-return-routed-experts")


@pytest.fixture(scope="module")
def hf_model(tiny_moe_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).eval()


class TokenEnv:
    """Answers every turn with OBSERVATION (token ids, so no tokenizer is needed) and reward 1; never done."""

    async def reset(self, prompt):
        return None

    async def step(self, action):
        return list(OBSERVATION), 1.0, False


class TokenTask:
    """A multi-turn task without a tokenizer: one prompt of token ids, a TokenEnv per episode."""

    tokenizer = None

    def __init__(self, **episode):
        self.episode = EpisodeConfig(**episode)

    def prompts(self, seed):
        while True:
            yield {"prompt_tokens": [0, 4, 5, 6, 7]}

    def make_env(self, prompt):
        return TokenEnv()

    def reward(self, sample):
        return sum(sample.metadata["env_rewards"])


class StartLenRecorder:
    """The real client, recording each request's (input length, routed_experts_start_len)."""

    def __init__(self, client):
        self.client, self.requests = client, []

    async def generate(self, input_ids, sampling_params, return_logprob=True, **routing):
        self.requests.append((len(input_ids), routing.get("routed_experts_start_len")))
        return await self.client.generate(input_ids, sampling_params, return_logprob, **routing)


def context(client, task, layout, *, max_new_tokens: int, partial_rollouts: str = "resume") -> RolloutContext:
    return RolloutContext(client=client, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                                          "ignore_eos": True},
                          reward_fn=task.reward, group_id=0, task=task, routed_experts=layout,
                          partial_rollouts=partial_rollouts)


def test_a_multi_turn_samples_routing_covers_every_position_and_equals_the_models_own_top_k(engine_url, hf_model,
                                                                                            tiny_moe_model_dir):
    layout = RoutedExpertsLayout.from_model_dir(tiny_moe_model_dir)
    engine = EngineClient(engine_url, [engine_url])
    client, task = StartLenRecorder(engine), TokenTask(max_turns=3)
    prompt = next(task.prompts(0))

    async def run():
        try:
            return await generate_group(context(client, task, layout, max_new_tokens=4), prompt, 2)
        finally:
            await engine.aclose()

    samples = asyncio.run(run())
    for s in samples:
        tokens = s.prompt_tokens + s.response_tokens
        assert s.routed_experts is not None, "return_routed_experts is on: the sample must carry routing"
        assert s.routed_experts.shape == (len(tokens) - 1, 2, 2)  # 5 + 3 turns of 4 + 2 observations of 3
        assert len(tokens) == 5 + 3 * 4 + 2 * 3 and s.status is SampleStatus.TRUNCATED
        assert [t["role"] for t in s.metadata["turns"]] == ["assistant", "tool"] * 2 + ["assistant"]
        np.testing.assert_array_equal(s.routed_experts, reference_routing(hf_model, tokens))
        s.validate()
    # a later turn asks from the previous turn's last token (never run) on: the observation is routed once
    assert sorted(client.requests) == [(5, 0), (5, 0), (12, 8), (12, 8), (19, 15), (19, 15)]


class ScriptedRoutingModel:
    """Answers /generate in SGLang's shape, routing included (row p encodes position p, `rows`): each request takes
    the next (number of tokens, finish type) of `script`; "hang" never answers."""

    def __init__(self, script: list):
        self.script, self.start_lens = script, []

    async def generate(self, input_ids, sampling_params, return_logprob=True, routed_experts_start_len=None):
        self.start_lens.append(routed_experts_start_len)
        step = self.script[len(self.start_lens) - 1]
        if step == "hang":
            await asyncio.sleep(30)
        n, kind = step
        ids = list(range(20, 20 + n))
        start = routed_experts_start_len
        return {"output_ids": ids, "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in ids], "finish_reason": {"type": kind},
            "weight_version": "0", "routed_experts": wire(rows(start, len(input_ids) + n - 1 - start))}}


def test_a_turn_restarted_after_an_abort_keeps_the_observations_routing_and_asks_from_where_it_was_cut():
    model = ScriptedRoutingModel([(2, "length"), (1, "abort"), (2, "length")])
    task = TokenTask(max_turns=2)
    [s] = asyncio.run(generate_group(context(model, task, LAYOUT, max_new_tokens=2, partial_rollouts="restart"),
                                     {"prompt_tokens": [1, 2]}, 1))
    # turn 1: positions 0..2; the aborted request ran 3..6 (observation and its token), cut back to 3..5
    assert model.start_lens == [0, 3, 6] and s.metadata["discarded_tokens"] == 1
    assert len(s.prompt_tokens + s.response_tokens) == 2 + 2 + 3 + 2
    np.testing.assert_array_equal(s.routed_experts, np.array(rows(0, 8)))
    s.validate()


def test_an_episode_cut_off_before_its_last_observation_was_run_fills_those_positions_with_minus_one():
    model = ScriptedRoutingModel([(2, "length"), "hang"])
    task = TokenTask(max_turns=3, turn_timeout_s=0.2)
    [s] = asyncio.run(generate_group(context(model, task, LAYOUT, max_new_tokens=2), {"prompt_tokens": [1, 2]}, 1))
    assert s.metadata["stop_reason"] == "generation_timeout" and s.response_tokens == [20, 21, *OBSERVATION]
    assert s.routed_experts.shape == (6, 2, 2) and s.routed_experts.dtype == np.int8
    np.testing.assert_array_equal(s.routed_experts[:3], np.array(rows(0, 3)))  # what turn 1's request ran
    assert (s.routed_experts[3:] == -1).all()  # turn 1's last token and the observation: no request ran them
    s.validate()


def test_the_openai_agent_path_refuses_routing_replay_at_start_up_and_in_the_rollout(capsys):
    line = one_line_error(capsys, ["rollout.function=rollout_fns.openai_agent:generate_group",
                                   "rollout.return_routed_experts=true", "model.tiny.family=qwen3_moe"])
    assert "rollout_fns.openai_agent cannot record MoE routing" in line
    from rollout_fns.openai_agent import generate_group as agent_group

    ctx = RolloutContext(client=None, sampling_params={}, reward_fn=lambda s: 0.0, group_id=0, routed_experts=LAYOUT)
    with pytest.raises(ValueError, match="cannot record MoE routing"):
        asyncio.run(agent_group(ctx, {"prompt_tokens": [1], "agent": "unused:agent"}, 1))
