"""The embedded engine's HTTP front: SGLang's endpoints and JSON field names on aiohttp, in front of the model runner.

The subset sluice uses (generate, pause/continue, abort, weights by broadcast / tensor handles / disk, the weights
checker, versions, memory release/resume for colocated placement, health, info), so
the same client code drives this engine on CPU and real SGLang servers on GPUs.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from glue.embedded_engine.model_runner import PAUSE_MODES, MemoryReleasedError, ModelRunner, Sequence
from glue.embedded_engine.request_schema import RequestError, parse_generate
from glue.embedded_engine.weight_update import WeightReceiver, check_update_payload, check_weight_version

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(message: str, field: str | None = None, status: int = 400) -> web.Response:
    """SGLang's error shape, `{"error": {"message": ...}}`, plus the offending field's name when there is one."""
    error: dict[str, Any] = {"message": message}
    if field is not None:
        error["field"] = field
    return web.json_response({"error": error}, status=status)


async def read_object(request: web.Request, *, empty_ok: bool = True) -> dict[str, Any]:
    """The request's JSON object; a missing (unless `empty_ok`), malformed or non-object body is a RequestError."""
    raw = await request.read()
    if not raw.strip():
        if empty_ok:
            return {}
        raise RequestError("body", "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RequestError("body", f"the request body is not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise RequestError("body", f"must be a JSON object, got {type(body).__name__}")
    return body


@web.middleware
async def bad_request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every payload problem becomes a 400 naming the field, never a 500 or a crash."""
    try:
        return await handler(request)
    except RequestError as e:
        return error_response(str(e), e.field)


def weight_versions(seq: Sequence) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions`: spans of output tokens produced by one weight version each."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(seq.versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def format_output(seq: Sequence) -> dict[str, Any]:
    """One `/generate` result in SGLang's shape (no "text": the embedded engine has no tokenizer)."""
    spans = weight_versions(seq)
    meta: dict[str, Any] = {
        "id": seq.request.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.request.input_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "weight_version": spans[-1]["version"] if spans else seq.final_version,
        "weight_versions": spans,
        "e2e_latency": seq.finished_at - seq.created_at,
    }
    if seq.request.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
        meta["output_token_logprobs_length"] = len(seq.output_ids)
    return {"output_ids": list(seq.output_ids), "meta_info": meta}


def update_response(ok: bool, message: str, checksums: list[str] | None, **extra: Any) -> web.Response:
    """SGLang's `{"success", "message"}` answer plus `checksums`, one per bucket received (sluice's verification)."""
    body: dict[str, Any] = {"success": ok, "message": message, **extra}
    if checksums is not None:
        body["checksums"] = checksums
    return web.json_response(body, status=200 if ok else 400)


MEMORY_TAGS = ("weights", "kv_cache")  # sglang.srt.constants GPU_MEMORY_TYPE_WEIGHTS / _KV_CACHE


def memory_tags(body: dict[str, Any]) -> set[str]:
    """The `tags` of a memory-occupation request as a set; null or absent means every tag."""
    tags = body.get("tags")
    if tags is None:
        return set(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
        raise RequestError("tags", f"must be null or a list of {list(MEMORY_TAGS)}, got {tags!r}")
    return set(tags)


class EngineServer:
    """Routes SGLang's HTTP API to a `ModelRunner` and a `WeightReceiver`."""

    def __init__(self, runner: ModelRunner, receiver: WeightReceiver, *, vocab_size: int, max_context: int,
                 model_info: dict[str, Any], server_info: dict[str, Any]):
        self.runner = runner
        self.receiver = receiver
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.model_info = model_info
        self.server_info = server_info
        self._rids = itertools.count()
        self.started_at = time.time()

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024**2, middlewares=[bad_request_middleware])
        get = {"/health": self.health, "/health_generate": self.health_generate, "/get_model_info": self.get_model_info,
               "/model_info": self.get_model_info, "/get_server_info": self.get_server_info,
               "/server_info": self.get_server_info, "/get_weight_version": self.get_weight_version,
               "/weight_version": self.get_weight_version, "/flush_cache": self.flush_cache}
        post = {"/generate": self.generate, "/pause_generation": self.pause_generation,
                "/continue_generation": self.continue_generation, "/abort_request": self.abort_request,
                "/flush_cache": self.flush_cache, "/init_weights_update_group": self.init_weights_update_group,
                "/destroy_weights_update_group": self.destroy_weights_update_group,
                "/update_weights_from_distributed": self.update_weights_from_distributed,
                "/update_weights_from_tensor": self.update_weights_from_tensor,
                "/update_weights_from_disk": self.update_weights_from_disk, "/weights_checker": self.weights_checker,
                "/update_weight_version": self.update_weight_version,
                "/release_memory_occupation": self.release_memory_occupation,
                "/resume_memory_occupation": self.resume_memory_occupation}
        app.router.add_routes([web.get(p, h) for p, h in get.items()] + [web.post(p, h) for p, h in post.items()])
        app.router.add_route("PUT", "/generate", self.generate)
        app.router.add_route("GET", "/weights_checker", self.weights_checker)
        return app

    # ---- generation ----
    async def run_requests(self, requests: list) -> list[Sequence]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]

        def resolver(fut: asyncio.Future) -> Callable[[Sequence], None]:
            return lambda seq: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(seq))

        try:
            for req, fut in zip(requests, futures):
                self.runner.submit(req, resolver(fut))
        except MemoryReleasedError as e:
            for req in requests:
                self.runner.abort(rid=req.rid)
            raise RequestError("memory", str(e)) from None
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # the client went away: free the rows it was holding
            for req in requests:
                self.runner.abort(rid=req.rid)
            raise

    async def generate(self, request: web.Request) -> web.Response:
        body = await read_object(request, empty_ok=False)
        requests, is_batch = parse_generate(body, vocab_size=self.vocab_size, max_context=self.max_context,
                                            next_rid=lambda: f"embedded-{next(self._rids)}")
        outputs = [format_output(seq) for seq in await self.run_requests(requests)]
        return web.json_response(outputs if is_batch else outputs[0])

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token; while generation is deliberately paused the engine is healthy without it."""
        if self.runner.is_paused or self.runner.released:
            return web.Response(status=200)
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "rid": f"HEALTH_CHECK_{next(self._rids)}"}
        requests, _ = parse_generate(body, vocab_size=self.vocab_size, max_context=self.max_context, next_rid=None)
        await self.run_requests(requests)
        return web.Response(status=200)

    # ---- information ----
    async def get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.model_info, "weight_version": self.runner.weight_version})

    async def get_server_info(self, request: web.Request) -> web.Response:
        state = {**self.runner.load(), "forward_count": self.runner.forward_count, "is_paused": self.runner.is_paused,
                 "memory_released": sorted(self.runner.released), "weight_bytes": self.runner.weight_bytes()}
        return web.json_response({**self.server_info, "weight_version": self.runner.weight_version,
                                  "internal_states": [state], "startup_time": self.started_at})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.runner.weight_version})

    # ---- control ----
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return error_response(f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}", "mode")
        await asyncio.to_thread(self.runner.pause, mode)  # answers once no forward runs (see ModelRunner.pause)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.runner.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        if not isinstance(body.get("rid", ""), (str, type(None))):
            return error_response("rid must be a string (or set abort_all to true)", "rid")
        if not isinstance(body.get("abort_all", False), bool):
            return error_response("abort_all must be true or false", "abort_all")
        self.runner.abort(rid=body.get("rid") or None, abort_all=body.get("abort_all", False))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache to flush: each request's KV lives only while it runs."""
        return web.Response(text="Cache flushed.\n", status=200)

    # ---- memory occupation (SGLang's Release/ResumeMemoryOccupationReqInput: `tags`, null = all) ----
    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = memory_tags(await read_object(request))
        await asyncio.to_thread(self.runner.release_memory, tags)
        if "weights" in tags:
            await asyncio.to_thread(self.receiver.drop_parameter_homes)
        return web.json_response({"success": True, "message": f"released {sorted(tags)}"})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = memory_tags(await read_object(request))
        await asyncio.to_thread(self.runner.resume_memory, tags)
        return web.json_response({"success": True, "message": f"resumed {sorted(tags)}"})

    # ---- weights ----
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_object(request, empty_ok=False)
        types = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int,
                 "group_name": str, "backend": str}
        for name, kind in types.items():
            if name in ("group_name", "backend") and name not in body:
                continue
            if isinstance(body.get(name), bool) or not isinstance(body.get(name), kind):
                return error_response(f"{name} must be a {kind.__name__}, got {body.get(name)!r}", name)
        ok, message = await asyncio.to_thread(
            self.receiver.init_group, master_address=body["master_address"], master_port=body["master_port"],
            rank_offset=body["rank_offset"], world_size=body["world_size"],
            group_name=body.get("group_name", "weight_update_group"), backend=body.get("backend", "nccl"))
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        ok, message = await asyncio.to_thread(self.receiver.destroy_group, body.get("group_name", "weight_update_group"))
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_object(request, empty_ok=False)
        problem = check_update_payload(body)
        if problem is not None:
            return web.json_response({"success": False, "message": problem}, status=400)
        if body.get("abort_all_requests"):
            self.runner.abort(abort_all=True)
        ok, message, sums = await asyncio.to_thread(
            self.receiver.update_from_distributed, names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"],
            group_name=body.get("group_name", "weight_update_group"), weight_version=body.get("weight_version"),
            load_format=body.get("load_format"))
        return update_response(ok, message, sums)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's colocated route; here `serialized_named_tensors` holds shared-memory bucket handles."""
        body = await read_object(request, empty_ok=False)
        handles = body.get("serialized_named_tensors")
        if not isinstance(handles, list) or not all(isinstance(h, str) for h in handles):
            return update_response(False, "serialized_named_tensors must be a list of base64 strings", None)
        if body.get("load_format") != "flattened_bucket":
            return update_response(False, f"load_format {body.get('load_format')!r} is not supported by the embedded "
                                          "engine; send shared-memory buckets with load_format 'flattened_bucket'", None)
        if (problem := check_weight_version(body)) is not None:
            return update_response(False, problem, None)
        if body.get("abort_all_requests"):
            self.runner.abort(abort_all=True)
        try:
            ok, message, sums = await asyncio.to_thread(self.receiver.update_from_tensor, handles=handles,
                                                        weight_version=body.get("weight_version"))
        except (ValueError, OSError) as e:  # a bad or stale handle: refused, nothing loaded
            return update_response(False, str(e), None)
        return update_response(ok, message, sums)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_object(request, empty_ok=False)
        if not isinstance(body.get("model_path"), str):
            return update_response(False, f"model_path must be a string, got {body.get('model_path')!r}", None)
        if (problem := check_weight_version(body)) is not None:
            return update_response(False, problem, None)
        if body.get("abort_all_requests"):
            self.runner.abort(abort_all=True)
        ok, message, sums = await asyncio.to_thread(self.receiver.update_from_disk, model_path=body["model_path"],
                                                    weight_version=body.get("weight_version"))
        return update_response(ok, message, sums, num_paused_requests=0)

    async def weights_checker(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        answer = await asyncio.to_thread(self.receiver.check_weights, body.get("action", "checksum"))
        return web.json_response(answer, status=200 if answer["success"] else 400)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_object(request, empty_ok=False)
        version = body.get("new_version")
        if not isinstance(version, str):
            return web.json_response({"success": False, "message": f"new_version must be a string, got {version!r}"},
                                     status=400)
        if body.get("abort_all_requests", True):
            self.runner.abort(abort_all=True)
        self.runner.set_weight_version(version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})
