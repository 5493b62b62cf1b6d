"""The rollout path over a real embedded engine: the single-turn function, the rollout manager's validation,
and the toy task's reward formula."""
from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from glue.fleet.engine_client import EngineClient
from glue.rollout.manager import RolloutContext, RolloutManager, score
from glue.types import Sample, SampleStatus
from rollout_fns.single_turn import generate_group, generate_one
from rollout_fns.toy_tasks import EchoTask
from helpers.rollout import ScriptedAborts, run


class NanTask:
    """A task whose verifier is broken for one sample of each group."""

    def prompts(self, seed):
        while True:
            yield {"prompt_tokens": [0, 4, 5]}

    def reward(self, sample):
        return float("nan") if sample.index == 2 else 0.0


class CountingClient:
    """The real client, counting generate calls (a resumed generation is a second call)."""

    def __init__(self, client: EngineClient):
        self.client, self.calls = client, 0

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.calls += 1
        return await self.client.generate(input_ids, sampling_params, return_logprob)


async def returns_a_dict(ctx, prompt, num_samples):
    return {"samples": []}


@pytest.fixture(scope="module")
def engine_url(engine_processes, tiny_model_dir):
    return engine_processes.start_sglang_stand_in(tiny_model_dir, "--num-threads", "1")


def post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()


