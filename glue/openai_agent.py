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
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any

import openai

from glue.engine_client import weight_version_to_int
from glue.types import Sample, SampleStatus

FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "tool_calls": SampleStatus.COMPLETED,
                 "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
ID_HEADERS = {"x-sglext-return-input-ids": "1", "x-sglext-return-output-ids": "1"}
ID_FLAGS = {"logprobs": True, "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}


def _httpx_module() -> Any:
    """The HTTP library the installed openai client is built on (httpx2 in openai 3, httpx before)."""
    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    return importlib.import_module(base.__module__.split(".")[0])


httpx = _httpx_module()


@dataclass(frozen=True, kw_only=True)
class ChatCall:
    """One chat completion as the policy saw and produced it: `versions[i]` is the weight version of completion
    token i; `weight_version` the answer's (for tokens appended around a call that produced none)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    weight_version: int
    finish_reason: str


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


class RecordingTransport(httpx.AsyncBaseTransport):
    """Passes every request to `inner`; chat completions get SGLang's id opt-ins and their answers are recorded."""

    def __init__(self, inner: Any, recorder: "ChatRecorder"):
        self.inner, self.recorder = inner, recorder

    async def handle_async_request(self, request: Any) -> Any:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return await self.inner.handle_async_request(request)
        body = json.loads(await request.aread())
        if body.get("stream"):
            return httpx.Response(400, request=request, json={"error": {
                "message": "sluice records chat completions whole; call with stream=false", "param": "stream"}})
        content = json.dumps({**body, **ID_FLAGS}).encode()
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
        sent = httpx.Request(request.method, request.url, headers=[*headers, *ID_HEADERS.items()], content=content,
                             extensions=request.extensions)
        response = await self.inner.handle_async_request(sent)
        raw = await response.aread()
        if response.status_code == 200:
            self.recorder.record(raw)
        kept = [(k, v) for k, v in response.headers.multi_items()
                if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=kept, content=raw, request=request,
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ChatRecorder:
    """The client of one agent run and what it recorded: `client` is an `openai.AsyncOpenAI` on `base_url`
    (the router's or an engine's url + "/v1"); `calls` the chat completions in the order they were answered.
    Use as `async with ChatRecorder(url) as recorder:`; then `recorder.check()` raises any recording problem."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 3600.0, max_retries: int = 2):
        self.calls: list[ChatCall] = []
        self.problems: list[str] = []
        http_client = openai.DefaultAsyncHttpxClient(transport=RecordingTransport(httpx.AsyncHTTPTransport(), self))
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "sluice", http_client=http_client,
                                         timeout=timeout_s, max_retries=max_retries)

    def record(self, raw: bytes) -> None:
        """Record one answer; a problem is kept (the agent still gets its answer) and raised by `check()`."""
        try:
            self.calls.extend(calls_from_answer(json.loads(raw)))
        except (RecordingError, ValueError, KeyError, TypeError) as e:
            self.problems.append(f"{type(e).__name__}: {e}")

    def check(self) -> None:
        if self.problems:
            raise RecordingError(f"{len(self.problems)} chat completion(s) could not be recorded; first: "
                                 f"{self.problems[0]}")

    async def __aenter__(self) -> "ChatRecorder":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.close()


def trajectory_samples(calls: list[ChatCall]) -> list[Sample]:
    """One `Sample` per policy-visible trajectory. A call whose prompt ids start with a trajectory's prompt +
    response so far extends it (the longest such): the tokens in between (tool output, user turns, the template's
    turn markers) are appended with loss_mask 0 and logprob 0, then the call's completion, trainable. Any other
    call starts a new sample. Status: the last call's finish_reason."""
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
    return samples


def longest_extended(samples: list[Sample], prompt_ids: list[int]) -> Sample | None:
    """The sample with the longest prompt + response that `prompt_ids` starts with, or None."""
    best, best_len = None, -1
    for sample in samples:
        tokens = sample.prompt_tokens + sample.response_tokens
        if best_len < len(tokens) <= len(prompt_ids) and prompt_ids[:len(tokens)] == tokens:
            best, best_len = sample, len(tokens)
    return best
