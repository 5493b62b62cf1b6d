"""Issue 26 item 6: a weight sync's abort never reaches an OpenAI-client agent. Over real HTTP on loopback, a
stand-in router and a stand-in engine answer in SGLang's chat shape (one `metadata.weight_version` per answer, as
SGLang 0.5.23 does); the router drops the chat `input_ids` field as sgl-router 0.3.2 does. An aborted completion is
continued on the engine from prompt + tokens so far and the agent sees one whole answer; one still aborted at the
resume limit gives the run up, counted, and the agent never gets it as an answer."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from glue.fleet.engine_client import EngineClient
from glue.rollout.manager import RolloutContext
from glue.types import SampleStatus
from rollout_fns.openai_agent import generate_group

PROMPT = [1, 2, 3]  # what the stand-in's chat template makes of any messages


def token_text(token: int) -> str:
    return f"<{token}>"


def logprob(token: int) -> float:
    return -token / 100


def chat_answer(prompt: list[int], tokens: list[int], version: str, finish: str) -> dict:
    """SGLang's ChatCompletionResponse for `tokens` generated after `prompt` (with the sglext id opt-ins)."""
    entries = [{"token": token_text(t), "bytes": list(token_text(t).encode()), "logprob": logprob(t),
                "top_logprobs": []} for t in tokens]
    return {"id": "chat-0", "object": "chat.completion", "created": 0, "model": "stand-in",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(map(token_text, tokens)),
                                                 "reasoning_content": None, "tool_calls": None},
                         "logprobs": {"content": entries}, "finish_reason": finish, "matched_stop": None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)},
            "metadata": {"weight_version": version}, "sglext": {"input_ids": prompt, "output_ids": [tokens]}}


class Script:
    """The answers of a run's chat requests in turn: (tokens, weight version, finish_reason) each; the bodies
    received, by server."""

    def __init__(self, parts: list[tuple[list[int], str, str]]):
        self.parts, self.received = list(parts), {"router": [], "engine": []}
        self.lock = threading.Lock()

    def answer(self, server: str, body: dict) -> dict:
        with self.lock:
            self.received[server].append(body)
            tokens, version, finish = self.parts.pop(0)
        prompt = body.get("input_ids") or PROMPT
        return chat_answer(prompt, tokens, version, finish)


