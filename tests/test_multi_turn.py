"""The multi-turn rollout function: a tool agent over a real embedded engine (token-in-token-out, observation tokens
masked, spans over the tokens), error masking, the episode limits (turns, token budget, turn timeouts), and the
calculator environment, with scripted /generate answers where the turn's text must be chosen."""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from glue.loop.batch import rollout_metrics
from glue.rollout.config import RolloutConfig
from glue.fleet.engine_client import EngineClient
from glue.rollout.manager import RolloutContext, RolloutManager
from glue.types import Group, SampleStatus
from rollout_fns.arith_data import write_arith_jsonl
from rollout_fns.envs import StepResult
from rollout_fns.envs.calculator import CalcCall, evaluate, parse_call
from rollout_fns.multi_turn import EnvTask, EpisodeConfig, generate_group
from helpers.rollout import run


@pytest.fixture(scope="module")
def engine_url(engine_processes, text_model_dir):
    return engine_processes.start_sglang_stand_in(text_model_dir, "--num-threads", "1")


@pytest.fixture(scope="module")
def arith_path(tmp_path_factory) -> str:
    return write_arith_jsonl(tmp_path_factory.mktemp("arith") / "arith.jsonl", 8, seed=3)


def length_call(text: str) -> CalcCall:
    """A parse_action hook that turns any text into a tool call whose answer the test can predict."""
    return CalcCall("calc", f"{len(text)}*2")


class RecordingClient:
    """The real client, recording every request's input ids and the engine's answer."""

    def __init__(self, client):
        self.client, self.calls = client, []

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        answer = await self.client.generate(input_ids, sampling_params, return_logprob)
        self.calls.append((list(input_ids), dict(sampling_params), answer))
        return answer


class ScriptedModel:
    """Answers /generate in SGLang's shape with scripted turns (token ids), cut to max_new_tokens ("length") or
    ended on their last token ("stop"); records each request."""

    def __init__(self, turns: list[list[int]], delay_s: float = 0.0):
        self.turns, self.delay_s, self.requests = turns, delay_s, []

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.requests.append((list(input_ids), dict(sampling_params)))
        await asyncio.sleep(self.delay_s)
        ids = self.turns[min(len(self.requests), len(self.turns)) - 1]
        limit = sampling_params.get("max_new_tokens")
        finish = "length" if limit is not None and len(ids) > limit else "stop"
        ids = ids[:limit] if limit is not None else ids
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.25, t, None] for t in ids],
                                                  "finish_reason": {"type": finish}, "weight_version": "0"}}


class FlakyEnv:
    """Observes "ok <turn>" after a random latency, except that turn `fail_at` raises."""

    def __init__(self, fail_at: int | None = None, latency_s: float = 0.02, seed: int = 0):
        self.fail_at, self.latency_s, self.rng = fail_at, latency_s, random.Random(seed)
        self.closed = False

    async def reset(self, prompt):
        return None

    async def step(self, action):
        await asyncio.sleep(self.rng.uniform(0, self.latency_s))
        if action.turn == self.fail_at:
            raise RuntimeError("tool crashed")
        return f"ok {action.turn}", 0.5, False

    async def close(self):
        self.closed = True


class ProtocolTask:
    """A multi-turn task written against the protocol directly: no data set, one environment class."""

    def __init__(self, tokenizer, env_factory, **episode):
        self.tokenizer, self.env_factory, self.episode = tokenizer, env_factory, EpisodeConfig(**episode)
        self.envs = []

    def prompts(self, seed):
        while True:
            yield {"prompt_tokens": chat(self.tokenizer, "What is 2+3?"), "label": "5"}

    def make_env(self, prompt):
        self.envs.append(self.env_factory())
        return self.envs[-1]

    def reward(self, sample):
        return sum(sample.metadata["env_rewards"])


def chat(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def context(client, task, *, max_new_tokens=6, error_masking=False, group_id=0) -> RolloutContext:
    return RolloutContext(client=client, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0},
                          reward_fn=task.reward, group_id=group_id, task=task, error_masking=error_masking)


def spans(sample, role=None):
    return [t for t in sample.metadata["turns"] if role is None or t["role"] == role]


