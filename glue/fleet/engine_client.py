"""The narrow client sluice uses to talk to engines over SGLang's HTTP API: `generate` goes through the router
(async, used by rollout functions); control calls (pause / continue / flush / weight versions / health) go to
every engine directly and are plain blocking calls (the loop runs them in a worker thread, so generation goes on).

Sync vs async: `await client.generate(...)` inside an event loop (the rollout manager runs one per step or keeps
one for the run; the aiohttp session follows whichever loop is running). Control methods block for one short
HTTP round trip per engine and may be called from anywhere, including from inside a running loop.
"""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from weight_sync.engine_calls import admin_key, bearer, run_together

if TYPE_CHECKING:
    import aiohttp


@runtime_checkable
class GenerateClient(Protocol):
    """What a rollout function depends on: one SGLang-style generate call."""

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                       routed_experts_start_len: int | None = None) -> dict:
        """POST /generate; returns SGLang's JSON answer (`output_ids`, `meta_info`, ...). `routed_experts_start_len`
        (routing replay only; doubles that never see it may leave it out) asks for `meta_info.routed_experts`."""
        ...


RETRIED_STATUSES = (502, 503, 504)  # the router had no engine to take the request: worth sending again


class EngineHTTPError(RuntimeError):
    """An engine or the router answered with a non-2xx status."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url} answered HTTP {status}: {body[:2000]}")
        self.url, self.status, self.body = url, status, body


def weight_version_to_int(version: Any) -> int:
    """SGLang weight versions are strings; sluice tags them with integers. A fresh SGLang server reports
    "default", which is the initial weights, version 0."""
    if isinstance(version, int):
        return version
    text = str(version).strip()
    if text in ("default", ""):
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"engine weight_version {version!r} is not an integer; sluice tags weights with integer versions "
            "(start the engine without a custom --weight-version, or let the weight bridge set it)"
        ) from None


class EngineClient:
    """`generate` through the router; control calls to each engine. Connection errors on generate (an answer cut
    off counts: the router died while sending it), and the router's 502 / 503 / 504 (no engine could take the
    request, e.g. the only one died and is being restarted), are
    retried `max_connect_retries` times with a growing pause (counted in `connect_retries`); other HTTP errors are
    not. `engine_urls` is held, not copied: the fleet replaces a restarted engine's url in that list.

    `api_key` / `admin_api_key`: the keys the engines (and the router, `--api-key`) were started with, sent as
    `Authorization: Bearer` on generation / info calls and on control calls (SGLang's admin routes) respectively."""

    def __init__(self, router_url: str, engine_urls: list[str], *, request_timeout_s: float = 3600.0,
                 control_timeout_s: float = 60.0, max_connect_retries: int = 6, retry_backoff_s: float = 0.5,
                 api_key: str | None = None, admin_api_key: str | None = None):
        self.router_url = router_url.rstrip("/")
        self.engine_urls = engine_urls
        self.api_key, self.admin_key = api_key, admin_key(api_key, admin_api_key)
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_connect_retries = max_connect_retries
        self.retry_backoff_s = retry_backoff_s
        self.connect_retries = 0  # metric: generate requests sent again after a connection error or a 502-504
        self.pauses = 0  # pause_generation calls so far: a generate spanning one must say where versions change
        self._pause_modes: list[str] = []  # the mode of each pause so far, in order
        self._calls_by_pause: dict[int, int] = {}  # generate calls in flight, by the pause count when they started
        self._session: "aiohttp.ClientSession | None" = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._in_flight_by_url: dict[str, int] = {}  # generate calls in flight by target (router or engine) URL
        self._next_engine = -1  # where the next tie among engines starts (`_pick_engine`)

    # ---------------------------------------------------------------- generation (async, via the router)
    def _get_session(self) -> "aiohttp.ClientSession":
        """One shared session per running event loop (aiohttp sessions cannot cross loops)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            self._discard_session()
            connector = aiohttp.TCPConnector(limit=0)  # concurrency is bounded by the caller, not the pool
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=bearer(self.api_key))
            self._session_loop = loop
        return self._session

    def _discard_session(self) -> None:
        """Drop a session left over from a loop that has finished (asyncio.run per step): close its sockets."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            connector = session.connector
            session.detach()
            if connector is not None:
                connector._close()  # the synchronous part of close(): the old loop can no longer be awaited on

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                       routed_experts_start_len: int | None = None, logprob_start_len: int | None = None) -> dict:
        """POST {router}/generate with SGLang's fields; returns the engine's JSON answer. `logprob_start_len=n` also
        asks for `meta_info.input_token_logprobs` of input positions n .. end (SGLang's prompt scoring).

        `routed_experts_start_len=n` asks for SGLang's `return_routed_experts` (MoE routing of positions n .. end,
        for routing replay). sgl-router 0.3.2 re-serialises /generate through its own field list and drops that
        field (tests/test_routed_experts.py shows it), and it cannot be asked which worker it would pick, so such
        a request goes to one engine directly: the one with the fewest of this client's direct requests in
        flight, ties taken in turn (`_pick_engine`). Other generates keep going through the router."""
        payload = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                   "return_logprob": return_logprob}
        if logprob_start_len is not None:
            payload["logprob_start_len"] = int(logprob_start_len)
        target = lambda: f"{self.router_url}/generate"  # noqa: E731
        if routed_experts_start_len is not None:
            payload.update(return_routed_experts=True, routed_experts_start_len=int(routed_experts_start_len))
            target = self._pick_engine
        pauses_before = self.pauses
        self._calls_by_pause[pauses_before] = self._calls_by_pause.get(pauses_before, 0) + 1
        try:
            return await self._generate(target, payload, pauses_before)
        finally:
            self._calls_by_pause[pauses_before] -= 1

    def _pick_engine(self) -> str:
        """The /generate URL of the engine with the fewest direct requests in flight from this client (the count
        is `_in_flight_by_url`, kept by `_generate`); ties go round in turn so equal loads spread. A retry picks
        again, so a request whose engine went away lands on another one (or on its restarted replacement)."""
        if not self.engine_urls:
            raise ConnectionError("generate: no engines to send a return_routed_experts request to")
        n = len(self.engine_urls)
        self._next_engine = (self._next_engine + 1) % n
        order = [self.engine_urls[(self._next_engine + i) % n] for i in range(n)]
        return f"{min(order, key=lambda url: self._in_flight_by_url.get(url, 0))}/generate"

    async def calls_settled(self, timeout_s: float = 60.0, quiet_s: float = 1.0) -> bool:
        """Wait until every generate call that started before the last pause has returned (after a pause with
        mode "abort" the engines answer them at once; what the callers do next queues behind the pause). A call
        still on its way when the engines paused (in the router, or arriving while the pause was being applied)
        is held behind the pause like a new one and answers only after `continue_generation`, so the wait also
        ends once no such call has returned for `quiet_s`: the aborted answers come back within milliseconds.
        True if every call returned; False if some were held (quiet_s) or still out after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending, last_change = self._calls_before_pause(), loop.time()
        while pending:
            now = loop.time()
            if now > deadline or now - last_change > quiet_s:
                return False
            await asyncio.sleep(0.01)
            if (left := self._calls_before_pause()) != pending:
                pending, last_change = left, loop.time()
        return True

    def _calls_before_pause(self) -> int:
        return sum(n for epoch, n in self._calls_by_pause.items() if epoch < self.pauses)

    async def _generate(self, target: Callable[[], str], payload: dict, pauses_before: int) -> dict:
        import aiohttp

        attempt = 0
        while True:
            url = target()
            base = url.removesuffix("/generate")
            self._in_flight_by_url[base] = self._in_flight_by_url.get(base, 0) + 1
            try:
                async with self._get_session().post(url, json=payload) as resp:
                    body = await resp.text()
                    if resp.status // 100 != 2:
                        raise EngineHTTPError(url, resp.status, body)
                    return self._checked_versions(json.loads(body), pauses_before)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError, EngineHTTPError) as err:
                if isinstance(err, EngineHTTPError) and err.status not in RETRIED_STATUSES:
                    raise
                if attempt >= self.max_connect_retries:
                    raise ConnectionError(
                        f"generate: {url} could not serve it after {attempt + 1} attempts ({err}); "
                        "is the fleet running?"
                    ) from err
                attempt += 1
                self.connect_retries += 1
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            finally:
                self._in_flight_by_url[base] -= 1

    def _checked_versions(self, answer: Any, pauses_before: int) -> Any:
        """Refuse an answer that a sync may have split without saying where: SGLang servers report one
        `weight_version` per request, which is right only if no weights changed while it ran. The embedded engine
        reports per-token `weight_versions` spans. An answer is whole on one version if no pause came while it was
        out, if it was aborted by the pause, or if every pause since it was sent was an "abort" one: such a pause
        ends every request the engine holds, so an answer that finished normally reached the engine after it (it
        waited behind the pause) and ran wholly on the weights after it, the version in its meta_info."""
        if self.pauses == pauses_before or all(mode == "abort" for mode in self._pause_modes[pauses_before:]):
            return answer
        for output in answer if isinstance(answer, list) else [answer]:
            meta = output.get("meta_info") if isinstance(output, dict) else None
            if not isinstance(meta, dict) or meta.get("weight_versions"):
                continue
            finish = meta.get("finish_reason")
            if (finish.get("type") if isinstance(finish, dict) else finish) != "abort":
                raise ValueError("a weight sync landed while this request was generating and the engine's answer "
                                 "has no per-token meta_info.weight_versions, so sluice cannot tell which tokens "
                                 "came from which weights; use sync.pause_mode: abort with such engines")
        return answer

    async def aclose(self) -> None:
        """Close the generate session (await it on the loop that used it last)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    close = aclose  # the same coroutine under aiohttp's name

    # ---------------------------------------------------------------- control (sync, to every engine)
    def _call(self, url: str, method: str = "POST", body: dict | None = None,
              key: str | None = None) -> tuple[int, str]:
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **bearer(key)})
        try:
            with urllib.request.urlopen(req, timeout=self.control_timeout_s) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")

    def _call_all(self, path: str, method: str = "POST", body: dict | None = None) -> list[str]:
        """The same control call (an admin route) on every engine at once: a pause costs the slowest engine's
        answer, not the sum."""
        def call(engine: str) -> str:
            status, text = self._call(f"{engine}{path}", method, body, self.admin_key)
            if status // 100 != 2:
                raise EngineHTTPError(f"{engine}{path}", status, text)
            return text

        return run_together([lambda e=e: call(e) for e in self.engine_urls], self.control_timeout_s)

    def pause_generation(self, mode: str = "retract") -> None:
        """Stop every engine from generating. SGLang modes: "abort" (answer in-flight requests now with finish
        reason abort), "retract" / "in_place" (keep them; they resume on continue, on the new weights if the
        weights changed meanwhile). "retract" is the default because SGLang can flush its cache in that mode."""
        self.pauses += 1
        self._pause_modes.append(mode)
        self._call_all("/pause_generation", body={"mode": mode})

    def continue_generation(self) -> None:
        self._call_all("/continue_generation")

    def flush_cache(self) -> None:
        self._call_all("/flush_cache")

    def weight_versions(self) -> list[str]:
        """Each engine's current weight version string, in `engine_urls` order (`weight_version_to_int` for ints)."""
        versions = []
        for engine in self.engine_urls:  # SGLang 0.5.23 reports it in /model_info (it has no /get_weight_version)
            status, text = self._call(f"{engine}/model_info", "GET", key=self.api_key)
            if status // 100 != 2:
                raise EngineHTTPError(f"{engine}/model_info", status, text)
            versions.append(str(json.loads(text)["weight_version"]))
        return versions

    def health(self) -> list[bool]:
        """Whether each engine answers GET /health with 2xx (connection errors count as unhealthy; SGLang leaves
        /health open, the api key goes along for servers that do not)."""
        result = []
        for engine in self.engine_urls:
            try:
                status, _ = self._call(f"{engine}/health", "GET", key=self.api_key)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                status = 0
            result.append(status // 100 == 2)
        return result
