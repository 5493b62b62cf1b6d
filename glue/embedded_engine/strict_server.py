"""--sglang-strict: the embedded engine answering exactly as SGLang 0.5.23 does on every route sluice calls (request
structs, reply shapes, weight-update sessions, flush / pause / abort semantics, health, memory, the weights checker),
so sluice's production path is exercised on CPU against SGLang's behaviour, not this engine's conveniences."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import time
from typing import Any, AsyncIterator

from aiohttp import web

from glue.embedded_engine.json_body import describe
from glue.embedded_engine.sequence import Sequence
from glue.embedded_engine.request_schema import RequestError, parse_generate
from glue.embedded_engine.routes import ROUTES, Route
from glue.embedded_engine.server import MEMORY_TAGS, EngineServer, memory_tags
from glue.embedded_engine.sglang_layout import checker_ranks, per_engine_checksum
from glue.embedded_engine.strict_schema import (
    DISK_OK, DISTRIBUTED_OK, FLUSH_DONE, FLUSH_FAILED, FLUSH_REFUSED_AFTER_UPDATE, FLUSH_TIMED_OUT, HEALTH_CHECK_TIMEOUT_S,
    NO_SESSION_OPEN, NOT_IN_SGLANG, OUTSIDE_SESSION, RELEASE_NOT_IDLE, SELECTORS, SESSION_ALREADY_OPEN, STRICT_BODIES,
    TENSOR_OK, strict_output,
)
from glue.embedded_engine.weight_update import check_update_payload

ALL_MEMORY_TAGS = (*MEMORY_TAGS, "cuda_graph")  # sglang.srt.constants GPU_MEMORY_ALL_TYPES
# SGLang's SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION (default on): /health generates a token as /health_generate does.
HEALTH_GENERATES = os.getenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("1", "true", "yes")


def reply(ok: bool, message: str, **extra: Any) -> web.Response:
    """SGLang's `{"success", "message"}` reply: 200, or 400 when refused."""
    return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)


class UpdateLock:
    """SGLang's `model_update_lock` (a reader-writer lock): every generation holds it shared; a weight update while
    the engine is not paused holds it exclusively, so it waits for in-flight requests and new ones wait for it."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


@web.middleware
async def validation_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """A body that does not fit its struct answers SGLang's validation error: 400 with an ErrorResponse."""
    try:
        return await handler(request)
    except RequestError as e:
        return web.json_response({"object": "error", "message": str(e)[:2000], "type": "Bad Request", "param": None,
                                  "code": e.status}, status=e.status)


def scheduler_crash(error: str) -> None:
    """What SGLang does when its scheduler raises on a control request (scheduler.py run_scheduler_process: log,
    SIGQUIT to the server, which kills its process tree): the request gets no answer and the engine is gone."""
    print(f"Scheduler hit an exception: {error}\nSIGQUIT received. It usually means one child failed.",
          file=sys.stderr, flush=True)
    os._exit(1)