def assert_spans_tile_the_response(sample):
    ends = [0] + [t["end"] for t in spans(sample)]
    assert [t["start"] for t in spans(sample)] == ends[:-1], "spans must follow each other without gaps"
    assert ends[-1] == len(sample.response_tokens)
    for t in spans(sample):
        assert t["versions"] == sample.versions[t["start"]:t["end"]]
        if t["role"] != "assistant":
            assert sample.loss_mask[t["start"]:t["end"]] == [0] * (t["end"] - t["start"])
            assert sample.rollout_logprobs[t["start"]:t["end"]] == [0.0] * (t["end"] - t["start"])


# --- through a real engine -------------------------------------------------------------------------------------

def test_a_three_turn_calculator_agent_masks_observations_and_keeps_the_engine_tokens(engine_url, text_model_dir,
                                                                                     tokenizer, arith_path):
    task = EnvTask(env="rollout_fns.envs.calculator:CalculatorEnv", env_args={"latency_s": [0.0, 0.05], "seed": 1},
                   path=arith_path, tokenizer=text_model_dir, max_turns=3, parse_action="test_multi_turn:length_call")
    client = EngineClient(engine_url, [engine_url])
    recorder = RecordingClient(client)
    prompt = next(iter(task.prompts(seed=0)))
    samples = run(client, generate_group(context(recorder, task, group_id=3), prompt, 2))

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(text_model_dir, local_files_only=True)
    assert len(recorder.calls) == 6  # 2 episodes x max_turns, never more
    for s in samples:
        assert (s.status, s.metadata["stop_reason"]) == (SampleStatus.TRUNCATED, "max_turns")
        assert [t["role"] for t in spans(s)] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert_spans_tile_the_response(s)
        assert s.metadata["env_rewards"] == [0.0, 0.0, 0.0] and s.reward == 0.0
        assert s.metadata["label"] == prompt["label"]
        for turn in spans(s, "assistant"):
            a, b = turn["start"], turn["end"]
            # The request that produced this turn saw exactly prompt + the response before it, and its answer's
            # output ids are the turn's tokens, unchanged.
            answers = [c[2] for c in recorder.calls if c[0] == s.prompt_tokens + s.response_tokens[:a]]
            assert b > a and any(s.response_tokens[a:b] == answer["output_ids"] and s.rollout_logprobs[a:b] ==
                                 [e[0] for e in answer["meta_info"]["output_token_logprobs"]] for answer in answers)
            assert s.loss_mask[a:b] == [1] * (b - a) and s.versions[a:b] == [0] * (b - a)
        for turn, tool in zip(spans(s, "assistant"), spans(s, "tool")):
            text = tokenizer.decode(s.response_tokens[turn["start"]:turn["end"]], skip_special_tokens=True)
            observed = tokenizer.decode(s.response_tokens[tool["start"]:tool["end"]])
            assert observed.endswith(f"<|im_start|>tool\n{len(text) * 2}<|im_end|>\n<|im_start|>assistant\n")
        # The engine's logprobs are the model's on this very sequence: a teacher-forced forward agrees.
        ids = torch.tensor([s.prompt_tokens + s.response_tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(s.prompt_tokens) - 1:-1].float(), -1)
        expected = logp.gather(-1, torch.tensor(s.response_tokens)[:, None])[:, 0]
        trained = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(s.rollout_logprobs)[trained], expected[trained], atol=1e-4)


@pytest.mark.parametrize("error_masking", [True, False])
def test_error_masking_masks_exactly_the_failed_turn_and_trains_the_turns_around_it(engine_url, tokenizer,
                                                                                    error_masking):
    task = ProtocolTask(tokenizer, lambda: FlakyEnv(fail_at=1, seed=len(task.envs)), max_turns=3)
    client = EngineClient(engine_url, [engine_url])
    ctx = context(client, task, error_masking=error_masking)
    samples = run(client, generate_group(ctx, next(task.prompts(0)), 2))
    for s in samples:
        assistant, tool = spans(s, "assistant"), spans(s, "tool")
        assert [t["error"] for t in assistant] == [None, "environment raised RuntimeError: tool crashed", None]
        assert [t["masked"] for t in assistant] == [False, error_masking, False]
        for t in assistant:
            expected = 0 if (t["turn"] == 1 and error_masking) else 1
            assert s.loss_mask[t["start"]:t["end"]] == [expected] * (t["end"] - t["start"])
        assert_spans_tile_the_response(s)
        assert tokenizer.decode(s.response_tokens[tool[1]["start"]:tool[1]["end"]]).endswith(
            "<|im_start|>tool\nerror: RuntimeError: tool crashed<|im_end|>\n<|im_start|>assistant\n")
        assert "ok 0" in tokenizer.decode(s.response_tokens[tool[0]["start"]:tool[0]["end"]])
        assert (s.metadata["error_turns"], s.metadata["masked_error_turns"]) == (1, int(error_masking))
        assert s.metadata["env_rewards"] == [0.5, 0.0, 0.5] and s.reward == 1.0
    assert all(env.closed for env in task.envs) and len(task.envs) == 2
    metrics = rollout_metrics([Group(group_id=0, samples=samples)])
    assert metrics["rollout/masked_error_turns"] == (2.0 if error_masking else 0.0)
    assert metrics["rollout/error_turns"] == 2.0