@contextlib.contextmanager
def stand_in(script: Script, server: str):
    """A chat server on loopback: "router" drops `input_ids` from the body (sgl-router's chat field list has no
    such field), "engine" keeps them (SGLang's chat route then bypasses its template)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if server == "router":
                body.pop("input_ids", None)
            data = json.dumps(script.answer(server, body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


async def one_call_agent(client: openai.AsyncOpenAI, prompt: dict) -> float:
    """One chat completion; what the agent got back is kept in prompt["seen"]. With prompt["swallow"] an error is
    kept there too and the agent returns a reward anyway."""
    try:
        reply = await client.chat.completions.create(model="stand-in", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8)
    except openai.APIStatusError as err:
        if not prompt["swallow"]:
            raise
        prompt["seen"].append(err)
        return 1.0
    prompt["seen"].append(reply.model_dump(warnings=False))
    return 1.0


def run_script(parts, *, max_resumes: int, swallow: bool = False):
    """One agent run against the stand-ins: (its samples, what the agent saw, the bodies each server got)."""
    script = Script(parts)
    prompt = {"prompt_tokens": [0], "agent": "test_openai_agent_aborts:one_call_agent", "seen": [],
              "swallow": swallow}
    with stand_in(script, "router") as router_url, stand_in(script, "engine") as engine_url:
        async def group():
            client = EngineClient(router_url, [engine_url])
            try:
                ctx = RolloutContext(client=client, sampling_params={}, reward_fn=lambda s: 0.0, group_id=0,
                                     max_resumes=max_resumes)
                return await generate_group(ctx, prompt, 1)
            finally:
                await client.close()

        samples = asyncio.run(group())
    return samples, prompt["seen"], script.received


def test_an_aborted_completion_is_continued_on_the_new_weights_and_the_agent_sees_one_whole_answer():
    samples, seen, received = run_script([([11, 12, 13], "1", "abort"), ([14, 15], "2", "stop")], max_resumes=2)
    [answer] = seen
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "<11><12><13><14><15>"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.11, -0.12, -0.13, -0.14, -0.15]
    assert answer["usage"]["completion_tokens"] == 5 and answer["usage"]["total_tokens"] == 8
    assert answer["metadata"]["weight_versions"] == [{"version": "1", "start": 0, "end": 3},
                                                     {"version": "2", "start": 3, "end": 5}]
    # The continuation went to the engine (the router would have dropped input_ids), from prompt + tokens so far,
    # with what is left of the agent's token budget.
    assert len(received["router"]) == 1 and len(received["engine"]) == 1
    [continued] = received["engine"]
    assert continued["input_ids"] == PROMPT + [11, 12, 13] and continued["max_completion_tokens"] == 5
    assert "max_tokens" not in continued and continued["messages"] == [{"role": "user", "content": "hi"}]
    [sample] = samples
    assert sample.prompt_tokens == PROMPT and sample.response_tokens == [11, 12, 13, 14, 15]
    assert sample.versions == [1, 1, 1, 2, 2] and sample.loss_mask == [1] * 5
    assert sample.rollout_logprobs == [-0.11, -0.12, -0.13, -0.14, -0.15]
    assert sample.status is SampleStatus.COMPLETED and sample.reward == 1.0
    assert sample.metadata["resumes"] == 1 and "resume_limit_hit" not in sample.metadata


def test_an_abort_at_the_last_token_of_the_budget_is_a_length_answer_without_a_continuation():
    samples, seen, received = run_script([([11] * 8, "1", "abort")], max_resumes=2)
    assert seen[0]["choices"][0]["finish_reason"] == "length" and received["engine"] == []
    assert samples[0].status is SampleStatus.TRUNCATED and samples[0].versions == [1] * 8


@pytest.mark.parametrize("swallow", [False, True], ids=["agent_raises", "agent_goes_on"])
def test_a_completion_still_aborted_at_the_resume_limit_gives_the_run_up_and_is_counted(swallow):
    from glue.loop.buffer import RolloutBuffer
    from glue.loop.staleness import StalenessGate
    from glue.loop.stream import RolloutStream
    from glue.types import Group

    parts = [([11], "1", "abort"), ([12], "2", "abort"), ([13], "3", "abort"), ([99], "4", "stop")]
    samples, seen, received = run_script(parts, max_resumes=2, swallow=swallow)
    assert len(received["router"]) == 1 and len(received["engine"]) == 2  # two continuations, no retries
    assert received["engine"][1]["input_ids"] == PROMPT + [11, 12]
    if swallow:  # the agent got an error, never the aborted text as an answer
        [error] = seen
        assert isinstance(error, openai.InternalServerError) and "resume limit" in str(error)
    else:
        assert seen == []
    [sample] = samples
    assert sample.status is SampleStatus.ABORTED and sample.metadata["resume_limit_hit"] == 1
    assert sample.response_tokens == [11, 12, 13] and sample.versions == [1, 2, 3] and sample.reward == 0.0
    stream = RolloutStream(manager=None, gate=StalenessGate(groups_per_step=1, max_staleness=1),
                           buffer=RolloutBuffer(groups_per_step=1), max_groups=4)
    stream.buffer.started(0, deadline=1, start_version=0)
    stream.gate.admit()
    stream._accept(Group(group_id=0, samples=samples))
    assert stream.metrics(1.0)["rollout/resume_limit_drops"] == 1.0


# ---------------------------------------------------------------- a real pause on an engine standing in for SGLang
async def long_answer_agent(client: openai.AsyncOpenAI, prompt: dict) -> float:
    reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count."}],
                                                 max_tokens=prompt["n"], temperature=1.0,
                                                 extra_body={"ignore_eos": True})
    prompt["seen"].append(reply.model_dump(warnings=False))
    return 0.5


def test_a_real_abort_pause_mid_answer_is_continued_on_the_engine_and_the_sample_spans_both_versions(
        engine_processes, text_model_dir, tokenizer):
    url = engine_processes.start_sglang_stand_in(text_model_dir, "--num-threads", "1")
    n = 1000
    prompt = {"prompt_tokens": [0], "agent": "test_openai_agent_aborts:long_answer_agent", "seen": [], "n": n}

    def running() -> int:
        with urllib.request.urlopen(f"{url}/get_server_info") as answer:
            return json.load(answer)["internal_states"][0]["num_running_reqs"]

    def set_version(version: str) -> None:
        request = urllib.request.Request(f"{url}/update_weight_version", method="POST",
                                         data=json.dumps({"new_version": version,
                                                          "abort_all_requests": False}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()

    async def scenario():
        client = EngineClient(url, [url])
        try:
            ctx = RolloutContext(client=client, sampling_params={}, reward_fn=lambda s: 0.0, group_id=0)
            group = asyncio.ensure_future(generate_group(ctx, prompt, 1))
            while not group.done() and not running():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # abort once tokens are flowing
            await asyncio.to_thread(client.pause_generation, "abort")
            await asyncio.to_thread(set_version, "1")
            await asyncio.to_thread(client.continue_generation)
            return await group
        finally:
            await client.close()

    [sample] = asyncio.run(scenario())
    set_version("0")
    [answer] = prompt["seen"]
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "length" and sample.status is SampleStatus.TRUNCATED
    assert 1 in sample.versions, "the abort came too late to split the answer; the test needs a longer one"
    assert len(sample.response_tokens) == n and sample.metadata["resumes"] == 1
    first_new = sample.versions.index(1)
    assert 0 < first_new and sample.versions == [0] * first_new + [1] * (n - first_new)
    assert answer["sglext"]["output_ids"] == [sample.response_tokens]
    assert sample.prompt_tokens == answer["sglext"]["input_ids"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == sample.rollout_logprobs
    # The text is the parts' texts joined (each decoded by the engine on its own), as the agent would have read them.
    parts = sample.response_tokens[:first_new], sample.response_tokens[first_new:]
    assert choice["message"]["content"] == "".join(tokenizer.decode(p, skip_special_tokens=True) for p in parts)
