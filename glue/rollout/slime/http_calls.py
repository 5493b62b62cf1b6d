"""How slime's functions reach the fleet: `post` and `get` (slime.utils.http_utils). `post` sends the run's API key
to the router (sgl-router and the engines refuse generation without it) and records every /generate answer for the
sample being generated (`recording`), so sluice knows the weight version of each token the function keeps."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
from dataclasses import dataclass, field
from typing import Any, Iterator

from glue.rollout.slime.sample import versions_of


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


_fleet_of_all_threads: Fleet | None = None  # `serving_all_threads`: for threads a function starts (no contextvars)


@contextlib.contextmanager
def serving_all_threads(fleet: Fleet) -> Iterator[None]:
    """Within this block `post` authenticates to `fleet` from any thread, also one a long-lived rollout function
    starts itself (a new thread starts without the context `serving` sets)."""
    global _fleet_of_all_threads
    previous, _fleet_of_all_threads = _fleet_of_all_threads, fleet
    try:
        yield
    finally:
        _fleet_of_all_threads = previous


def current_fleet() -> Fleet | None:
    return _fleet.get() or _fleet_of_all_threads


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

    fleet = current_fleet()
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

    fleet = current_fleet()
    headers = {"Authorization": f"Bearer {fleet.api_key}"} if fleet and fleet.api_key and \
        url.startswith(fleet.router_url) else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers) as resp:
            resp.raise_for_status()
            return _json(await resp.text(), url)