# --- scripted answers: chosen turn texts -----------------------------------------------------------------------

def turn_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def calculator_task(text_model_dir, arith_path, **episode) -> EnvTask:
    return EnvTask(env="rollout_fns.envs.calculator:CalculatorEnv", path=arith_path, tokenizer=text_model_dir,
                   parse_action="rollout_fns.envs.calculator:parse_call", **episode)


def test_the_calculator_agent_calls_the_tool_recovers_from_a_tool_error_and_is_scored(text_model_dir, tokenizer,
                                                                                     arith_path):
    task = calculator_task(text_model_dir, arith_path, max_turns=5)
    prompt = dict(next(iter(task.prompts(seed=0))), label="42")
    model = ScriptedModel([turn_ids(tokenizer, "<calc>6*7</calc>"), turn_ids(tokenizer, "<calc>1/0</calc>"),
                           turn_ids(tokenizer, "So \\boxed{42}")])
    [s] = asyncio.run(generate_group(context(model, task, max_new_tokens=64, error_masking=True), prompt, 1))
    assert (s.status, s.metadata["stop_reason"], s.reward) == (SampleStatus.COMPLETED, "done", 1.0)
    assert [t["role"] for t in spans(s)] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [t["error"] for t in spans(s, "assistant")] == [None, "division by zero", None]
    assert_spans_tile_the_response(s)
    first, obs = spans(s)[0], spans(s)[1]
    # The model ended its turn with <|im_end|>, so the observation opens with the rest of the template's closing.
    assert tokenizer.decode(s.response_tokens[obs["start"]:obs["end"]]) == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert s.response_tokens[first["start"]:first["end"]] == model.turns[0]
    assert [len(inputs) for inputs, _ in model.requests] == [len(s.prompt_tokens) + t["start"]
                                                             for t in spans(s, "assistant")]
    assert s.loss_mask[spans(s)[2]["start"]:spans(s)[2]["end"]] == [0] * len(model.turns[1])  # the tool error, masked


def test_a_malformed_turn_is_an_error_turn_that_never_reaches_the_environment(text_model_dir, tokenizer, arith_path):
    task = calculator_task(text_model_dir, arith_path, max_turns=2)
    model = ScriptedModel([turn_ids(tokenizer, "hello")])
    envs = []
    factory = task.env_factory
    task.env_factory = lambda **kw: envs.append(factory(**kw)) or envs[-1]
    [s] = asyncio.run(generate_group(context(model, task, max_new_tokens=64), next(iter(task.prompts(seed=0))), 1))
    assert [t["error"] for t in spans(s, "assistant")] == ["malformed action: no <calc>EXPR</calc> tool call and no "
                                                           "\\boxed{} answer in the turn"] * 2
    assert envs[0].calls == 0 and s.metadata["error_turns"] == 2 and s.metadata["masked_error_turns"] == 0
    assert s.loss_mask[:spans(s)[0]["end"]] == [1] * spans(s)[0]["end"]  # error masking off: trained


def test_the_token_budget_shrinks_the_last_turn_and_drops_an_observation_that_does_not_fit(tokenizer):
    class TokenEnv(FlakyEnv):
        async def step(self, action):
            return StepResult(observation=[7, 7])

    task = ProtocolTask(None, TokenEnv, max_turns=5, max_total_tokens=16)
    model = ScriptedModel([[9] * 20])
    [s] = asyncio.run(generate_group(context(model, task, max_new_tokens=8), {"prompt_tokens": [1, 2]}, 1))
    assert [params["max_new_tokens"] for _, params in model.requests] == [8, 6]
    assert s.response_tokens == [9] * 8 + [7, 7] + [9] * 6 and s.loss_mask == [1] * 8 + [0, 0] + [1] * 6
    assert (s.status, s.metadata["stop_reason"]) == (SampleStatus.TRUNCATED, "max_total_tokens")