class StrictEngineServer(EngineServer):
    """`EngineServer` with SGLang's semantics wherever they differ from the embedded engine's conveniences."""

    def __init__(self, *args: Any, tp_size: int = 1, enable_memory_saver: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tp_size = tp_size
        self.enable_memory_saver = enable_memory_saver  # without it SGLang's memory routes change nothing
        self.session: str | None = None  # the open weight-update session's selector
        self.update_lock = UpdateLock()
        # SGLang's update_weights_from_distributed communicator runs one call at a time, queued in arrival order (an
        # asyncio.Lock, FIFO-fair), whatever group each names: updates on different groups never run concurrently
        self.distributed_queue = asyncio.Lock()
        self.startup_version = self.runner.weight_version  # the --weight-version server arg, as /server_info says
        self.served_version = self.runner.weight_version  # the tokenizer's weight_version, as /model_info says
        self.server_status = "Up"
        self.offloaded: set[str] = set()  # SGLang's offload_tags

    def routes(self) -> tuple[Route, ...]:
        """SGLang's routes only, each reading its whole SGLang request struct."""
        return tuple(dataclasses.replace(r, body=STRICT_BODIES[r.path][1]) if r.path in STRICT_BODIES else r
                     for r in ROUTES if r.path not in NOT_IN_SGLANG)

    def error_middleware(self) -> Any:
        return validation_middleware

    def output(self, seq: Sequence) -> dict[str, Any]:
        return strict_output(seq)

    def is_idle(self) -> bool:
        """SGLang's `is_fully_idle(ignore_waiting=paused)`, the condition of flush_cache and memory release."""
        return self.runner.is_idle(ignore_waiting=self.runner.is_paused)

    # ---- generation and health ----
    async def generate(self, body: dict[str, Any]) -> web.Response:
        async with self.update_lock.shared():
            return await super().generate(body)

    async def chat_completions(self, body: dict[str, Any]) -> web.Response:
        async with self.update_lock.shared():
            return await super().chat_completions(body)

    async def health(self, body: dict[str, Any]) -> web.Response:
        return await self.health_generate(body) if HEALTH_GENERATES else web.Response(status=200)

    async def health_generate(self, body: dict[str, Any]) -> web.Response:
        """SGLang's health check: send a one-token request, poll each second whether the engine produced anything
        since; 200 once it has, else 503 after SGLANG_HEALTH_CHECK_TIMEOUT seconds (a paused engine produces
        nothing) and the server marks itself unhealthy."""
        forwards_before = self.runner.forward_count
        probe = asyncio.ensure_future(self._health_probe())
        probe.add_done_callback(lambda task: task.cancelled() or task.exception())
        deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
                if probe.done() or self.runner.forward_count != forwards_before:
                    self.server_status = "Up"
                    return web.Response(status=200)
            self.server_status = "UnHealthy"
            return web.Response(status=503)
        finally:
            probe.cancel()

    async def _health_probe(self) -> None:
        probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                 "rid": f"HEALTH_CHECK_{next(self._rids)}"}
        requests, _ = parse_generate(probe, vocab_size=self.vocab_size, max_context=self.max_context, next_rid=None)
        async with self.update_lock.shared():
            await self.run_requests(requests)

    # ---- information ----
    async def get_model_info(self, body: dict[str, Any]) -> web.Response:
        return web.json_response({**self.model_info, "weight_version": self.served_version, "reasoning_parser": None,
                                  "tool_call_parser": None, "disaggregation_mode": "null"})

    async def get_server_info(self, body: dict[str, Any]) -> web.Response:
        return web.json_response({**self.server_info, "weight_version": self.startup_version,
                                  "internal_states": [self.runner.load()], "startup_time": self.started_at})

    # ---- control ----
    async def abort_request(self, body: dict[str, Any]) -> web.Response:
        """SGLang aborts every request whose rid starts with the given one (scheduler.abort_request), once the rid
        is a live request; an empty rid without abort_all is ignored."""
        rid = body.get("rid") or ""
        if body.get("abort_all", False):
            self.runner.abort(abort_all=True)
        elif rid and self.runner.is_live(rid):
            self.runner.abort(rid=rid, prefix=True)
        return web.Response(status=200)

    def _endpoint(self, route: Route) -> Any:
        if route.path != "/flush_cache":
            return super()._endpoint(route)

        async def flush_endpoint(request: web.Request) -> web.StreamResponse:
            text = request.query.get("timeout", "0")
            try:
                timeout = float(text)
            except ValueError:
                timeout = -1.0
            if not timeout >= 0:  # FastAPI's Query(0.0, ge=0.0)
                raise RequestError("timeout", f"timeout must be a number >= 0, got {describe(text)}")
            return await self.flush_cache({"timeout": timeout})

        return flush_endpoint

    async def flush_cache(self, body: dict[str, Any]) -> web.Response:
        """SGLang's flush: done only when idle; with `?timeout=` seconds it waits that long for idle first
        (scheduler_components/flush_wrapper.py)."""
        deadline = time.monotonic() + body.get("timeout", 0.0)
        while not self.is_idle():
            if time.monotonic() >= deadline:
                return web.Response(text=FLUSH_FAILED if body.get("timeout", 0.0) <= 0 else FLUSH_TIMED_OUT,
                                    status=400)
            await asyncio.sleep(0.05)
        return web.Response(text=FLUSH_DONE, status=200)

    # ---- memory occupation ----
    def _memory_tags(self, body: dict[str, Any]) -> set[str]:
        tags = body.get("tags")
        if not tags:  # null or [] means every type
            return set(ALL_MEMORY_TAGS)
        return memory_tags({"tags": [t for t in tags if t != "cuda_graph"]}) | ({"cuda_graph"} & set(tags))

    async def release_memory_occupation(self, body: dict[str, Any]) -> web.Response:
        """Asserts the engine idle (a failed assert kills an SGLang server); without --enable-memory-saver SGLang's
        adapter is a no-op, so nothing is released. Answers `null`, as SGLang's handler returns nothing."""
        tags = self._memory_tags(body)
        if not self.is_idle():
            scheduler_crash(f"AssertionError: {RELEASE_NOT_IDLE}")
        self.offloaded |= tags
        if self.enable_memory_saver:
            await super().release_memory_occupation({"tags": sorted(tags & set(MEMORY_TAGS))})
        return web.json_response(None)

    async def resume_memory_occupation(self, body: dict[str, Any]) -> web.Response:
        tags = self._memory_tags(body)
        if not tags <= self.offloaded:  # SGLang's offload_tags.remove raises in its scheduler
            scheduler_crash(f"KeyError: {sorted(tags - self.offloaded)[0]!r}")
        self.offloaded -= tags
        if self.enable_memory_saver:
            await super().resume_memory_occupation({"tags": sorted(tags & set(MEMORY_TAGS))})
        return web.json_response(None)

    # ---- weight-update session ----
    def _selector(self, body: dict[str, Any]) -> str:
        selector = body.get("selector", "all")
        if selector not in SELECTORS:
            raise RequestError("selector", f"selector must be one of {list(SELECTORS)}, got {describe(selector)}")
        return selector

    async def begin_weight_update(self, body: dict[str, Any]) -> web.Response:
        selector = self._selector(body)
        if self.session is not None:
            return reply(False, SESSION_ALREADY_OPEN)
        self.session = selector
        return reply(True, "Success")

    async def end_weight_update(self, body: dict[str, Any]) -> web.Response:
        if self.session is None:
            return reply(False, NO_SESSION_OPEN)
        self.session = None
        return reply(True, "Success")

    @contextlib.asynccontextmanager
    async def _updating(self, body: dict[str, Any]) -> AsyncIterator[None]:
        """What SGLang's tokenizer does around an update: abort everything if asked, then take the update lock
        exclusively unless generation is paused."""
        self._selector(body)
        if body.get("abort_all_requests", False):
            self.runner.abort(abort_all=True)
        if self.runner.is_paused:
            yield
        else:
            async with self.update_lock.exclusive():
                yield

    def _finish_update(self, body: dict[str, Any], ok: bool, message: str) -> tuple[bool, str]:
        """After weights loaded (and their version recorded): SGLang's flush (on unless `flush_cache: false`) fails
        the update while requests run, or are queued in an unpaused engine; only a successful update moves the
        served version (/model_info) and says so."""
        if ok and body.get("flush_cache", True) and not self.is_idle():
            ok, message = False, FLUSH_REFUSED_AFTER_UPDATE
        version = body.get("weight_version")
        if ok and version is not None:
            self.served_version = version
            message += f" Weight version updated to {version}."
        return ok, message

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> web.Response:
        async with self._updating(body):
            if self.session is None:  # refused before the group is touched
                return reply(False, OUTSIDE_SESSION.format(route="update_weights_from_distributed"))
            problem = check_update_payload(body)
            if problem is not None:
                return reply(False, f"Failed to receive weights: {problem}")
            async with self.distributed_queue:
                ok, message, _, _ = await asyncio.to_thread(
                    self.receiver.update_from_distributed, names=body["names"], dtypes=body["dtypes"],
                    shapes=body["shapes"], group_name=body.get("group_name", "weight_update_group"),
                    weight_version=body.get("weight_version"), load_format=body.get("load_format"))
            return reply(*self._finish_update(body, ok, DISTRIBUTED_OK if ok else message))

    async def update_weights_from_tensor(self, body: dict[str, Any]) -> web.Response:
        """Exactly SGLang's payload: one flattened-bucket entry per TP rank (weight_sync.ipc.read_entries); anything
        else is refused before a weight moves (where SGLang's scheduler would raise on it and exit, this says so)."""
        async with self._updating(body):
            if self.session is None:  # refused before the payload is read
                return reply(False, OUTSIDE_SESSION.format(route="update_weights_from_tensor"))
            if body.get("load_format") != "flattened_bucket":
                return reply(False, f"load_format {body.get('load_format')!r} is not supported by the embedded "
                                    "engine; send flattened buckets with load_format 'flattened_bucket'")
            try:
                ok, message, _, _ = await asyncio.to_thread(self.receiver.update_from_tensor,
                                                            handles=body["serialized_named_tensors"],
                                                            weight_version=body.get("weight_version"))
            except (ValueError, OSError) as e:  # a bad or stale entry: nothing loaded
                return reply(False, str(e))
            return reply(*self._finish_update(body, ok, TENSOR_OK if ok else message))

    async def update_weights_from_disk(self, body: dict[str, Any]) -> web.Response:
        async with self._updating(body):
            ok, message, _ = await asyncio.to_thread(self.receiver.update_from_disk, model_path=body["model_path"],
                                                     weight_version=body.get("weight_version"))
            return reply(*self._finish_update(body, ok, DISK_OK if ok else message), num_paused_requests=0)

    async def update_weight_version(self, body: dict[str, Any]) -> web.Response:
        version = body["new_version"]
        if body.get("abort_all_requests", True):
            self.runner.abort(abort_all=True)
        self.runner.set_weight_version(version)
        self.served_version = version
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})

    async def weights_checker(self, body: dict[str, Any]) -> web.Response:
        """Action "checksum" as SGLang answers it (names, shards and per-rank shape; see sglang_layout for the
        hash); SGLang's other actions (snapshot / compare / reset_tensors) are not served here."""
        self._selector(body)
        action = body.get("action", "checksum")
        if action != "checksum":
            return reply(False, f"Unsupported action={action!r}")

        def take() -> list[dict[str, Any]]:
            with self.runner.model_lock:
                return checker_ranks(self.runner.model, self.tp_size)

        ranks = await asyncio.to_thread(take)
        return web.json_response({"success": True, "message": "Success.", "ranks": ranks,
                                  "per_engine_checksum": per_engine_checksum(ranks)})