def test_single_turn_fills_tokens_logprobs_versions_status_and_the_task_reward(engine_url, tiny_model_dir):
    task = EchoTask(k=4)
    client = EngineClient(engine_url, [engine_url])
    ctx = RolloutContext(client=client, sampling_params={"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
                         reward_fn=task.reward, group_id=7)
    prompt = {"prompt_tokens": [0, 5, 6, 7], "target": 7}
    samples = run(client, generate_group(ctx, prompt, 4))

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for i, s in enumerate(samples):
        assert (s.group_id, s.index, s.metadata) == (7, i, {"target": 7})
        assert len(s.response_tokens) == 6 and s.status is SampleStatus.TRUNCATED
        assert s.versions == [0] * 6 and s.loss_mask == [1] * 6
        hits = sum(t == 7 for t in s.response_tokens[:4])
        assert s.reward == hits / 4 and 0.0 <= s.reward <= 1.0
        # The rollout logprobs are the model's: a teacher-forced forward gives the same numbers.
        ids = torch.tensor([s.prompt_tokens + s.response_tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, 3:-1].float(), -1)
        expected = logp.gather(-1, torch.tensor(s.response_tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.rollout_logprobs), expected, atol=1e-4)


def test_a_generation_aborted_by_a_pause_resumes_and_carries_both_weight_versions(engine_url):
    N = 1000
    client = EngineClient(engine_url, [engine_url])
    counting = CountingClient(client)
    ctx = RolloutContext(client=counting, sampling_params={"max_new_tokens": N, "temperature": 1.0, "ignore_eos": True},
                         reward_fn=lambda s: 0.0, group_id=0)

    def running() -> int:  # SGLang's /get_server_info internal state: requests being decoded
        info = json.loads(urllib.request.urlopen(f"{engine_url}/get_server_info").read())
        return info["internal_states"][0]["num_running_reqs"]

    initial = json.loads(urllib.request.urlopen(f"{engine_url}/model_info").read())["weight_version"]

    async def scenario():
        task = asyncio.ensure_future(generate_one(ctx, {"prompt_tokens": [0, 4]}, 0))
        while not task.done() and not running():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # abort once tokens are flowing
        await asyncio.to_thread(client.pause_generation, "abort")
        await asyncio.to_thread(post, f"{engine_url}/update_weight_version",
                                {"new_version": "1", "abort_all_requests": False})
        await asyncio.to_thread(client.continue_generation)
        return await task

    sample = run(client, scenario())
    assert len(sample.response_tokens) == N and sample.status is SampleStatus.TRUNCATED
    assert counting.calls == 2  # aborted once, then continued from prompt + partial response
    assert 1 in sample.versions, "the abort came too late to split the response; the test needs a longer generation"
    first_new = sample.versions.index(1)
    assert 0 < first_new < N
    assert sample.versions == [0] * first_new + [1] * (N - first_new)
    post(f"{engine_url}/update_weight_version", {"new_version": initial, "abort_all_requests": False})


@pytest.mark.parametrize("mode", ["resume", "restart"])
def test_an_aborted_generation_resumes_or_restarts_per_the_partial_rollout_setting(mode):
    client = ScriptedAborts(aborts=2)
    ctx = RolloutContext(client=client, sampling_params={"max_new_tokens": 8}, reward_fn=lambda s: 0.0, group_id=0,
                         partial_rollouts=mode)
    sample = asyncio.run(generate_one(ctx, {"prompt_tokens": [0, 4]}, 0))
    assert sample.status is SampleStatus.TRUNCATED and len(sample.response_tokens) == 8
    if mode == "resume":  # prompt + tokens so far, three versions in one sample
        assert client.inputs == [[0, 4], [0, 4, 7, 7, 7], [0, 4, 7, 7, 7, 7, 7, 7]]
        assert sample.versions == [0, 0, 0, 1, 1, 1, 2, 2]
    else:  # the interruption route ([W1]): every try starts from the prompt; one version per sample
        assert client.inputs == [[0, 4]] * 3
        assert sample.versions == [2] * 8 and sample.metadata["discarded_tokens"] == 6


def test_a_generation_spanning_more_syncs_than_four_is_kept_when_the_staleness_limit_allows_them():
    """Issue 26 item 7: a fixed limit of 4 continuations dropped exactly the longest answers of a run with
    max_staleness > 4; the limit follows the staleness bound (resume_limit: 2 x (max_staleness + 1))."""
    from glue.rollout.manager import resume_limit

    client = ScriptedAborts(aborts=6)  # six syncs' pauses while it generates: fine under max_staleness 6
    ctx = RolloutContext(client=client, sampling_params={"max_new_tokens": 24}, reward_fn=lambda s: 0.0, group_id=0,
                         max_resumes=resume_limit(6))
    sample = asyncio.run(generate_one(ctx, {"prompt_tokens": [0, 4]}, 0))
    assert sample.status is SampleStatus.TRUNCATED and len(sample.response_tokens) == 24
    assert sample.versions == [v for v in range(6) for _ in range(3)] + [6] * 6
    assert "resume_limit_hit" not in sample.metadata


def test_a_generation_past_the_resume_limit_is_given_up_and_counted_in_a_metric():
    from glue.loop.buffer import RolloutBuffer
    from glue.loop.staleness import StalenessGate
    from glue.loop.stream import RolloutStream
    from glue.types import Group

    client = ScriptedAborts(aborts=100)
    ctx = RolloutContext(client=client, sampling_params={"max_new_tokens": 24}, reward_fn=lambda s: 0.0, group_id=0,
                         max_resumes=2)
    sample = asyncio.run(generate_one(ctx, {"prompt_tokens": [0, 4]}, 0))
    assert len(client.inputs) == 3 and sample.status is SampleStatus.ABORTED
    assert sample.metadata["resume_limit_hit"] == 1
    stream = RolloutStream(manager=None, gate=StalenessGate(groups_per_step=1, max_staleness=1),
                           buffer=RolloutBuffer(groups_per_step=1), max_groups=4)
    stream.buffer.started(0, deadline=1, start_version=0)
    stream.gate.admit()
    stream._accept(Group(group_id=0, samples=[sample]))
    assert stream.metrics(1.0)["rollout/resume_limit_drops"] == 1.0
    assert stream.metrics(1.0)["rollout/resume_limit_drops"] == 0.0  # per step


def test_an_answer_without_per_token_spans_is_stamped_with_its_one_version_and_counted():
    """Issue 26 item 8: the single-version fallback of append_generation is visible (rollout/single_version_answers);
    an answer with spans is not counted; one with neither says what is missing."""
    from glue.loop.batch import rollout_metrics
    from glue.rollout.manager import append_generation
    from glue.types import Group

    def answer(**meta):
        return {"output_ids": [7, 8, 9], "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in (7, 8, 9)],
                                                        "finish_reason": {"type": "stop"}, **meta}}

    one, spanned = Sample(prompt_tokens=[1], group_id=0, index=0), Sample(prompt_tokens=[1], group_id=0, index=1)
    one.reward = spanned.reward = 0.0
    append_generation(one, answer(weight_version="3"))
    append_generation(spanned, answer(weight_version="4", weight_versions=[
        {"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]))
    assert one.versions == [3, 3, 3] and one.metadata["single_version_answers"] == 1
    assert spanned.versions == [3, 4, 4] and "single_version_answers" not in spanned.metadata
    assert rollout_metrics([Group(group_id=0, samples=[one, spanned])])["rollout/single_version_answers"] == 1.0
    with pytest.raises(ValueError, match="no meta_info.weight_version"):
        append_generation(Sample(prompt_tokens=[1], group_id=0, index=2), answer())


def test_rollout_manager_runs_every_group_with_consecutive_ids_and_validated_samples(engine_url):
    client = EngineClient(engine_url, [engine_url])
    manager = RolloutManager(function_path="rollout_fns.single_turn:generate_group",
                             task_path="rollout_fns.toy_tasks:EchoTask", task_args={"k": 2}, client=client,
                             sampling_params={"max_new_tokens": 3, "temperature": 1.0}, prompts_per_step=3,
                             samples_per_prompt=4, seed=11)

    async def two_steps():
        try:
            return await manager.generate_step(), await manager.generate_step()
        finally:
            await client.aclose()

    first, second = asyncio.run(two_steps())
    assert [g.group_id for g in first + second] == [0, 1, 2, 3, 4, 5]
    expected_prompts = list(itertools.islice(EchoTask(k=2).prompts(11), 6))
    for group, prompt in zip(first + second, expected_prompts):
        assert [s.index for s in group.samples] == [0, 1, 2, 3]
        for s in group.samples:
            assert s.prompt_tokens == prompt["prompt_tokens"] and s.group_id == group.group_id
            assert s.reward == sum(t == prompt["target"] for t in s.response_tokens[:2]) / 2


def test_a_nan_reward_fails_its_group_naming_the_task_group_and_sample(engine_url, capsys):
    client = EngineClient(engine_url, [engine_url])
    manager = RolloutManager(function_path="rollout_fns.single_turn:generate_group",
                             task_path="test_rollout_fns:NanTask", client=client,
                             sampling_params={"max_new_tokens": 2}, prompts_per_step=1, samples_per_prompt=3, seed=0)
    [group] = run(client, manager.generate_step())
    assert "task 'test_rollout_fns:NanTask'" in group.error and "group 0" in group.error
    assert "sample 0/2: reward is nan" in group.error
    assert [s.status for s in group.samples] == [SampleStatus.FAILED] * 3  # nothing of it is trained
    assert capsys.readouterr().err.count("sluice: group 0 failed: rollout function") == 1  # said once


def test_a_rollout_function_returning_the_wrong_type_fails_its_group_with_the_reason(engine_url):
    client = EngineClient(engine_url, [engine_url])
    manager = RolloutManager(function_path="test_rollout_fns:returns_a_dict", task_path="test_rollout_fns:NanTask",
                             client=client, sampling_params={}, prompts_per_step=1, samples_per_prompt=2, seed=0)
    [group] = run(client, manager.generate_step())
    assert re.search(r"rollout function 'test_rollout_fns:returns_a_dict' .*: TypeError: must return a list of "
                     r"glue.types.Sample, got dict", group.error), group.error


async def never_finishes(ctx, prompt, num_samples):
    await asyncio.sleep(3600)


def test_a_group_past_its_timeout_is_cut_and_failed_without_waiting_for_it(engine_url):
    client = EngineClient(engine_url, [engine_url])
    manager = RolloutManager(function_path="test_rollout_fns:never_finishes", task_path="test_rollout_fns:NanTask",
                             client=client, sampling_params={}, prompts_per_step=2, samples_per_prompt=2, seed=0,
                             group_timeout_s=0.3)
    started = time.monotonic()
    groups = run(client, manager.generate_step())
    assert time.monotonic() - started < 5
    assert [g.error.split(") ", 1)[1] for g in groups] == ["timed out after rollout.group_timeout_s=0.3 s"] * 2


def test_echo_task_reward_is_the_fraction_of_the_first_k_tokens_equal_to_the_last_prompt_token():
    task = EchoTask(k=4)
    prompt = [0, 5, 6, 7]
    cases = [([7, 7, 7, 7, 3], 4 / 4), ([7, 3, 7, 3, 7, 7], 2 / 4), ([5, 6, 3, 3], 0 / 4), ([7], 1 / 4), ([], 0.0)]
    for response, expected in cases:
        assert task.reward(Sample(prompt_tokens=prompt, response_tokens=response)) == expected


def test_echo_task_prompts_are_seeded_and_drawn_from_the_content_range():
    task = EchoTask(content_low=4, content_high=8, prompt_len=5)
    a = list(itertools.islice(task.prompts(3), 50))
    assert a == list(itertools.islice(task.prompts(3), 50))
    assert a != list(itertools.islice(task.prompts(4), 50))
    for p in a:
        assert p["prompt_tokens"][0] == 0 and len(p["prompt_tokens"]) == 6
        assert all(4 <= t < 8 for t in p["prompt_tokens"][1:]) and p["target"] == p["prompt_tokens"][-1]
    with pytest.raises(ValueError, match="bos_id=5 lies inside the content range"):
        EchoTask(bos_id=5)


def test_rollout_modules_import_no_backend():

    code = ("import sys, glue.rollout.manager, glue.plugins, glue.fleet.engine_client, rollout_fns.single_turn, "
            "rollout_fns.toy_tasks; print(sorted(m for m in ('ray', 'sglang', 'megatron', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"


def test_plain_reward_functions_run_off_the_event_loop_side_by_side():
    """Two samples' plain rewards must run at the same time to pass a 2-party barrier; on the event loop the first
    would block it, the second would never start, and the barrier would break after its timeout."""
    barrier, threads = threading.Barrier(2, timeout=20), []

    def slow_verifier(sample):
        threads.append(threading.get_ident())
        barrier.wait()
        return float(sample.index)

    samples = asyncio.run(score_all(slow_verifier, 2))
    assert [s.reward for s in samples] == [0.0, 1.0]
    assert threading.get_ident() not in threads  # asyncio.run's loop ran here


def test_async_rewards_run_on_the_loop_and_a_returned_awaitable_is_awaited():
    async def on_the_loop(sample):
        return {"score": 1.0, "thread": float(threading.get_ident() == loop_thread)}

    def returns_a_coroutine(sample):  # e.g. TextDataTask.reward over an async verifier
        return on_the_loop(sample)

    loop_thread = threading.get_ident()
    for reward_fn in (on_the_loop, returns_a_coroutine):
        (sample,) = asyncio.run(score_all(reward_fn, 1))
        assert sample.reward == {"score": 1.0, "thread": 1.0}


async def score_all(reward_fn, n: int) -> list[Sample]:
    ctx = RolloutContext(client=None, sampling_params={}, reward_fn=reward_fn, group_id=0)
    samples = [Sample(prompt_tokens=[1], index=i) for i in range(n)]
    await asyncio.gather(*(score(ctx, s) for s in samples))
    return samples
