"""The embedded engine's routing table: every HTTP route with its handler, its SGLang auth level, and the JSON
fields it reads (field kinds follow SGLang's request structs in sglang/srt/managers/io_struct.py). The server is
built from it, and the auth and fuzz tests walk it, so a new route is gated and fuzzed once it is listed here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from glue.embedded_engine.json_body import Field, field


@dataclass(frozen=True)
class Route:
    """`handler` names the `EngineServer` coroutine `(body: dict) -> Response`. `is_admin`: SGLang marks the route
    `AuthLevel.ADMIN_OPTIONAL` (it takes the admin key when the server has one). `body`: the fields the route reads,
    None when it reads no body. `body_optional`: an empty body means every default (SGLang's optional bodies)."""

    method: str
    path: str
    handler: str
    is_admin: bool = False
    body: Mapping[str, Field] | None = None
    body_optional: bool = False


GENERATE = {"input_ids": field(list), "sampling_params": field(dict, list), "return_logprob": field(bool, list),
            "rid": field(str, list), "stream": field(bool), "logprob_start_len": field(int, list),
            "top_logprobs_num": field(int, list), "token_ids_logprob": field(list),
            "return_text_in_logprobs": field(bool), "text": field(str, list), "return_routed_experts": field(bool),
            "routed_experts_start_len": field(int)}  # parse_generate checks the rest
UPDATE_FLAGS = {"flush_cache": field(bool), "abort_all_requests": field(bool), "weight_version": field(str),
                "load_format": field(str)}
MEMORY = {"tags": field(list)}
CHAT_COMPLETION = {  # SGLang's ChatCompletionRequest (sglang/srt/entrypoints/openai/protocol.py); more in openai_chat
    "messages": field(list, required=True), "model": field(str), "max_tokens": field(int),
    "max_completion_tokens": field(int), "temperature": field(float), "top_p": field(float), "top_k": field(int),
    "min_p": field(float), "seed": field(int), "n": field(int), "stop": field(str, list),
    "stop_token_ids": field(list), "ignore_eos": field(bool), "no_stop_trim": field(bool),
    "skip_special_tokens": field(bool), "logprobs": field(bool), "top_logprobs": field(int), "stream": field(bool),
    "tools": field(list), "tool_choice": field(str, dict), "chat_template_kwargs": field(dict),
    "continue_final_message": field(bool), "input_ids": field(list), "rid": field(str),
    "return_prompt_token_ids": field(bool), "return_token_ids": field(bool), "return_meta_info": field(bool),
    "return_input_ids_in_sglext": field(bool), "return_output_ids_in_sglext": field(bool),
    "frequency_penalty": field(float), "presence_penalty": field(float), "repetition_penalty": field(float),
    "logit_bias": field(dict), "response_format": field(dict), "min_tokens": field(int), "user": field(str)}

ROUTES: tuple[Route, ...] = (
    Route("GET", "/health", "health"),
    Route("GET", "/health_generate", "health_generate"),
    Route("GET", "/get_model_info", "get_model_info"),
    Route("GET", "/model_info", "get_model_info"),
    Route("GET", "/get_server_info", "get_server_info"),
    Route("GET", "/server_info", "get_server_info"),
    Route("GET", "/get_weight_version", "get_weight_version"),
    Route("GET", "/weight_version", "get_weight_version"),
    Route("POST", "/generate", "generate", body=GENERATE),
    Route("PUT", "/generate", "generate", body=GENERATE),
    Route("POST", "/v1/chat/completions", "chat_completions", body=CHAT_COMPLETION),
    Route("GET", "/v1/models", "list_models"),
    Route("POST", "/pause_generation", "pause_generation", is_admin=True, body={"mode": field(str)}),
    Route("POST", "/continue_generation", "continue_generation", is_admin=True,
          body={"torch_empty_cache": field(bool)}),
    Route("POST", "/abort_request", "abort_request", is_admin=True,
          body={"rid": field(str), "abort_all": field(bool), "abort_message": field(str)}),
    Route("GET", "/flush_cache", "flush_cache", is_admin=True),
    Route("POST", "/flush_cache", "flush_cache", is_admin=True),
    Route("POST", "/init_weights_update_group", "init_weights_update_group", is_admin=True, body={
        "master_address": field(str, required=True), "master_port": field(int, required=True),
        "rank_offset": field(int, required=True), "world_size": field(int, required=True),
        "group_name": field(str), "backend": field(str)}),
    Route("POST", "/destroy_weights_update_group", "destroy_weights_update_group", is_admin=True,
          body={"group_name": field(str)}),
    Route("POST", "/begin_weight_update", "begin_weight_update", is_admin=True, body={"selector": field(str)}),
    Route("POST", "/end_weight_update", "end_weight_update", is_admin=True),  # EndWeightUpdateReqInput: no fields
    Route("POST", "/update_weights_from_distributed", "update_weights_from_distributed", is_admin=True, body={
        "names": field(list, required=True), "dtypes": field(list, required=True),
        "shapes": field(list, required=True), "group_name": field(str), **UPDATE_FLAGS}),
    Route("POST", "/update_weights_from_tensor", "update_weights_from_tensor", is_admin=True,
          body={"serialized_named_tensors": field(list, required=True), **UPDATE_FLAGS}),
    Route("POST", "/update_weights_from_disk", "update_weights_from_disk", is_admin=True,
          body={"model_path": field(str, required=True), **UPDATE_FLAGS}),
    Route("GET", "/weights_checker", "weights_checker", is_admin=True, body={"action": field(str)},
          body_optional=True),
    Route("POST", "/weights_checker", "weights_checker", is_admin=True, body={"action": field(str)},
          body_optional=True),
    Route("POST", "/update_weight_version", "update_weight_version", is_admin=True,
          body={"new_version": field(str, required=True), "abort_all_requests": field(bool)}),
    Route("POST", "/release_memory_occupation", "release_memory_occupation", is_admin=True, body=MEMORY),
    Route("POST", "/resume_memory_occupation", "resume_memory_occupation", is_admin=True, body=MEMORY),
)
ADMIN_PATHS = frozenset(r.path for r in ROUTES if r.is_admin)
