"""Agents written against the real `openai` package, recorded for training: `ChatRecorder` hands an agent an
`openai.AsyncOpenAI` whose base URL is the fleet (router url + /v1) and records every chat completion it makes
(prompt token ids, completion token ids, logprobs, weight versions); `trajectory_samples` turns the calls of one
agent run into `Sample`s, one per policy-visible trajectory.

The mechanism is an httpx transport inside the client, not a proxy process: it adds SGLang's opt-ins to each
`/chat/completions` request (`logprobs`, `return_input_ids_in_sglext`, `return_output_ids_in_sglext` and the
`x-sglext-return-*-ids` headers) and reads the answer's `sglext.input_ids` / `sglext.output_ids`,
`choices[i].logprobs` and `metadata.weight_versions` before the agent sees it. Token ids are the engine's own
(nothing is re-tokenised here). sgl-router forwards neither those body fields nor the headers, so behind a router the
engines must return ids server-wide: SGLang's `--return-input-ids --return-output-ids` (the embedded engine does by
default). An answer without ids is a recording problem, raised by `ChatRecorder.check()` after the run.

A choice aborted by a weight sync's pause (finish_reason "abort") never reaches the agent: the transport continues it
from prompt + tokens so far (SGLang's chat `input_ids`, sent to an engine directly because sgl-router drops that
field) and hands the agent one stitched answer, at most `max_resumes` times; one still aborted then gives the run up.
"""
from __future__ import annotations

import importlib
import itertools
import json
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

import openai

from glue.fleet.engine_client import weight_version_to_int
from glue.types import Sample, SampleStatus

FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "tool_calls": SampleStatus.COMPLETED,
                 "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
