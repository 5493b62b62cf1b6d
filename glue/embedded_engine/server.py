"""The embedded engine's HTTP front: SGLang's endpoints and JSON field names on aiohttp, in front of the model runner.

The subset sluice uses (generate, pause/continue, abort, weights by broadcast / tensor handles / disk, the weights
checker, versions, memory release/resume for colocated placement, health, info, and OpenAI-compatible chat through
`openai_chat`), so the same client code drives this engine on CPU and real SGLang servers on GPUs. The routing table
(auth level and body fields per route) is `routes.ROUTES`; bodies are checked by `json_body`, keys by `auth`.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from glue.embedded_engine.auth import key_gate
from glue.embedded_engine.json_body import describe, read_body
from glue.embedded_engine.model_runner import PAUSE_MODES, ModelRunner
from glue.embedded_engine.sequence import MemoryReleasedError, Sequence
from glue.embedded_engine.openai_chat import ChatFront
from glue.embedded_engine.prompt_logprobs import input_token_logprobs
from glue.embedded_engine.request_schema import RequestError, parse_generate
from glue.embedded_engine.routed_experts import encode_routed_experts
from glue.embedded_engine.routes import ADMIN_PATHS, ROUTES, Route
from glue.embedded_engine.text_io import output_text
from glue.embedded_engine.weight_update import EMBEDDED_LOAD_FORMATS, WeightReceiver, check_update_payload

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_MESSAGE_CHARS = 2000  # an error message quotes the client's values; never echo a whole body back
# What this engine answers beyond SGLang, advertised in /get_server_info so a client detects rather than assumes it:
# per-bucket `checksums` in update replies, test hooks (forward_count, is_paused, ...) in internal_states, and delta
# buckets on /update_weights_from_distributed (load_format weight_sync.delta.apply_delta).
SLUICE_CAPABILITIES = ("bucket_checksums", "test_hooks", "delta_sync")


def error_response(message: str, field: str | None = None, status: int = 400) -> web.Response:
    """SGLang's error shape, `{"error": {"message": ...}}`, plus the offending field's name when there is one, and
    the `{"success": false, "message"}` of SGLang's update routes, so clients of either shape see the reason."""
    message = message[:MAX_MESSAGE_CHARS]
    error: dict[str, Any] = {"message": message}
    if field is not None:
        error["field"] = field
    return web.json_response({"error": error, "success": False, "message": message}, status=status)


@web.middleware
async def bad_request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every payload problem becomes a 4xx naming the field, never a 500 or a crash."""
    try:
        return await handler(request)
    except RequestError as e:
        return error_response(str(e), e.field, e.status)


def weight_versions(seq: Sequence) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions`: spans of output tokens produced by one weight version each."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(seq.versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def with_text(answer: dict[str, Any], seq: Sequence, tokenizer: Any) -> dict[str, Any]:
    """`answer` with SGLang's "text" first, as an engine with a tokenizer answers (one without has none)."""
    if tokenizer is None:
        return answer
    s = seq.request.sampling
    text = output_text(tokenizer, answer["output_ids"], answer["meta_info"]["finish_reason"],
                       no_stop_trim=s.no_stop_trim, skip_special_tokens=s.skip_special_tokens,
                       spaces_between_special_tokens=s.spaces_between_special_tokens)
    return {"text": text, **answer}


def format_output(seq: Sequence) -> dict[str, Any]:
    """One `/generate` result in SGLang's shape, without "text" (`with_text` adds it)."""
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
        meta["input_token_logprobs"] = input_token_logprobs(seq)
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
        meta["output_token_logprobs_length"] = len(seq.output_ids)
    if seq.request.return_routed_experts:
        meta["routed_experts"] = encode_routed_experts(seq.routing, seq.request.routed_experts_start_len,
                                                       len(seq.request.input_ids) + len(seq.output_ids))
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
        raise RequestError("tags", f"must be null or a list of {list(MEMORY_TAGS)}, got {describe(tags)}")
    return set(tags)


def check_group_numbers(body: dict[str, Any]) -> None:
    """An `/init_weights_update_group` request names a TCP port and a rank inside the group (rank 0 is the
    trainer), so that a bad number is refused here rather than deep inside the process-group setup."""
    port, world_size, rank = body["master_port"], body["world_size"], body["rank_offset"]
    if not 0 < port < 65536:
        raise RequestError("master_port", f"master_port must be a TCP port in [1, 65535], got {port}")
    if world_size < 2:
        raise RequestError("world_size", f"world_size must be >= 2 (the trainer and this engine), got {world_size}")
    if not 0 < rank < world_size:
        raise RequestError("rank_offset", f"rank_offset must be in [1, world_size={world_size}), got {rank}")


