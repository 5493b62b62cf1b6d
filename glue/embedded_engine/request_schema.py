"""The `/generate` payload, checked at the boundary: SGLang's JSON in, `GenerationRequest`s out for the model runner.

Field names are SGLang's (`GenerateReqInput`, `SamplingParams`); tests/test_engine_schema.py checks every name
below against the installed sglang source. A bad payload raises `RequestError` naming the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from glue.embedded_engine.request_error import RequestError
from glue.embedded_engine.text_io import StopStrings, encode_text, parse_stop

# Top-level `GenerateReqInput` fields the engine reads.
GENERATE_FIELDS = ("input_ids", "sampling_params", "return_logprob", "rid", "stream", "logprob_start_len",
                   "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "text",
                   "return_routed_experts", "routed_experts_start_len")
# Accepted whatever their value: they only steer metrics or routing, which an embedded engine has no use for.
GENERATE_FIELDS_IGNORED = ("log_metrics", "routed_dp_rank", "data_parallel_rank", "routing_key", "conversation_id",
                           "session_id", "custom_logit_processor", "lora_path")
# Sampling params that work, and those accepted only at SGLang's neutral value.
SAMPLING_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos",
                   "sampling_seed", "n", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                   "stream_interval", "stop")
SAMPLING_PARAMS_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                           "min_new_tokens": 0, "stop_regex": None, "json_schema": None, "regex": None,
                           "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None,
                           "watermark": None, "beam_width": None}
# Fields the control endpoints read, by SGLang request type (the JSON keys are the struct's field names).
CONTROL_REQUEST_FIELDS = {
    "InitWeightsUpdateGroupReqInput": ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                                       "backend"),
    "UpdateWeightsFromDistributedReqInput": ("names", "dtypes", "shapes", "group_name", "flush_cache",
                                             "abort_all_requests", "weight_version", "load_format"),
    "DestroyWeightsUpdateGroupReqInput": ("group_name",),
    "UpdateWeightVersionReqInput": ("new_version", "abort_all_requests"),
    "PauseGenerationReqInput": ("mode",),
    "AbortReq": ("rid", "abort_all"),
}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_SAMPLING_EPS = 1e-6  # below this temperature SGLang samples greedily


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """Sampling for one request, normalised the way SGLang does (temperature 0 means top_k=1 at temperature 1)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # as in SGLang, also turns off stop_token_ids (stop strings still apply)
    seed: int | None = None
    stop_strings: StopStrings | None = None  # `stop`, matched on the decoded output (glue.embedded_engine.text_io)
    no_stop_trim: bool = False  # the answer's text keeps the matched stop
    skip_special_tokens: bool = True  # how the answer's text is decoded
    spaces_between_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingSettings
    return_logprob: bool
    return_routed_experts: bool = False  # answer meta_info.routed_experts (MoE routing of positions [start, seqlen - 1))
    routed_experts_start_len: int = 0  # the first absolute position whose routing is answered
    logprob_start_len: int = -1  # first input position whose logprob is answered (-1: none; glue.embedded_engine.prompt_logprobs)


def _is_neutral(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {})


def _per_item(value: Any, n: int, field: str, is_batch: bool) -> list[Any]:
    """Spread a top-level field over the batch: a list must have one entry per prompt, a scalar is shared."""
    if is_batch and isinstance(value, list):
        if len(value) != n:
            raise RequestError(field, f"has {len(value)} entries but the batch has {n} prompts")
        return value
    return [value] * n