def test_a_slow_environment_step_fails_its_turn_and_the_episode_goes_on(tokenizer):
    class SlowAtFirst(FlakyEnv):
        async def step(self, action):
            await asyncio.sleep(5 if action.turn == 0 else 0)
            return StepResult(observation="fine", done=action.turn == 1, reward=1.0)

    task = ProtocolTask(tokenizer, SlowAtFirst, max_turns=4, turn_timeout_s=0.2)
    started = time.monotonic()
    [s] = asyncio.run(generate_group(context(ScriptedModel([turn_ids(tokenizer, "hi")]), task, error_masking=True),
                                     next(task.prompts(0)), 1))
    assert time.monotonic() - started < 3
    assert [t["error"] for t in spans(s, "assistant")] == ["environment step timed out after 0.2 s", None]
    assert [t["masked"] for t in spans(s, "assistant")] == [True, False]
    assert (s.metadata["stop_reason"], s.reward) == ("done", 1.0)


def test_a_generation_past_the_turn_timeout_ends_the_episode_with_what_it_had(tokenizer):
    class SlowSecondTurn(ScriptedModel):
        async def generate(self, input_ids, sampling_params, return_logprob=True):
            self.delay_s = 0 if not self.requests else 5
            return await super().generate(input_ids, sampling_params, return_logprob)

    task = ProtocolTask(tokenizer, FlakyEnv, max_turns=4, turn_timeout_s=0.2)
    started = time.monotonic()
    [s] = asyncio.run(generate_group(context(SlowSecondTurn([turn_ids(tokenizer, "hi")]), task),
                                     next(task.prompts(0)), 1))
    assert time.monotonic() - started < 3
    last = spans(s)[-1]
    assert (last["role"], last["start"], last["end"]) == ("assistant", len(s.response_tokens), len(s.response_tokens))
    assert last["error"] == "generation timed out after 0.2 s" and s.metadata["error_turns"] == 1
    assert (s.status, s.metadata["stop_reason"]) == (SampleStatus.TRUNCATED, "generation_timeout")
    assert_spans_tile_the_response(s)


def test_an_aborted_turn_is_continued_and_its_span_carries_both_versions(tokenizer):
    class AbortOnce:
        def __init__(self):
            self.requests = []

        async def generate(self, input_ids, sampling_params, return_logprob=True):
            self.requests.append(list(input_ids))
            aborted = len(self.requests) == 1
            ids = [5, 6] if aborted else [8, tokenizer.eos_token_id]
            return {"output_ids": ids, "meta_info": {
                "output_token_logprobs": [[-1.0, t, None] for t in ids], "weight_version": "0" if aborted else "1",
                "finish_reason": {"type": "abort" if aborted else "stop"}}}

    task = ProtocolTask(tokenizer, lambda: FlakyEnv(latency_s=0), max_turns=1)
    model = AbortOnce()
    [s] = asyncio.run(generate_group(context(model, task), {"prompt_tokens": [1, 2]}, 1))
    assert model.requests == [[1, 2], [1, 2, 5, 6]]
    assert spans(s)[0]["versions"] == [0, 0, 1, 1] and s.response_tokens == [5, 6, 8, tokenizer.eos_token_id]


# --- configuration and the manager -----------------------------------------------------------------------------

def test_the_rollout_manager_hands_the_task_and_error_masking_to_the_function(text_model_dir, tokenizer, arith_path):
    cfg = RolloutConfig(function="rollout_fns.multi_turn:generate_group", task="rollout_fns.multi_turn:EnvTask",
                        error_masking=True, task_args={
                            "env": "rollout_fns.envs.calculator:CalculatorEnv", "path": arith_path,
                            "tokenizer": text_model_dir, "max_turns": 2,
                            "parse_action": "rollout_fns.envs.calculator:parse_call"})
    manager = RolloutManager(function_path=cfg.function, task_path=cfg.task, task_args=cfg.task_args,
                             client=ScriptedModel([turn_ids(tokenizer, "no tool call here")]),
                             sampling_params={"max_new_tokens": 16}, prompts_per_step=2, samples_per_prompt=2, seed=0,
                             error_masking=cfg.error_masking)
    groups = asyncio.run(manager.generate_step())
    assert [g.error for g in groups] == [None, None]
    assert rollout_metrics(groups)["rollout/masked_error_turns"] == 8.0  # 2 groups x 2 samples x 2 malformed turns
    assert all(m == 0 for g in groups for s in g.samples for m in s.loss_mask)
    assert RolloutConfig().error_masking is False


