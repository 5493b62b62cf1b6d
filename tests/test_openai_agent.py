"""Agents written with the real `openai` package, for real: the embedded engine's /v1/chat/completions answers with
SGLang's fields and the engine's own token ids, `ChatRecorder` records each call exactly, and the openai_agent
rollout function turns a two-call tool agent into trajectories whose tool tokens are masked, directly and through
the real sgl-router."""
from __future__ import annotations

import asyncio
import itertools

import openai
import pytest

from conftest import is_gone
from glue.embedded_engine.openai_chat import NEUTRAL_FIELDS
from glue.embedded_engine.routes import CHAT_COMPLETION
from glue.fleet.engine_client import EngineClient
from glue.rollout.openai_agent import ID_FLAGS, ID_HEADERS, ChatCall, ChatRecorder, RecordingError, trajectory_samples
from glue.rollout.manager import RolloutContext
from glue.types import SampleStatus
from rollout_fns.openai_agent import generate_group
from helpers.engines import call, generate
from helpers.schema import class_fields, string_constants

QUESTION = [{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": "What is 2+3?"}]
TOOL_OUTPUT = "The answer is 5"


@pytest.fixture(scope="module")
def engine_url(engine_processes, text_model_dir) -> str:
    return engine_processes.start(text_model_dir, "--seed", "0", "--num-threads", "1")


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def openai_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def closing(client, coro):
    try:
        return await coro
    finally:
        await client.close()


def test_the_openai_client_gets_sglang_fields_and_the_engines_own_token_ids(engine_url, tokenizer):
    client = openai_client(engine_url)

    async def calls():
        models = await client.models.list()
        completion = await client.chat.completions.create(
            model="tiny", messages=QUESTION, max_tokens=6, temperature=0.0, logprobs=True,
            extra_body={"return_prompt_token_ids": True, "return_token_ids": True})
        return models, completion

    models, completion = asyncio.run(closing(client, calls()))
    assert [m.id for m in models.data] and models.data[0].max_model_len == 2048
    answer = completion.model_dump(warnings=False)  # SGLang puts weight_versions (a list) in metadata
    choice = answer["choices"][0]
    prompt = chat_ids(tokenizer, QUESTION)
    assert choice["prompt_token_ids"] == prompt and answer["sglext"]["input_ids"] == prompt
    reference = generate(engine_url, {"input_ids": prompt, "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}})
    ids = reference["output_ids"]
    assert choice["response_token_ids"] == ids and answer["sglext"]["output_ids"] == [ids]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
        [e[0] for e in reference["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert [e["token"] for e in choice["logprobs"]["content"]] == [tokenizer.decode([t]) for t in ids]
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["finish_reason"] == reference["meta_info"]["finish_reason"]["type"]
    assert answer["usage"]["prompt_tokens"] == len(prompt) and answer["usage"]["completion_tokens"] == len(ids)
    assert answer["metadata"] == {"weight_version": "0", "weight_versions": [{"version": "0", "start": 0,
                                                                              "end": len(ids)}]}


def test_every_chat_name_read_or_answered_is_a_field_of_sglangs_openai_protocol(sglang_srt, engine_url):
    protocol = class_fields(sglang_srt / "entrypoints" / "openai" / "protocol.py")
    request = protocol["ChatCompletionRequest"]
    assert {"messages", "max_completion_tokens", "return_token_ids"} <= request  # the real class, parsed
    assert (set(CHAT_COMPLETION) | set(NEUTRAL_FIELDS) | set(ID_FLAGS)) - request == set()
    assert set(ID_HEADERS) <= string_constants(sglang_srt / "entrypoints" / "openai" / "serving_chat.py")
    status, answer = call(engine_url, "/v1/chat/completions", {
        "messages": QUESTION, "max_tokens": 2, "logprobs": True, "return_prompt_token_ids": True,
        "return_token_ids": True, "return_meta_info": True, **ID_FLAGS})
    assert status == 200, answer
    [choice] = answer["choices"]
    assert set(answer) == protocol["ChatCompletionResponse"]
    assert set(choice) == protocol["ChatCompletionResponseChoice"] - {"hidden_states"}
    assert set(choice["message"]) <= protocol["ChatMessage"] and set(answer["usage"]) <= protocol["UsageInfo"]
    assert set(choice["logprobs"]["content"][0]) == protocol["ChatCompletionTokenLogprob"]
    assert {"input_ids", "output_ids"} == set(answer["sglext"]) and set(answer["sglext"]) <= protocol["SglExt"]
    card = call(engine_url, "/v1/models")[1]["data"][0]
    assert set(card) == protocol["ModelCard"]


def test_a_stop_string_ends_the_answer_and_is_trimmed_from_the_text(engine_url, tokenizer):
    prompt = chat_ids(tokenizer, QUESTION)
    free = generate(engine_url, {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})["output_ids"]
    stop = next((p for p in (tokenizer.decode(free[k:k + 2]) for k in range(2, 6)) if "\ufffd" not in p), None)
    assert stop, f"no two greedy tokens of {free} decode to clean text"
    status, answer = call(engine_url, "/v1/chat/completions", {
        "messages": QUESTION, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": [stop],
        "return_token_ids": True})
    assert status == 200, answer
    choice = answer["choices"][0]
    kept = next(n for n in range(1, len(free) + 1) if stop in tokenizer.decode(free[:n]))  # SGLang's first match
    assert choice["response_token_ids"] == free[:kept]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", stop)
    text = tokenizer.decode(free[:kept], skip_special_tokens=True)
    assert choice["message"]["content"] == text[:text.find(stop)]


@pytest.mark.parametrize("body, field", [
    ({"messages": QUESTION, "n": 2}, "n"),
    ({"messages": QUESTION, "stream": True}, "stream"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": QUESTION, "top_p": 0}, "top_p"),
    ({"messages": QUESTION, "temperature": -1}, "temperature"),
    ({"messages": QUESTION, "max_tokens": -1}, "max_tokens"),
    ({"messages": QUESTION, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": QUESTION, "stop": [5]}, "stop"),
    ({"messages": QUESTION, "top_logprobs": 3, "logprobs": True}, "top_logprobs"),
    ({"messages": QUESTION, "tool_choice": "required"}, "tool_choice"),
    ({"messages": QUESTION, "repetition_penalty": 1.3}, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "7 " * 3000}]}, "messages"),
    ({"messages": QUESTION, "input_ids": [1, 2, 99999]}, "input_ids"),
    ({"messages": QUESTION, "continue_final_message": True}, "continue_final_message"),
])
def test_a_bad_chat_body_gets_a_400_naming_the_field(engine_url, body, field):
    status, answer = call(engine_url, "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["field"] == field, answer
    assert field.split(".")[-1].split("[")[0] in answer["error"]["message"]


def test_an_engine_without_a_tokenizer_refuses_chat_with_a_400_saying_so(engine_processes, tiny_model_dir):
    url = engine_processes.start(tiny_model_dir, "--num-threads", "1")
    status, answer = call(url, "/v1/chat/completions", {"messages": QUESTION})
    assert status == 400 and "no tokenizer" in answer["error"]["message"]
    assert call(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})[0] == 200


# ---------------------------------------------------------------- the recorder
def test_the_recorder_records_prompt_completion_logprobs_and_versions_exactly(engine_url, tokenizer):
    async def agent(client: openai.AsyncOpenAI):
        return await client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, temperature=0.7,
                                                    seed=11)

    async def recorded():
        async with ChatRecorder(f"{engine_url}/v1") as recorder:
            completion = await agent(recorder.client)
        return recorder, completion

    recorder, completion = asyncio.run(recorded())
    recorder.check()
    [recorded_call] = recorder.calls
    prompt = chat_ids(tokenizer, QUESTION)
    reference = generate(engine_url, {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 11}})
    assert recorded_call.prompt_ids == prompt
    assert recorded_call.completion_ids == reference["output_ids"]
    assert recorded_call.logprobs == pytest.approx([e[0] for e in reference["meta_info"]["output_token_logprobs"]],
                                                   abs=1e-5)
    assert recorded_call.versions == [0] * len(reference["output_ids"]) and recorded_call.weight_version == 0
    assert completion.choices[0].message.content == tokenizer.decode(reference["output_ids"], skip_special_tokens=True)


def test_the_recorder_refuses_streaming_with_a_400_the_agent_sees(engine_url):
    async def streamed():
        async with ChatRecorder(f"{engine_url}/v1") as recorder:
            with pytest.raises(openai.BadRequestError, match="stream=false"):
                await recorder.client.chat.completions.create(model="tiny", messages=QUESTION, stream=True)
        return recorder

    assert asyncio.run(streamed()).calls == []


def test_an_answer_without_token_ids_is_a_recording_problem_naming_the_server_flags():
    recorder = ChatRecorder("http://127.0.0.1:9/v1")
    recorder.record(b'{"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "x"}}], '
                    b'"metadata": {"weight_version": "3"}}')
    assert recorder.calls == []
    with pytest.raises(RecordingError, match="--return-input-ids --return-output-ids"):
        recorder.check()


# ---------------------------------------------------------------- trajectories (pure)
def made_call(prompt, completion, version=0, finish="stop") -> ChatCall:
    return ChatCall(prompt_ids=prompt, completion_ids=completion, logprobs=[-0.5 - t / 100 for t in completion],
                    versions=[version] * len(completion), weight_version=version, finish_reason=finish)


def test_a_call_extending_the_trajectory_merges_with_the_tokens_in_between_masked():
    first = made_call([1, 2, 3], [10, 11])
    second = made_call([1, 2, 3, 10, 11, 50, 51, 52], [12], version=1, finish="length")
    [sample] = trajectory_samples([first, second])
    assert sample.prompt_tokens == [1, 2, 3]
    assert sample.response_tokens == [10, 11, 50, 51, 52, 12]
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_logprobs == [-0.6, -0.61, 0.0, 0.0, 0.0, -0.62]
    assert sample.versions == [0, 0, 1, 1, 1, 1]
    assert sample.status is SampleStatus.TRUNCATED and sample.metadata["calls"] == 2


def test_a_call_that_does_not_extend_any_trajectory_starts_a_new_sample_and_a_branch_does_too():
    root = made_call([1, 2], [7])
    rewritten = made_call([1, 2, 8, 9], [5])  # the agent re-rendered the reply differently: not what was generated
    branch_a = made_call([1, 2, 7, 40], [6])
    branch_b = made_call([1, 2, 7, 41], [6])  # extends root's state before branch_a, which has moved on
    samples = trajectory_samples([root, rewritten, branch_a, branch_b])
    assert [(s.prompt_tokens, s.response_tokens, s.loss_mask) for s in samples] == [
        ([1, 2], [7, 40, 6], [1, 0, 1]), ([1, 2, 8, 9], [5], [1]), ([1, 2, 7, 41], [6], [1])]


def test_a_completion_spanning_a_weight_sync_keeps_one_version_per_token():
    spanning = ChatCall(prompt_ids=[1], completion_ids=[4, 5, 6], logprobs=[-1.0, -2.0, -3.0], versions=[2, 2, 3],
                        weight_version=3, finish_reason="stop")
    [sample] = trajectory_samples([spanning])
    assert sample.versions == [2, 2, 3] and sample.loss_mask == [1, 1, 1]


# ---------------------------------------------------------------- the rollout function over a real engine
async def two_call_agent(client: openai.AsyncOpenAI, prompt: dict) -> float:
    """Ask, append the reply and a tool message, ask again; the reward is the second reply's length."""
    seed = next(prompt["seeds"])
    first = [*QUESTION]
    reply = await client.chat.completions.create(model="tiny", messages=first, max_tokens=1, temperature=1.0,
                                                 seed=seed)
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
              {"role": "tool", "tool_call_id": "call-1", "content": TOOL_OUTPUT}]
    answer = await client.chat.completions.create(model="tiny", messages=second, max_tokens=3, temperature=1.0,
                                                  seed=seed)
    prompt["log"][seed] = (first, second)
    return float(len(answer.choices[0].message.content))


def expected_samples(url: str, tokenizer, first: list[dict], second: list[dict], seed: int) -> list[tuple]:
    """(prompt, response, loss_mask, logprobs) per sample, worked out from the chat template and /generate alone."""
    def sampled(prompt, n):
        out = generate(url, {"input_ids": prompt, "return_logprob": True, "sampling_params": {
            "max_new_tokens": n, "temperature": 1.0, "sampling_seed": seed}})
        return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]

    p1, p2 = chat_ids(tokenizer, first), chat_ids(tokenizer, second)
    (c1, l1), (c2, l2) = sampled(p1, 1), sampled(p2, 3)
    if p2[:len(p1) + len(c1)] != p1 + c1:
        return [(p1, c1, [1] * len(c1), l1), (p2, c2, [1] * len(c2), l2)]
    gap = p2[len(p1) + len(c1):]
    return [(p1, c1 + gap + c2, [1] * len(c1) + [0] * len(gap) + [1] * len(c2), l1 + [0.0] * len(gap) + l2)]


def run_group(router_url: str, prompt: dict, num_samples: int, group_id: int = 3):
    client = EngineClient(router_url, [])
    ctx = RolloutContext(client=client, sampling_params={}, reward_fn=lambda s: 0.0, group_id=group_id)
    return asyncio.run(generate_group(ctx, prompt, num_samples))


def check_group(url: str, tokenizer, prompt: dict, samples) -> tuple[int, int]:
    """Every run's samples equal the expected ones; (runs that merged into one sample, runs that split)."""
    merged = split = 0
    for seed, (first, second) in prompt["log"].items():
        mine = [s for s in samples if s.metadata["agent_run"] == seed]
        expected = expected_samples(url, tokenizer, first, second, seed)
        assert [(s.prompt_tokens, s.response_tokens, s.loss_mask) for s in mine] == [e[:3] for e in expected]
        for sample, (_, _, _, logprobs) in zip(mine, expected):
            assert sample.rollout_logprobs == pytest.approx(logprobs, abs=1e-5)
            assert sample.versions == [0] * len(sample.response_tokens) and sample.group_id == 3
            assert sample.reward == mine[-1].reward and isinstance(sample.reward, float)
        if len(mine) == 1:
            masked = [t for t, m in zip(mine[0].response_tokens, mine[0].loss_mask) if m == 0]
            assert f"<|im_start|>tool\n{TOOL_OUTPUT}<|im_end|>" in tokenizer.decode(masked)
        merged, split = merged + (len(mine) == 1), split + (len(mine) == 2)
    return merged, split


def test_a_two_call_tool_agent_becomes_one_sample_per_trajectory_with_tool_tokens_masked(engine_url, tokenizer):
    prompt = {"prompt_tokens": [1], "agent": "test_openai_agent:two_call_agent", "seeds": itertools.count(),
              "log": {}}
    samples = run_group(engine_url, prompt, num_samples=12)
    assert sorted(prompt["log"]) == list(range(12))
    assert [s.index for s in samples] == list(range(len(samples)))
    merged, split = check_group(engine_url, tokenizer, prompt, samples)
    # A reply merges when its text renders back to the ids generated; a random model's often does not. Seeds fixed.
    assert merged + split == 12 and merged >= 1 and split >= 1, (merged, split)


def test_the_agent_works_through_the_real_sgl_router(text_model_dir, tokenizer, tmp_path_factory):
    from glue.fleet.fleet import RolloutFleet

    fleet = RolloutFleet(model_path=text_model_dir, num_engines=2, engine_args=["--num-threads", "1"],
                         log_dir=tmp_path_factory.mktemp("agent_fleet_logs"), engine_startup_timeout_s=120)
    try:
        fleet.start()
        prompt = {"prompt_tokens": [1], "agent": "test_openai_agent:two_call_agent", "seeds": itertools.count(),
                  "log": {}}
        samples = run_group(fleet.router_url, prompt, num_samples=4)
        merged, split = check_group(fleet.engine_urls[0], tokenizer, prompt, samples)
        assert merged + split == 4
    finally:
        fleet.stop()
    assert len(fleet.started_pids) == 3 and all(is_gone(p) for p in fleet.started_pids)


def test_odd_values_of_every_chat_field_and_message_never_get_a_5xx(engine_url):
    from helpers.engines import POOL

    bodies = [{"messages": [{"role": "user", "content": value}]} for value in POOL]
    bodies += [{"messages": [{"role": "tool", **{name: value}, "content": "x"}]}
               for name in ("tool_call_id", "name", "tool_calls") for value in POOL]
    for name in CHAT_COMPLETION:
        if name in ("max_tokens", "max_completion_tokens"):
            continue  # any budget is fine; a huge one only takes long
        bodies += [{"messages": QUESTION, name: value} for value in POOL]
    statuses = set()
    for body in bodies:
        status, answer = call(engine_url, "/v1/chat/completions", {"max_tokens": 2, **body})
        assert status == 200 or (400 <= status < 500 and answer["error"]["message"]), (body, status, answer)
        statuses.add(status)
    assert statuses == {200, 400}


def test_a_keyed_engine_refuses_a_keyless_agent_and_serves_the_rollout_function_with_its_key(
        engine_processes, text_model_dir):
    url = engine_processes.start(text_model_dir, "--api-key=agent-key", "--num-threads", "1")
    keyless = openai_client(url)
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(closing(keyless, keyless.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=1)))
    prompt = {"prompt_tokens": [1], "agent": "test_openai_agent:two_call_agent", "seeds": itertools.count(),
              "log": {}}
    ctx = RolloutContext(client=EngineClient(url, [], api_key="agent-key"), sampling_params={},
                         reward_fn=lambda s: 0.0, group_id=0)
    samples = asyncio.run(generate_group(ctx, prompt, 2))
    assert sorted(prompt["log"]) == [0, 1] and {s.metadata["agent_run"] for s in samples} == {0, 1}