def _check_token_ids(ids: Any, field: str, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError(field, "must be a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestError(field, f"token id {t!r} is not an integer in [0, {vocab_size})")
    return ids


def parse_generate(body: Any, *, vocab_size: int, max_context: int, next_rid: Any,
                   records_routing: bool = False, tokenizer: Any = None) -> tuple[list[GenerationRequest], bool]:
    """Validate a `/generate` body; return the requests and whether the caller sent a batch (list of prompts).
    `records_routing`: the engine was started with --enable-return-routed-experts. `tokenizer`: the engine's, or
    None when its model has none (then `text` and `stop` strings are refused)."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    _reject_unsupported_fields(body)
    prompts, is_batch = _prompts(body, tokenizer)
    n = len(prompts)
    params = _per_item(body.get("sampling_params") or {}, n, "sampling_params", is_batch)
    logprob_flags = _per_item(body.get("return_logprob"), n, "return_logprob", is_batch)
    start_lens = _per_item(body.get("logprob_start_len"), n, "logprob_start_len", is_batch)
    routing, start_len = _routed_experts_fields(body, records_routing)
    rids = body.get("rid")
    rids = _per_item(rids, n, "rid", is_batch) if not (is_batch and isinstance(rids, str)) else [f"{rids}_{i}" for i in range(n)]
    requests = []
    for i, prompt in enumerate(prompts):
        where = f"[{i}]" if is_batch else ""
        source = "input_ids" if body.get("input_ids") is not None else "text"
        prompt = _check_token_ids(prompt, f"{source}{where}", vocab_size)
        if len(prompt) >= max_context:
            raise RequestError(f"{source}{where}", f"has {len(prompt)} tokens; the model's context is {max_context}")
        if logprob_flags[i] is not None and not isinstance(logprob_flags[i], bool):
            raise RequestError(f"return_logprob{where}", f"must be true or false, got {logprob_flags[i]!r}")
        rid = rids[i] if rids[i] is not None else next_rid()
        if not isinstance(rid, str):
            raise RequestError(f"rid{where}", f"must be a string, got {rid!r}")
        sampling = parse_sampling_params(params[i], f"sampling_params{where}", len(prompt), max_context, tokenizer)
        if start_len > len(prompt):  # SGLang's scheduler refuses it the same way
            raise RequestError("routed_experts_start_len", f"is {start_len}, more than the {len(prompt)} input "
                                                           f"tokens of input_ids{where}; send a smaller one")
        logprob_start = _logprob_start_len(start_lens[i], f"logprob_start_len{where}", len(prompt))
        requests.append(GenerationRequest(rid=rid, input_ids=prompt, sampling=sampling,
                                          return_logprob=bool(logprob_flags[i]), return_routed_experts=routing,
                                          routed_experts_start_len=start_len,
                                          logprob_start_len=logprob_start if logprob_flags[i] else -1))
    return requests, is_batch


def _prompts(body: dict, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The prompts' token ids and whether they are a batch: `input_ids` as sent (SGLang uses them when both are
    given), else `text` (a string, or a list of them for a batch) tokenized."""
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None:
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        return (ids if is_batch else [ids]), is_batch
    if text is None:
        raise RequestError("input_ids", "either text or input_ids must be provided")
    if isinstance(text, list):
        if not text:
            raise RequestError("text", "is an empty batch; send at least one text")
        return [encode_text(tokenizer, t, f"text[{i}]") for i, t in enumerate(text)], True
    return [encode_text(tokenizer, text, "text")], False


def _logprob_start_len(value: Any, field: str, prompt_len: int) -> int:
    """SGLang's `logprob_start_len`: -1 (the default: no input logprobs) or a position in [0, len(input_ids)]
    (the scheduler aborts a larger one with this message); ignored without return_logprob."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise RequestError(field, f"must be -1 or an integer >= 0, got {value!r}")
    if value > prompt_len:
        raise RequestError(field, f"logprob_start_len={value} is higher than the number of input tokens "
                                  f"{prompt_len}. Please use a smaller logprob_start_len.")
    return value


def _routed_experts_fields(body: dict, records_routing: bool) -> tuple[bool, int]:
    """`return_routed_experts` and `routed_experts_start_len` (scalars in SGLang's GenerateReqInput)."""
    asked, start_len = body.get("return_routed_experts") or False, body.get("routed_experts_start_len") or 0
    if not isinstance(asked, bool):
        raise RequestError("return_routed_experts", f"must be true or false, got {asked!r}")
    if isinstance(start_len, bool) or not isinstance(start_len, int) or start_len < 0:
        raise RequestError("routed_experts_start_len", f"must be an integer >= 0, got {start_len!r}")
    if asked and not records_routing:
        raise RequestError("return_routed_experts", "this engine does not record MoE routing; start it with "
                                                    "--enable-return-routed-experts (config: sglang."
                                                    "enable_return_routed_experts: true), which needs an MoE model")
    return asked, start_len


def _reject_unsupported_fields(body: dict) -> None:
    if body.get("stream"):
        raise RequestError("stream", "streaming is not supported by the embedded engine; send stream=false")
    for name in ("top_logprobs_num", "token_ids_logprob"):
        if not _is_neutral(body.get(name)):
            raise RequestError(name, "is not supported by the embedded engine; leave it unset")
    known = set(GENERATE_FIELDS) | set(GENERATE_FIELDS_IGNORED)
    for name, value in body.items():
        if name not in known and not _is_neutral(value):
            raise RequestError(name, "unknown or unsupported /generate field for the embedded engine")


def _number(params: dict, name: str, where: str, default: float) -> float:
    value = params.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{where}.{name}", f"must be a finite number, got {value!r}")
    return float(value)


def _integer(params: dict, name: str, where: str, default: int | None) -> int | None:
    value = params.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{where}.{name}", f"must be an integer, got {value!r}")
    return value


def parse_sampling_params(params: Any, where: str, prompt_len: int, max_context: int,
                          tokenizer: Any = None) -> SamplingSettings:
    """Check one `sampling_params` object against SGLang's rules and normalise it."""
    if not isinstance(params, dict):
        raise RequestError(where, f"must be a JSON object, got {type(params).__name__}")
    for name, value in params.items():
        if name in SAMPLING_PARAMS_NEUTRAL:
            if value is not None and value != SAMPLING_PARAMS_NEUTRAL[name]:
                raise RequestError(f"{where}.{name}", "is not supported by the embedded engine; leave it unset")
        elif name not in SAMPLING_PARAMS:
            raise RequestError(f"{where}.{name}", f"unknown sampling param; known: {', '.join(SAMPLING_PARAMS)}")
    temperature = _number(params, "temperature", where, 1.0)
    top_p = _number(params, "top_p", where, 1.0)
    top_k = _integer(params, "top_k", where, -1)
    min_p = _number(params, "min_p", where, 0.0)
    if temperature < 0:
        raise RequestError(f"{where}.temperature", f"must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"{where}.top_p", f"must be in (0, 1], got {top_p}")
    if top_k != -1 and top_k < 1:
        raise RequestError(f"{where}.top_k", f"must be -1 (whole vocabulary) or >= 1, got {top_k}")
    if not 0 <= min_p <= 1:
        raise RequestError(f"{where}.min_p", f"must be in [0, 1], got {min_p}")
    if temperature < _SAMPLING_EPS:
        temperature, top_k = 1.0, 1
    room = max_context - prompt_len
    max_new = _integer(params, "max_new_tokens", where, DEFAULT_MAX_NEW_TOKENS)
    if max_new < 0:
        raise RequestError(f"{where}.max_new_tokens", f"must be >= 0, got {max_new}")
    if _integer(params, "n", where, 1) != 1:
        raise RequestError(f"{where}.n", "must be 1 for the embedded engine; send n separate requests")
    stop = params.get("stop_token_ids") or []
    if not isinstance(stop, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop):
        raise RequestError(f"{where}.stop_token_ids", f"must be a list of integers, got {stop!r}")
    flags = {name: _flag(params, name, where, default) for name, default in
             [("ignore_eos", False), ("no_stop_trim", False), ("skip_special_tokens", True),
              ("spaces_between_special_tokens", True)]}
    return SamplingSettings(
        max_new_tokens=min(max_new, room), temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        stop_token_ids=frozenset(stop), seed=_integer(params, "sampling_seed", where, None),
        stop_strings=parse_stop(tokenizer, params.get("stop"), where), **flags,
    )


def _flag(params: dict, name: str, where: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where}.{name}", f"must be true or false, got {value!r}")
    return value