def test_env_task_refuses_bad_settings_at_start_up(text_model_dir, arith_path):
    with pytest.raises(TypeError, match="cannot be built with env_args"):
        EnvTask(env="rollout_fns.envs.calculator:CalculatorEnv", env_args={"latency": 1}, path=arith_path,
                tokenizer=text_model_dir)
    with pytest.raises(ValueError, match="observation_role must be one of"):
        calculator_task(text_model_dir, arith_path, observation_role="system")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        calculator_task(text_model_dir, arith_path, max_turns=0)


def test_the_launcher_gives_env_task_the_models_tokenizer_when_task_args_name_none():
    from launch.run.tasks import task_args_for

    args = task_args_for("rollout_fns.multi_turn:EnvTask", {"env": "pkg:Env", "path": "d.jsonl"}, "/models/policy")
    assert args == {"env": "pkg:Env", "path": "d.jsonl", "tokenizer": "/models/policy"}


def test_a_task_without_make_env_fails_the_group_with_what_is_missing():
    ctx = RolloutContext(client=None, sampling_params={}, reward_fn=lambda s: 0.0, group_id=0, task=object())
    with pytest.raises(TypeError, match=r"lacks \['make_env', 'episode', 'tokenizer'\]"):
        asyncio.run(generate_group(ctx, {"prompt_tokens": [1]}, 1))


def test_the_calculator_evaluates_arithmetic_and_refuses_anything_else():
    assert [evaluate(e) for e in ("6*7", "2**10", "-(3+4)/2", "7//2 + 7 % 2")] == [42, 1024, -3.5, 4]
    for bad, message in [("1/0", "division by zero"), ("__import__('os')", "unsupported"), ("2**999", "exponent"),
                         ("1 +", "cannot parse")]:
        with pytest.raises(ValueError, match=message):
            evaluate(bad)
    assert parse_call("first <calc>1+1</calc> then \\boxed{2}") == CalcCall("answer", "2")
    assert parse_call("<calc> 3*3 </calc><calc>9</calc>") == CalcCall("calc", "3*3")


def test_multi_turn_modules_import_no_backend():
    code = ("import sys, rollout_fns.multi_turn, rollout_fns.envs.calculator; "
            "print(sorted(m for m in ('ray', 'sglang', 'megatron', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"


def test_a_turn_spanning_more_syncs_than_four_is_kept_and_one_past_the_resume_limit_is_given_up():
    """Issue 26 item 7 for agents: a turn's continuations follow the staleness bound (resume_limit), not a constant
    4; a turn still aborted at the limit ends the episode ABORTED, marked for rollout/resume_limit_drops."""
    from glue.rollout.manager import resume_limit
    from helpers.rollout import ScriptedAborts

    class OneTurnEnv(FlakyEnv):
        async def step(self, action):
            return StepResult(observation=None, reward=1.0, done=True)

    task = ProtocolTask(None, OneTurnEnv, max_turns=1)

    def episode(aborts: int, max_resumes: int):
        ctx = RolloutContext(client=ScriptedAborts(aborts), sampling_params={"max_new_tokens": 24},
                             reward_fn=task.reward, group_id=0, task=task, max_resumes=max_resumes)
        [sample] = asyncio.run(generate_group(ctx, {"prompt_tokens": [1, 2]}, 1))
        return sample

    kept = episode(aborts=6, max_resumes=resume_limit(6))
    assert kept.status is SampleStatus.COMPLETED and len(kept.response_tokens) == 24
    assert "resume_limit_hit" not in kept.metadata
    given_up = episode(aborts=100, max_resumes=2)
    assert given_up.status is SampleStatus.ABORTED and given_up.metadata["resume_limit_hit"] == 1
