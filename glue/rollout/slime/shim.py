"""The few `slime` modules that slime's rollout and reward functions import, for running them where slime is not
installed: `slime.utils.types.Sample`, `slime.utils.http_utils.post / get`, `slime.utils.misc.load_function`,
`slime.rollout.sglang_rollout.GenerateState / generate` and `slime.rollout.base_types`, with the rule-based
rewards of `slime.rollout.rm_hub` (glue.rollout.slime.rm_hub) and the rest of `slime.utils` that functions import
(glue.rollout.slime.utils). `install()` registers them
(only when `import slime` would fail); an installed slime is left alone.

`post` is how a function reaches the fleet: it sends the run's API key to the router (sgl-router and the engines
refuse generation without it) and records every /generate answer for the sample being generated (`recording`), so
sluice knows the weight version of each token the function keeps.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Iterator

from glue.rollout.slime import rm_hub, utils
from glue.rollout.slime.sample import Sample, versions_of


@dataclass
class Fleet:
    """Where slime functions reach the engines: the router URL and the key it asks for."""

    router_url: str
    api_key: str | None = None


@dataclass
class GenerateCall:
    """One /generate answer posted for a sample: where its output starts in the sample's tokens and its versions."""

    input_len: int
    output_ids: list[int]
    versions: list[int]


@dataclass
class Recording:
    calls: list[GenerateCall] = field(default_factory=list)


_fleet: contextvars.ContextVar[Fleet | None] = contextvars.ContextVar("slime_fleet", default=None)
_recording: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("slime_recording", default=None)


@contextlib.contextmanager
def serving(fleet: Fleet) -> Iterator[None]:
    """Within this block (and the tasks it starts) `post` authenticates to `fleet`."""
    token = _fleet.set(fleet)
    try:
        yield
    finally:
        _fleet.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """The /generate answers `post` gets within this block (this task and the tasks it starts)."""
    record = Recording()
    token = _recording.set(record)
    try:
        yield record
    finally:
        _recording.reset(token)


async def post(url: str, payload: dict, max_retries: int = 60, headers: dict | None = None) -> Any:
    """slime's `post`: JSON in, JSON out; connection errors and 5xx answers are tried again (at most
    `max_retries` times, 1 s apart). Requests to the run's fleet carry its API key."""
    import aiohttp

    fleet = _fleet.get()
    headers = dict(headers or {})
    if fleet is not None and fleet.api_key and url.startswith(fleet.router_url):
        headers.setdefault("Authorization", f"Bearer {fleet.api_key}")
    for attempt in range(max_retries + 1):
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                async with session.post(url, json=payload, headers=headers) as resp:
                    body = await resp.text()
                    if resp.status < 500 or attempt == max_retries:
                        if resp.status // 100 != 2:
                            raise RuntimeError(f"POST {url} answered {resp.status}: {body[:300]}")
                        answer = _json(body, url)
                        break
        except aiohttp.ClientConnectionError:
            if attempt == max_retries:
                raise
        await asyncio.sleep(1.0)
    if url.rstrip("/").endswith("/generate"):
        _record(payload, answer)
    return answer


def _json(body: str, url: str) -> Any:
    import json

    try:
        return json.loads(body)
    except ValueError:
        return body  # slime returns the text of an answer that is not JSON


def _record(payload: dict, answer: Any) -> None:
    record = _recording.get()
    for output in answer if isinstance(answer, list) else [answer]:
        meta = output.get("meta_info") if isinstance(output, dict) else None
        if record is None or not isinstance(meta, dict) or not (meta.get("weight_versions") or "weight_version" in meta):
            continue
        entries = meta.get("output_token_logprobs")
        ids = [int(e[1]) for e in entries] if entries else list(output.get("output_ids") or [])
        input_ids = payload.get("input_ids")
        start = len(input_ids) if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], int) \
            else int(meta.get("prompt_tokens", -1))
        record.calls.append(GenerateCall(input_len=start, output_ids=ids, versions=versions_of(meta, len(ids))))


async def get(url: str) -> Any:
    import aiohttp

    fleet = _fleet.get()
    headers = {"Authorization": f"Bearer {fleet.api_key}"} if fleet and fleet.api_key and \
        url.startswith(fleet.router_url) else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers) as resp:
            resp.raise_for_status()
            return _json(await resp.text(), url)


def load_function(path: str) -> Any:
    """slime's `load_function`: 'package.module.function'."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


# How slime's rollout decodes (sglang_rollout.GenerateState's sampling_params): special tokens kept in the text
# (--rollout-skip-special-tokens off), a matched stop string kept at the end of it, no spaces added between
# special tokens; slime's functions rely on this, e.g. search-r1 finding "</search>" at the end of a turn's text.
SLIME_TEXT_PARAMS = {"skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}


class GenerateState:
    """slime's per-process generation state, as far as functions read it: the tokenizer of `args.hf_checkpoint`
    and the run's sampling_params (one per process, like slime's singleton)."""

    _instance: "GenerateState | None" = None

    def __new__(cls, args: Any) -> "GenerateState":
        if cls._instance is None or cls._instance.args is not args:
            from transformers import AutoTokenizer

            state = super().__new__(cls)
            state.args = args
            state.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
            state.processor = None
            state.sampling_params = dict(temperature=args.rollout_temperature, top_p=args.rollout_top_p,
                                         top_k=args.rollout_top_k, max_new_tokens=args.rollout_max_response_len,
                                         **SLIME_TEXT_PARAMS)
            state.semaphore = asyncio.Semaphore(args.sglang_server_concurrency)
            cls._instance = state
        return cls._instance

    def __init__(self, args: Any) -> None:
        pass


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    """slime's default generate: one /generate call through the router continuing `sample.tokens`."""
    params = dict(sampling_params)
    params["max_new_tokens"] -= sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": list(sample.tokens), "sampling_params": params, "return_logprob": True})
    entries = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(args, tokens=[e[1] for e in entries], log_probs=[e[0] for e in entries],
                                  trainable=True, meta_info=output["meta_info"], text=output.get("text", ""))
    return sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


MODULES = {
    "slime.utils.types": {"Sample": Sample},
    "slime.utils.http_utils": {"post": post, "get": get},
    "slime.utils.misc": {"load_function": load_function},
    "slime.rollout.sglang_rollout": {"GenerateState": GenerateState, "generate": generate},
    "slime.rollout.base_types": {"RolloutFnTrainOutput": RolloutFnTrainOutput,
                                 "RolloutFnEvalOutput": RolloutFnEvalOutput},
}


def install() -> bool:
    """Register the `slime` modules above unless slime itself imports; True when they were (or are) installed."""
    if getattr(sys.modules.get("slime"), "__sluice_shim__", False):
        return True
    if importlib.util.find_spec("slime") is not None:
        return False
    for name, attrs in (entry for table in (MODULES, rm_hub.MODULES, utils.MODULES) for entry in table.items()):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            module_name = ".".join(parts[:depth])
            if module_name not in sys.modules:
                module = types.ModuleType(module_name, "sluice's stand-in for slime (glue.rollout.slime.shim)")
                module.__path__ = []  # a package, so the next level imports
                module.__sluice_shim__ = True
                sys.modules[module_name] = module
                if depth > 1:
                    setattr(sys.modules[".".join(parts[:depth - 1])], parts[depth - 1], module)
        vars(sys.modules[name]).update(attrs)
    return True
