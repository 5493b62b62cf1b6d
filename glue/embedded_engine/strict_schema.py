"""What --sglang-strict serves, as data: each control route's body is the whole SGLang 0.5.23 request struct
(managers/io_struct.py; unknown keys ignored as SGLang's schema does), SGLang's reply messages, and `/generate`
results in SGLang's meta_info shape. tests/test_engine_strict.py checks every name here against the pinned source."""
from __future__ import annotations

import os
from typing import Any

from glue.embedded_engine.json_body import Field, field
from glue.embedded_engine.sequence import Sequence
from glue.embedded_engine.prompt_logprobs import input_token_logprobs
from glue.embedded_engine.routed_experts import encode_routed_experts

_BASE = {"rid": field(str), "http_worker_ipc": field(str)}  # BaseReq: every struct carries these two
_SELECTOR = {"selector": field(str)}
_UPDATE_FLAGS = {"flush_cache": field(bool), "abort_all_requests": field(bool), "weight_version": field(str),
                 "load_format": field(str), "torch_empty_cache": field(bool)}
_MEMORY = {"tags": field(list), **_BASE}

# SGLang struct name and its complete field set, by route path (method-independent: GET and POST share a struct).
STRICT_BODIES: dict[str, tuple[str, dict[str, Field]]] = {
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", {
        "master_address": field(str, required=True), "master_port": field(int, required=True),
        "rank_offset": field(int, required=True), "world_size": field(int, required=True),
        "group_name": field(str), "backend": field(str), **_BASE}),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", {"group_name": field(str), **_BASE}),
    "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput", {
        "names": field(list, required=True), "dtypes": field(list, required=True),
        "shapes": field(list, required=True), "group_name": field(str), **_UPDATE_FLAGS, **_SELECTOR, **_BASE}),
    "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", {
        "serialized_named_tensors": field(list, required=True), **_UPDATE_FLAGS, **_SELECTOR, **_BASE}),
    "/update_weights_from_disk": ("UpdateWeightFromDiskReqInput", {
        "model_path": field(str, required=True), **_UPDATE_FLAGS, "is_async": field(bool), "keep_pause": field(bool),
        "recapture_cuda_graph": field(bool), "token_step": field(int), "manifest": field(dict), **_BASE}),
    "/begin_weight_update": ("BeginWeightUpdateReqInput", {**_SELECTOR, **_BASE}),
    "/end_weight_update": ("EndWeightUpdateReqInput", dict(_BASE)),
    "/weights_checker": ("CheckWeightsReqInput", {
        "action": field(str), "allow_quant_error": field(bool), "skip_tensor_list": field(list), **_SELECTOR,
        **_BASE}),
    "/update_weight_version": ("UpdateWeightVersionReqInput", {
        "new_version": field(str, required=True), "abort_all_requests": field(bool), **_BASE}),
    "/pause_generation": ("PauseGenerationReqInput", {"mode": field(str), **_BASE}),
    "/continue_generation": ("ContinueGenerationReqInput", {"torch_empty_cache": field(bool), **_BASE}),
    "/abort_request": ("AbortReq", {"abort_all": field(bool), "finished_reason": field(dict),
                                    "abort_message": field(str), "weight_versions": field(list), **_BASE}),
    "/release_memory_occupation": ("ReleaseMemoryOccupationReqInput", dict(_MEMORY)),
    "/resume_memory_occupation": ("ResumeMemoryOccupationReqInput", dict(_MEMORY)),
}
# Routes sluice's engine serves that SGLang 0.5.23 has not (entrypoints/http_server.py): 404 under --sglang-strict.
NOT_IN_SGLANG = frozenset({"/get_weight_version", "/weight_version"})
SELECTORS = ("target", "draft", "all")