class EngineServer:
    """Routes SGLang's HTTP API to a `ModelRunner` and a `WeightReceiver`."""

    def __init__(self, runner: ModelRunner, receiver: WeightReceiver, *, vocab_size: int, max_context: int,
                 model_info: dict[str, Any], server_info: dict[str, Any], api_key: str | None = None,
                 admin_api_key: str | None = None, tokenizer: Any = None):
        self.runner = runner
        self.tokenizer = tokenizer  # the model directory's (text_io.load_tokenizer), or None: token ids only
        self.receiver = receiver
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.model_info = model_info
        self.server_info = server_info
        self._rids = itertools.count()
        self.started_at = time.time()
        self.api_key, self.admin_api_key = api_key, admin_api_key  # SGLang's --api-key / --admin-api-key
        self.chat = ChatFront(model_path=model_info["model_path"], served_model_name=model_info["served_model_name"],
                              vocab_size=vocab_size, max_context=max_context)

    def build_app(self) -> web.Application:
        """The aiohttp app serving `ROUTES`; with a key set, SGLang's key gate runs before everything else."""
        middlewares = [self.error_middleware()]
        if self.api_key or self.admin_api_key:
            middlewares.insert(0, key_gate(api_key=self.api_key, admin_api_key=self.admin_api_key,
                                           admin_paths=ADMIN_PATHS))
        app = web.Application(client_max_size=256 * 1024**2, middlewares=middlewares)
        app.router.add_routes([web.route(r.method, r.path, self._endpoint(r)) for r in self.routes()])
        return app

    def error_middleware(self) -> Any:
        """Turns a payload problem into its 4xx answer."""
        return bad_request_middleware

    def routes(self) -> tuple[Route, ...]:
        """The routes this server answers (the strict server narrows them to SGLang's)."""
        return ROUTES

    def _endpoint(self, route: Route) -> Handler:
        """The aiohttp handler of `route`: its body read and checked, then handed to the named method."""
        handle = getattr(self, route.handler)

        async def endpoint(request: web.Request) -> web.StreamResponse:
            if route.body is None:
                return await handle({})
            return await handle(await read_body(request, route.body, may_be_empty=route.body_optional))

        return endpoint

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

    async def generate(self, body: dict[str, Any]) -> web.Response:
        requests, is_batch = parse_generate(body, vocab_size=self.vocab_size, max_context=self.max_context,
                                            next_rid=lambda: f"embedded-{next(self._rids)}",
                                            records_routing=self.runner.recorder is not None,
                                            tokenizer=self.tokenizer)
        outputs = [with_text(self.output(seq), seq, self.tokenizer) for seq in await self.run_requests(requests)]
        return web.json_response(outputs if is_batch else outputs[0])

    def output(self, seq: Sequence) -> dict[str, Any]:
        """One finished request as `/generate` answers it."""
        return format_output(seq)

    async def chat_completions(self, body: dict[str, Any]) -> web.Response:
        """SGLang's OpenAI-compatible chat route: the prompt from the chat template, one generation (openai_chat)."""
        chat = await self.chat.parse(body, rid=f"chatcmpl-{next(self._rids)}")
        [seq] = await self.run_requests([chat.generation])
        return web.json_response(self.chat.answer(chat, format_output(seq)))

    async def list_models(self, body: dict[str, Any]) -> web.Response:
        return web.json_response(self.chat.model_list())

    async def health(self, body: dict[str, Any]) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, body: dict[str, Any]) -> web.Response:
        """Generate one token; while generation is deliberately paused the engine is healthy without it."""
        if self.runner.is_paused or self.runner.released:
            return web.Response(status=200)
        probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                 "rid": f"HEALTH_CHECK_{next(self._rids)}"}
        requests, _ = parse_generate(probe, vocab_size=self.vocab_size, max_context=self.max_context, next_rid=None)
        await self.run_requests(requests)
        return web.Response(status=200)

    # ---- information ----
    async def get_model_info(self, body: dict[str, Any]) -> web.Response:
        return web.json_response({**self.model_info, "weight_version": self.runner.weight_version})

    async def get_server_info(self, body: dict[str, Any]) -> web.Response:
        state = {**self.runner.load(), "forward_count": self.runner.forward_count, "is_paused": self.runner.is_paused,
                 "memory_released": sorted(self.runner.released), "weight_bytes": self.runner.weight_bytes()}
        return web.json_response({**self.server_info, "weight_version": self.runner.weight_version,
                                  "internal_states": [state], "startup_time": self.started_at,
                                  "sluice_capabilities": list(SLUICE_CAPABILITIES)})

    async def get_weight_version(self, body: dict[str, Any]) -> web.Response:
        return web.json_response({"weight_version": self.runner.weight_version})

    # ---- control ----
    async def pause_generation(self, body: dict[str, Any]) -> web.Response:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return error_response(f"mode must be 'abort', 'retract' or 'in_place', got {describe(mode)}", "mode")
        await asyncio.to_thread(self.runner.pause, mode)  # answers once no forward runs (see ModelRunner.pause)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, body: dict[str, Any]) -> web.Response:
        self.runner.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, body: dict[str, Any]) -> web.Response:
        self.runner.abort(rid=body.get("rid") or None, abort_all=body.get("abort_all", False))
        return web.Response(status=200)

    async def flush_cache(self, body: dict[str, Any]) -> web.Response:
        """No prefix cache to flush: each request's KV lives only while it runs."""
        return web.Response(text="Cache flushed.\n", status=200)

    # ---- memory occupation (SGLang's Release/ResumeMemoryOccupationReqInput: `tags`, null = all) ----
    async def release_memory_occupation(self, body: dict[str, Any]) -> web.Response:
        tags = memory_tags(body)
        await asyncio.to_thread(self.runner.release_memory, tags)
        if "weights" in tags:
            await asyncio.to_thread(self.receiver.drop_parameter_homes)
        return web.json_response({"success": True, "message": f"released {sorted(tags)}"})

    async def resume_memory_occupation(self, body: dict[str, Any]) -> web.Response:
        tags = memory_tags(body)
        await asyncio.to_thread(self.runner.resume_memory, tags)
        return web.json_response({"success": True, "message": f"resumed {sorted(tags)}"})

    # ---- weights ----
    async def begin_weight_update(self, body: dict[str, Any]) -> web.Response:
        """SGLang's weight-update session; accepted, not enforced, here (the strict server enforces it)."""
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, body: dict[str, Any]) -> web.Response:
        return web.json_response({"success": True, "message": "Success"})

    async def init_weights_update_group(self, body: dict[str, Any]) -> web.Response:
        check_group_numbers(body)
        ok, message = await asyncio.to_thread(
            self.receiver.init_group, master_address=body["master_address"], master_port=body["master_port"],
            rank_offset=body["rank_offset"], world_size=body["world_size"],
            group_name=body.get("group_name", "weight_update_group"), backend=body.get("backend", "nccl"))
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def destroy_weights_update_group(self, body: dict[str, Any]) -> web.Response:
        ok, message = await asyncio.to_thread(self.receiver.destroy_group, body.get("group_name", "weight_update_group"))
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> web.Response:
        problem = check_update_payload(body, EMBEDDED_LOAD_FORMATS)
        if problem is not None:
            return web.json_response({"success": False, "message": problem}, status=400)
        if body.get("abort_all_requests"):
            self.runner.abort(abort_all=True)
        ok, message, sums, timings = await asyncio.to_thread(
            self.receiver.update_from_distributed, names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"],
            group_name=body.get("group_name", "weight_update_group"), weight_version=body.get("weight_version"),
            load_format=body.get("load_format"))
        return update_response(ok, message, sums, **timings)

    async def update_weights_from_tensor(self, body: dict[str, Any]) -> web.Response:
        """SGLang's colocated route: `serialized_named_tensors` holds SGLang's flattened-bucket entries
        (weight_sync.ipc), the tensor a CUDA IPC handle or, on CPU, sluice's shared-memory stand-in."""
        if body.get("load_format") != "flattened_bucket":
            return update_response(False, f"load_format {body.get('load_format')!r} is not supported by the embedded "
                                          "engine; send flattened buckets with load_format 'flattened_bucket'", None)
        if body.get("abort_all_requests"):
            self.runner.abort(abort_all=True)
        try:
            ok, message, sums, timings = await asyncio.to_thread(self.receiver.update_from_tensor,
                                                                 handles=body["serialized_named_tensors"],
                                                                 weight_version=body.get("weight_version"))
        except (ValueError, OSError) as e:  # a bad or stale entry: refused, nothing loaded
            return update_response(False, str(e), None)
        return update_response(ok, message, sums, **timings)

    async def update_weights_from_disk(self, body: dict[str, Any]) -> web.Response:
        if body.get("abort_all_requests"):
            self.runner.abort(abort_all=True)
        ok, message, sums = await asyncio.to_thread(self.receiver.update_from_disk, model_path=body["model_path"],
                                                    weight_version=body.get("weight_version"))
        return update_response(ok, message, sums, num_paused_requests=0)

    async def weights_checker(self, body: dict[str, Any]) -> web.Response:
        answer = await asyncio.to_thread(self.receiver.check_weights, body.get("action", "checksum"))
        return web.json_response(answer, status=200 if answer["success"] else 400)

    async def update_weight_version(self, body: dict[str, Any]) -> web.Response:
        version = body["new_version"]
        if body.get("abort_all_requests", True):
            self.runner.abort(abort_all=True)
        self.runner.set_weight_version(version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})