ID_HEADERS = {"x-sglext-return-input-ids": "1", "x-sglext-return-output-ids": "1"}
ID_FLAGS = {"logprobs": True, "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
# On sluice's own error answers (a completion still aborted at the resume limit): the openai client does not retry.
GIVEN_UP_HEADERS = {"x-should-retry": "false"}


def _httpx_module() -> Any:
    """The HTTP library the installed openai client is built on (httpx2 in openai 3, httpx before)."""
    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    return importlib.import_module(base.__module__.split(".")[0])


httpx = _httpx_module()


@dataclass(frozen=True, kw_only=True)
class ChatCall:
    """One chat completion as the policy saw and produced it: `versions[i]` is the weight version of completion
    token i; `weight_version` the answer's (for tokens appended around a call that produced none); `resumes` how
    often it was continued after an abort (finish_reason "abort" only when still aborted at the resume limit)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    weight_version: int
    finish_reason: str
    resumes: int = 0


class RecordingError(ValueError):
    """A chat completion answer that cannot be recorded exactly (no token ids, mismatched logprobs, ...)."""


def calls_from_answer(answer: Any) -> list[ChatCall]:
    """The `ChatCall`s (one per choice) of one SGLang chat completion answer; RecordingError saying what is missing."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise RecordingError(f"not a chat completion answer: {str(answer)[:200]}")
    sglext = answer.get("sglext") or {}
    metadata = answer.get("metadata") or {}
    if "weight_version" not in metadata:
        raise RecordingError("the answer has no metadata.weight_version (SGLang's weight version of the call)")
    calls = []
    for choice in answer["choices"]:
        index = choice.get("index", 0)
        prompt = sglext.get("input_ids") or choice.get("prompt_token_ids")
        outputs = sglext.get("output_ids")
        completion = outputs[index] if outputs and index < len(outputs) else choice.get("response_token_ids")
        if prompt is None or completion is None:
            raise RecordingError("the answer carries no token ids (sglext.input_ids / sglext.output_ids): start SGLang "
                                 "with --return-input-ids --return-output-ids; sgl-router drops the per-request "
                                 "return_*_in_sglext fields and x-sglext-* headers")
        entries = (choice.get("logprobs") or {}).get("content") or []
        if len(entries) != len(completion):
            raise RecordingError(f"choice {index}: {len(entries)} logprobs for {len(completion)} completion tokens")
        if choice.get("finish_reason") not in FINISH_STATUS:
            raise RecordingError(f"choice {index}: unknown finish_reason {choice.get('finish_reason')!r}")
        calls.append(ChatCall(prompt_ids=list(prompt), completion_ids=list(completion),
                              logprobs=[float(e["logprob"]) for e in entries],
                              versions=token_versions(metadata, len(completion)),
                              weight_version=weight_version_to_int(metadata["weight_version"]),
                              finish_reason=choice["finish_reason"]))
    return calls


def token_versions(metadata: dict[str, Any], n: int) -> list[int]:
    """One weight version per completion token, from SGLang's `metadata.weight_versions` spans when present."""
    spans = metadata.get("weight_versions")
    if not spans:
        return [weight_version_to_int(metadata["weight_version"])] * n
    versions = [weight_version_to_int(s["version"]) for s in spans for _ in range(int(s["start"]), int(s["end"]))]
    if len(versions) != n:
        raise RecordingError(f"metadata.weight_versions {spans} cover {len(versions)} tokens, not the {n} generated")
    return versions


Post = Callable[[str, dict], Awaitable[tuple[Any, bytes]]]  # (url, chat body) -> (response, its body)


class RecordingTransport(httpx.AsyncBaseTransport):
    """Passes every request to `inner`; chat completions get SGLang's id opt-ins, aborted choices are continued
    (`ChatRecorder.completed`) and the answers are recorded."""

    def __init__(self, inner: Any, recorder: "ChatRecorder"):
        self.inner, self.recorder = inner, recorder

    async def handle_async_request(self, request: Any) -> Any:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return await self.inner.handle_async_request(request)
        body = json.loads(await request.aread())
        if body.get("stream"):
            return httpx.Response(400, request=request, json={"error": {
                "message": "sluice records chat completions whole; call with stream=false", "param": "stream"}})
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in ("content-length", "host")]

        async def post(url: Any, chat: dict) -> tuple[Any, bytes]:
            sent = httpx.Request("POST", url, headers=[*headers, *ID_HEADERS.items()],
                                 content=json.dumps({**chat, **ID_FLAGS}).encode(), extensions=request.extensions)
            response = await self.inner.handle_async_request(sent)
            return response, await response.aread()

        response, raw = await post(request.url, body)
        if response.status_code == 200:
            response, raw = await self.recorder.completed(response, raw, body, post)
        kept = [(k, v) for k, v in response.headers.multi_items()
                if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=kept, content=raw, request=request,
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ChatRecorder:
    """The client of one agent run and what it recorded: `client` is an `openai.AsyncOpenAI` on `base_url`
    (the router's or an engine's url + "/v1"); `calls` the chat completions in the order they were answered.
    Use as `async with ChatRecorder(url) as recorder:`; then `recorder.check()` raises any recording problem.

    An aborted choice is continued on one of `engine_urls` (taken in turn; the list is held, so a fleet's
    replacements count; none: `base_url`) at most `max_resumes` times. One still aborted then is recorded with
    finish_reason "abort", the agent gets a 503 it is told not to retry, and `gave_up` is set."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 3600.0, max_retries: int = 2,
                 engine_urls: list[str] | None = None, max_resumes: int = 8):
        self.calls: list[ChatCall] = []
        self.problems: list[str] = []
        self.base_url, self.engine_urls, self.max_resumes = base_url.rstrip("/"), engine_urls, max_resumes
        self.gave_up = False
        self._turn = itertools.count()
        http_client = openai.DefaultAsyncHttpxClient(transport=RecordingTransport(httpx.AsyncHTTPTransport(), self))
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "sluice", http_client=http_client,
                                         timeout=timeout_s, max_retries=max_retries)

    def record(self, raw: bytes) -> None:
        """Record one answer; a problem is kept (the agent still gets its answer) and raised by `check()`."""
        try:
            self.calls.extend(calls_from_answer(json.loads(raw)))
        except (RecordingError, ValueError, KeyError, TypeError) as e:
            self.problems.append(f"{type(e).__name__}: {e}")

    async def completed(self, response: Any, raw: bytes, body: dict, post: Post) -> tuple[Any, bytes]:
        """The answer for the agent to the chat `body` first answered `raw`: each aborted choice continued and
        stitched in, the whole recorded. An error answer to a continuation is the agent's (nothing recorded)."""
        try:
            answer = json.loads(raw)
            calls = calls_from_answer(answer)
        except (RecordingError, ValueError, KeyError, TypeError) as e:
            self.problems.append(f"{type(e).__name__}: {e}")
            return response, raw
        first = list(calls)
        for index, call in enumerate(calls):
            while call.finish_reason == "abort" and call.resumes < self.max_resumes:
                left = completion_budget(body, len(call.completion_ids))
                if left == 0:  # the abort came at the budget's last token
                    call = replace(call, finish_reason="length")
                    answer["choices"][index]["finish_reason"] = "length"
                    break
                part_response, part_raw = await post(self.next_engine() + "/chat/completions",
                                                     continuation(body, call, left))
                if part_response.status_code != 200:
                    return part_response, part_raw
                try:
                    part = json.loads(part_raw)
                    call = stitched(call, calls_from_answer(part)[0])
                except (RecordingError, ValueError, KeyError, TypeError) as e:
                    self.problems.append(f"continuing an aborted choice: {type(e).__name__}: {e}")
                    return refusal(502, f"sluice could not continue an aborted chat completion: {e}")
                stitch_answer(answer, index, part, call)
            calls[index] = call
        self.calls.extend(calls)
        if calls == first:  # nothing aborted: the engine's answer as it came
            return response, raw
        if any(c.finish_reason == "abort" for c in calls):
            self.gave_up = True
            return refusal(503, f"sluice: this chat completion was still aborted by weight syncs after "
                                f"{self.max_resumes} continuations (the resume limit); the agent run is given up")
        return response, json.dumps(answer).encode()

    def next_engine(self) -> str:
        """The OpenAI base URL a continuation goes to: the engines in turn, else `base_url`."""
        if not self.engine_urls:
            return self.base_url
        return f"{self.engine_urls[next(self._turn) % len(self.engine_urls)].rstrip('/')}/v1"

    def check(self) -> None:
        if self.problems:
            raise RecordingError(f"{len(self.problems)} chat completion(s) could not be recorded; first: "
                                 f"{self.problems[0]}")

    async def __aenter__(self) -> "ChatRecorder":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.close()


def refusal(status: int, message: str) -> tuple[Any, bytes]:
    """An error answer (response, body) in the OpenAI error shape that the openai client does not retry."""
    headers = {**GIVEN_UP_HEADERS, "content-type": "application/json"}
    return httpx.Response(status, headers=headers), json.dumps({"error": {"message": message, "code": status}}).encode()


def completion_budget(body: dict, generated: int) -> int | None:
    """Completion tokens the chat `body` still allows after `generated` (SGLang reads max_completion_tokens
    first); None when it sets no limit."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return None if limit is None else max(0, int(limit) - generated)


def continuation(body: dict, call: ChatCall, left: int | None) -> dict:
    """The chat body that continues `call` (one choice of `body`) from its prompt + completion so far: SGLang's
    `input_ids` bypass the chat template, so the tokens are the ones generated, not re-tokenised text."""
    chat = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens", "n")}
    chat["input_ids"] = call.prompt_ids + call.completion_ids
    if left is not None:
        chat["max_completion_tokens"] = left
    return chat


def stitched(call: ChatCall, part: ChatCall) -> ChatCall:
    """`call` continued by `part`, an answer to `continuation(..., call, ...)`: one call over both parts' tokens,
    each token with the version it was generated on."""
    if part.prompt_ids != call.prompt_ids + call.completion_ids:
        raise RecordingError(f"a continuation ran from {len(part.prompt_ids)} prompt ids, not the "
                             f"{len(call.prompt_ids) + len(call.completion_ids)} it was sent (prompt + tokens so far)")
    return replace(call, completion_ids=call.completion_ids + part.completion_ids,
                   logprobs=call.logprobs + part.logprobs, versions=call.versions + part.versions,
                   weight_version=part.weight_version, finish_reason=part.finish_reason, resumes=call.resumes + 1)


def stitch_answer(answer: dict, index: int, part: dict, call: ChatCall) -> None:
    """Fold `part` (the answer to a continuation of choice `index`) into `answer` in place, as if the engine had
    answered choice `index` in one go: text and logprobs joined, the last part's finish, ids, usage, versions. The
    engine's reasoning / tool-call parsers saw each part alone, so a call cut by the abort stays in the text."""
    choice, more = answer["choices"][index], part["choices"][0]
    message, extra = choice.setdefault("message", {}), more.get("message") or {}
    for key in ("content", "reasoning_content"):
        if message.get(key) is not None or extra.get(key) is not None:
            message[key] = (message.get(key) or "") + (extra.get(key) or "")
    if extra.get("tool_calls"):
        message["tool_calls"] = [*(message.get("tool_calls") or []), *extra["tool_calls"]]
    if (choice.get("logprobs") or {}).get("content") is not None:
        choice["logprobs"]["content"] += (more.get("logprobs") or {}).get("content") or []
    choice.update(finish_reason=more.get("finish_reason"), matched_stop=more.get("matched_stop"))
    if "response_token_ids" in choice:
        choice["response_token_ids"] = list(call.completion_ids)
    outputs = (answer.get("sglext") or {}).get("output_ids")
    if outputs and index < len(outputs):
        outputs[index] = list(call.completion_ids)
    usage, added = answer.get("usage"), (part.get("usage") or {}).get("completion_tokens", 0)
    if isinstance(usage, dict):
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + added
        usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage["completion_tokens"]
    if index == 0:  # SGLang's metadata describes the first choice
        answer["metadata"] = {"weight_version": (part.get("metadata") or {}).get("weight_version"),
                              "weight_versions": version_spans(call.versions)}


def version_spans(versions: list[int]) -> list[dict]:
    """SGLang's `weight_versions` spans ({"version", "start", "end"}) of per-token versions."""
    spans: list[dict] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(version), "start": i, "end": i + 1})
    return spans