# SGLang's reply texts (managers/scheduler_components/weight_updater.py, entrypoints/http_server.py).
OUTSIDE_SESSION = "{route} must run between begin_weight_update() and end_weight_update()"
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
FLUSH_REFUSED_AFTER_UPDATE = ("Weights were updated, but the cache was not flushed because requests are still running "
                              "or queued. Retract or finish them, then call /flush_cache.")
FLUSH_DONE = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
RELEASE_NOT_IDLE = "release_memory_occupation should be called only when server is idle."
WAITING_QUEUE_ABORT = "Abort in waiting queue"  # tokenizer_manager._handle_abort_req's default message
DISTRIBUTED_OK = "Succeeded to update parameter online."
TENSOR_OK = "Success"
DISK_OK = "Succeeded to update model weights."

# SGLang's knobs, read from the same environment variables (entrypoints/http_server.py, environ.py).
HEALTH_CHECK_TIMEOUT_S = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
FORCE_STREAM_INTERVAL = int(os.getenv("SGLANG_FORCE_STREAM_INTERVAL", "50"))


def version_spans(versions: list[str], current: str, visible: int) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions` (utils/weight_versions.py): spans of output tokens per weight version,
    the last span's version the one current at the end, cut to the first `visible` tokens; a request with no
    visible token gets one empty span of the current version."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate([*versions[:visible]]):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    if not spans:
        return [{"version": current if len(versions) <= visible else versions[0], "start": 0, "end": 0}]
    return spans


def strict_output(seq: Sequence) -> dict[str, Any]:
    """One `/generate` result as SGLang 0.5.23 answers it: the full meta_info of a finished (or mid-batch aborted)
    request (tokenizer_manager._handle_batch_output), or, for a request aborted from the waiting queue, the short
    one of `_handle_abort_req`: no prompt/cached tokens, no routed experts, and only the output the tokenizer had
    received (a non-streamed request reaches it every SGLANG_FORCE_STREAM_INTERVAL tokens)."""
    if seq.aborted_in_queue:
        return _waiting_queue_abort(seq)
    spans = version_spans(seq.versions, seq.final_version, len(seq.output_ids))
    meta: dict[str, Any] = {
        "id": seq.request.rid, "finish_reason": seq.finish_reason, "prompt_tokens": len(seq.request.input_ids),
        "weight_version": spans[-1]["version"], "num_retractions": seq.retraction_count, "reasoning_tokens": 0,
        "completion_tokens": len(seq.output_ids), "cached_tokens": 0, "weight_versions": spans,
    }
    _add_logprobs(meta, seq, len(seq.output_ids))
    if seq.request.return_routed_experts:
        meta["routed_experts"] = encode_routed_experts(seq.routing, seq.request.routed_experts_start_len,
                                                       len(seq.request.input_ids) + len(seq.output_ids))
    meta["e2e_latency"] = seq.finished_at - seq.created_at
    return {"output_ids": list(seq.output_ids), "meta_info": meta}


def _waiting_queue_abort(seq: Sequence) -> dict[str, Any]:
    received = len(seq.output_ids) // FORCE_STREAM_INTERVAL * FORCE_STREAM_INTERVAL
    spans = version_spans(seq.versions, seq.final_version, received)
    meta: dict[str, Any] = {"id": seq.request.rid, "finish_reason": {"type": "abort", "message": WAITING_QUEUE_ABORT},
                            "weight_version": spans[-1]["version"], "e2e_latency": seq.finished_at - seq.created_at,
                            "weight_versions": spans}
    _add_logprobs(meta, seq, received)
    meta["completion_tokens"] = received
    return {"output_ids": list(seq.output_ids[:received]), "meta_info": meta}


def _add_logprobs(meta: dict[str, Any], seq: Sequence, count: int) -> None:
    if seq.request.return_logprob:  # tokenizer_manager.add_logprob_to_meta_info
        meta["input_token_logprobs"] = input_token_logprobs(seq)
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in
                                         zip(seq.logprobs[:count], seq.output_ids[:count])]
        meta["output_token_logprobs_length"] = count
