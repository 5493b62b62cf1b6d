"""Every JSON name the embedded engine reads or answers with exists in the installed sglang package's source.

sglang is not importable on CPU, so its files are parsed with `ast`; the test skips when sglang is not installed.
"""
from __future__ import annotations

import ast

from glue.embedded_engine.request_schema import (
    CONTROL_REQUEST_FIELDS,
    GENERATE_FIELDS,
    GENERATE_FIELDS_IGNORED,
    SAMPLING_PARAMS,
    SAMPLING_PARAMS_NEUTRAL,
)
from helpers.schema import class_fields, string_constants


def test_generate_fields_the_engine_reads_exist_in_generate_req_input(sglang_srt):
    fields = class_fields(sglang_srt / "managers" / "io_struct.py")["GenerateReqInput"]
    assert len(fields) > 40  # the real dataclass, not an empty match
    assert set(GENERATE_FIELDS + GENERATE_FIELDS_IGNORED) - fields == set()


def test_sampling_params_the_engine_accepts_exist_in_sglang_sampling_params(sglang_srt):
    fields = class_fields(sglang_srt / "sampling" / "sampling_params.py")["SamplingParams"]
    assert {"temperature", "top_p", "max_new_tokens"} <= fields
    assert (set(SAMPLING_PARAMS) | set(SAMPLING_PARAMS_NEUTRAL)) - fields == set()


def test_weight_and_control_request_fields_exist_in_sglangs_request_structs(sglang_srt):
    structs = class_fields(sglang_srt / "managers" / "io_struct.py")
    for struct, names in CONTROL_REQUEST_FIELDS.items():
        assert struct in structs, f"sglang has no {struct} any more"
        assert set(names) - structs[struct] == set(), struct


def test_weight_route_fields_exist_in_sglangs_update_and_checker_structs(sglang_srt):
    from glue.embedded_engine.weight_update import WEIGHT_REQUEST_FIELDS

    structs = class_fields(sglang_srt / "managers" / "io_struct.py")
    assert {"UpdateWeightsFromTensorReqInput", "UpdateWeightFromDiskReqInput", "CheckWeightsReqInput"} <= set(WEIGHT_REQUEST_FIELDS)
    for struct, names in WEIGHT_REQUEST_FIELDS.items():
        assert struct in structs, f"sglang has no {struct} any more"
        assert set(names) - structs[struct] == set(), struct
    # the bucket layout the engine and the bridge share is SGLang's flattened_bucket load format
    assert "flattened_bucket" in string_constants(sglang_srt / "model_executor" / "model_runner_components" / "weight_updater.py")


def test_response_field_names_and_finish_reasons_are_sglangs(sglang_srt):
    manager = string_constants(sglang_srt / "managers" / "tokenizer_manager.py")
    meta_keys = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
                 "e2e_latency", "output_token_logprobs", "output_token_logprobs_length", "output_ids", "meta_info",
                 "text"}
    assert meta_keys - manager == set()
    assert {"weight_versions", "version", "start", "end"} <= string_constants(sglang_srt / "utils" / "weight_versions.py")
    finish = string_constants(sglang_srt / "managers" / "schedule_batch.py")
    assert {"type", "stop", "matched", "length", "abort", "message", "status_code", "err_type"} <= finish


def test_the_text_layer_follows_sglangs_stop_handling(sglang_srt):
    from glue.embedded_engine.text_io import MAX_STOP_COUNT

    params = (sglang_srt / "sampling" / "sampling_params.py").read_text()
    assert f"MAX_STOP_COUNT = {MAX_STOP_COUNT}" in params
    assert {"stop", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"} <= \
        class_fields(sglang_srt / "sampling" / "sampling_params.py")["SamplingParams"]
    detokenizer = (sglang_srt / "managers" / "detokenizer_manager.py").read_text()
    # the text is cut at the stop string's first occurrence, after it with no_stop_trim; a stop token is dropped
    assert "return output[:end] if no_stop_trim else output[:pos]" in detokenizer
    assert "return output[:-1]" in detokenizer
    batch = (sglang_srt / "managers" / "schedule_batch.py").read_text()
    assert "FINISH_MATCHED_STR(matched=stop_str)" in batch and "if self.sampling_params.ignore_eos:" in batch


def test_every_route_the_engine_serves_is_an_sglang_route(sglang_srt, tiny_model_dir):
    from glue.embedded_engine.engine import build_engine

    server = build_engine(model_path=tiny_model_dir, host="127.0.0.1", port=0, seed=0, max_running_requests=1,
                          num_threads=1, weight_version="0", weight_sync_timeout_s=5)
    ours = {(route.method, route.resource.canonical) for route in server.build_app().router.routes()
            if route.method != "HEAD"}
    sglang = set()
    for node in ast.walk(ast.parse((sglang_srt / "entrypoints" / "http_server.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            methods = {node.func.attr.upper()} if node.func.attr in ("get", "post") else set()
            for kw in node.keywords:
                if kw.arg == "methods":
                    methods = {m.value for m in kw.value.elts}
            sglang |= {(m, node.args[0].value) for m in methods}
    assert {("POST", "/generate"), ("POST", "/update_weights_from_distributed")} <= sglang
    # sglang 0.5.x answers weight versions on /model_info; the older /get_weight_version is kept for clients of it.
    legacy = {("GET", "/get_weight_version"), ("GET", "/weight_version")}
    assert ours - sglang - legacy == set()


def test_the_weight_update_session_routes_read_sglangs_session_structs(sglang_srt):
    from glue.embedded_engine.routes import ROUTES

    structs = class_fields(sglang_srt / "managers" / "io_struct.py")
    bodies = {r.path: r.body for r in ROUTES}
    assert set(bodies["/begin_weight_update"]) <= structs["BeginWeightUpdateReqInput"]
    assert structs["EndWeightUpdateReqInput"] == {"rid", "http_worker_ipc"}  # nothing of its own to read
    assert bodies["/end_weight_update"] is None


def test_sglangs_routing_buffer_starts_zeroed_so_layers_without_experts_read_zero(sglang_srt):
    tree = ast.parse((sglang_srt / "state_capturer" / "base.py").read_text())
    [cache] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BaseDeviceCache"]
    calls = {ast.unparse(c.func) for c in ast.walk(cache) if isinstance(c, ast.Call)}
    assert "torch.zeros" in calls and "torch.full" not in calls


def test_the_strict_checker_hash_is_sglangs_cpu_tensor_hash(sglang_srt):
    import hashlib

    import torch

    from glue.embedded_engine.sglang_layout import tensor_hash

    source = (sglang_srt / "managers" / "mm_utils.py").read_text()
    assert "hash_bytes = hasher.digest()[:8]" in source and 'int.from_bytes(hash_bytes, byteorder="big"' in source
    assert 'return f"{tensor_hash(t):016x}"' in (sglang_srt / "utils" / "weight_checker.py").read_text()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    expected = int.from_bytes(hashlib.sha256(t.numpy().tobytes()).digest()[:8], byteorder="big", signed=False)
    assert tensor_hash(t) == f"{expected:016x}"
    assert tensor_hash(t.t()) != tensor_hash(t)  # the bytes of the (contiguous) values, not of the storage