def trajectory_samples(calls: list[ChatCall]) -> list[Sample]:
    """One `Sample` per policy-visible trajectory. A call whose prompt ids start with a trajectory's prompt +
    response so far extends it (the longest such): the tokens in between (tool output, user turns, the template's
    turn markers) are appended with loss_mask 0 and logprob 0, then the call's completion, trainable. Any other
    call starts a new sample. Status: the last call's finish_reason; a call still aborted (at the resume limit)
    marks its sample `resume_limit_hit` (rollout/resume_limit_drops), and `resumes` counts the continuations."""
    samples: list[Sample] = []
    for call in calls:
        sample = longest_extended(samples, call.prompt_ids)
        if sample is None:
            sample = Sample(prompt_tokens=list(call.prompt_ids), metadata={"calls": 0})
            samples.append(sample)
        else:
            gap = call.prompt_ids[len(sample.prompt_tokens) + len(sample.response_tokens):]
            version = call.versions[0] if call.versions else call.weight_version
            sample.append_response(gap, [0.0] * len(gap), version, trainable=False)
        start = 0
        for end in range(1, len(call.completion_ids) + 1):  # one append per run of equal versions
            if end == len(call.completion_ids) or call.versions[end] != call.versions[start]:
                sample.append_response(call.completion_ids[start:end], call.logprobs[start:end], call.versions[start])
                start = end
        sample.status = FINISH_STATUS[call.finish_reason]
        sample.metadata["calls"] += 1
        if call.resumes:
            sample.metadata["resumes"] = sample.metadata.get("resumes", 0) + call.resumes
        if call.finish_reason == "abort":
            sample.metadata["resume_limit_hit"] = 1
    return samples


def longest_extended(samples: list[Sample], prompt_ids: list[int]) -> Sample | None:
    """The sample with the longest prompt + response that `prompt_ids` starts with, or None."""
    best, best_len = None, -1
    for sample in samples:
        tokens = sample.prompt_tokens + sample.response_tokens
        if best_len < len(tokens) <= len(prompt_ids) and prompt_ids[:len(tokens)] == tokens:
            best, best_len = sample, len(tokens)
    return best
