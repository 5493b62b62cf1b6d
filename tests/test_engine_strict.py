"""--sglang-strict against SGLang 0.5.23 itself: request structs, handler replies, messages and knobs parsed with
`ast` from the pinned source (so an SGLang bump that changes one fails here), then a real strict engine process over
HTTP: sessions, flush, health while paused, the waiting-queue abort, the weights checker and a TP=2 weight group."""
from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import free_port, is_alive
from helpers.engines import call, generate
from helpers.schema import class_fields, string_constants
from glue.embedded_engine import strict_schema as strict
from glue.embedded_engine.sglang_layout import rank_tensors, tensor_hash
from weight_sync.broadcast import dtype_to_str, send_tensors
from weight_sync.process_group import create_process_group, destroy_process_group

LONG = {"input_ids": [4, 2], "sampling_params": {"temperature": 0.0, "max_new_tokens": 2000, "ignore_eos": True}}


# ---- the pinned SGLang source, parsed ----
def struct_defaults(io_struct: Path) -> dict[str, dict[str, bool]]:
    """Per class of io_struct.py: field name -> whether it has a default (inherited fields included)."""
    tree = ast.parse(io_struct.read_text())
    own, bases = {}, {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = {s.target.id: s.value is not None for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def collect(name: str) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for base in bases.get(name, []):
            out.update(collect(base) if base in own else {})
        return {**out, **own.get(name, {})}

    return {name: collect(name) for name in own}


def handlers(http_server: Path) -> dict[str, ast.AsyncFunctionDef]:
    """Route path -> the handler function SGLang's app runs for it."""
    out = {}
    for node in ast.walk(ast.parse(http_server.read_text())):
        if isinstance(node, (ast.AsyncFunctionDef, ast.FunctionDef)):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and deco.args and isinstance(deco.args[0], ast.Constant) \
                        and str(deco.args[0].value).startswith("/"):
                    out[deco.args[0].value] = node
    return out


def dict_keys(node: ast.AST) -> set[str]:
    """The string keys of every dict literal inside `node`."""
    return {k.value for d in ast.walk(node) if isinstance(d, ast.Dict) for k in d.keys
            if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def assigned_dict_keys(function: ast.AST, name: str) -> set[str]:
    """Keys of the dict literal(s) assigned to `name` inside `function`, `name.update({...})`-ed into it, and
    `name["key"] = ...` stores."""
    keys: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name and node.args:
            keys |= dict_keys(node.args[0]) if isinstance(node.args[0], ast.Dict) else set()
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            keys |= dict_keys(node.value) if isinstance(node.value, ast.Dict) else set()
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == name and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def method(path: Path, cls: str | None, name: str) -> ast.AST:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"{name} not found in {path}")


def test_every_strict_body_is_exactly_its_sglang_struct_with_the_same_required_fields(sglang_srt):
    structs = struct_defaults(sglang_srt / "managers" / "io_struct.py")
    for path, (struct, fields) in strict.STRICT_BODIES.items():
        assert struct in structs, f"sglang has no {struct} any more ({path})"
        assert set(fields) == set(structs[struct]), (path, set(fields) ^ set(structs[struct]))
        required = {n for n, has_default in structs[struct].items() if not has_default}
        assert {n for n, f in fields.items() if f.required} == required, path


def test_every_strict_body_is_the_struct_sglangs_handler_for_that_route_takes(sglang_srt):
    by_path = handlers(sglang_srt / "entrypoints" / "http_server.py")
    for path, (struct, _) in strict.STRICT_BODIES.items():
        assert path in by_path, f"sglang serves no {path} any more"
        annotations = {n.id for a in by_path[path].args.args if a.annotation is not None
                       for n in ast.walk(a.annotation) if isinstance(n, ast.Name)}
        assert struct in annotations, (path, annotations)


def test_the_strict_engine_serves_only_sglang_routes_and_none_that_sglang_lacks(sglang_srt, tiny_model_dir):
    from glue.embedded_engine.engine import build_engine

    server = build_engine(model_path=tiny_model_dir, host="127.0.0.1", port=0, seed=0, max_running_requests=1,
                          num_threads=1, weight_version="default", weight_sync_timeout_s=5, sglang_strict=True)
    ours = {r.path for r in server.routes()}
    sglang = set(handlers(sglang_srt / "entrypoints" / "http_server.py"))
    sglang |= {"/health"}  # stacked decorator on the same handler as /health_generate
    assert ours - sglang == set()
    assert strict.NOT_IN_SGLANG & sglang == set() and not strict.NOT_IN_SGLANG & ours
    assert {"/begin_weight_update", "/end_weight_update"} <= ours


def test_update_replies_have_exactly_the_keys_of_sglangs_handlers(sglang_srt):
    by_path = handlers(sglang_srt / "entrypoints" / "http_server.py")
    for path in ("/update_weights_from_distributed", "/update_weights_from_tensor", "/init_weights_update_group",
                 "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update"):
        assert dict_keys(by_path[path]) == {"success", "message"}, path
    assert dict_keys(by_path["/update_weights_from_disk"]) == {"success", "message", "num_paused_requests"}
    assert {"success", "message", "ranks", "per_engine_checksum"} == \
        dict_keys(by_path["/weights_checker"]) | assigned_dict_keys(by_path["/weights_checker"], "body")


def test_strict_messages_and_knobs_are_sglangs_own(sglang_srt):
    updater = string_constants(sglang_srt / "managers" / "scheduler_components" / "weight_updater.py")
    for route in ("update_weights_from_distributed", "update_weights_from_tensor"):
        assert strict.OUTSIDE_SESSION.format(route=route) in updater
    assert {strict.SESSION_ALREADY_OPEN, strict.NO_SESSION_OPEN, strict.FLUSH_REFUSED_AFTER_UPDATE,
            strict.DISTRIBUTED_OK, strict.TENSOR_OK, strict.DISK_OK, strict.RELEASE_NOT_IDLE, "Success."} <= updater
    server = string_constants(sglang_srt / "entrypoints" / "http_server.py")
    assert {strict.FLUSH_DONE, strict.FLUSH_FAILED, "SGLANG_HEALTH_CHECK_TIMEOUT"} <= server
    flush = sglang_srt / "managers" / "scheduler_components" / "flush_wrapper.py"
    assert strict.FLUSH_TIMED_OUT in string_constants(flush)
    timeout_param = [a for a in handlers(sglang_srt / "entrypoints" / "http_server.py")["/flush_cache"].args.args]
    assert [a.arg for a in timeout_param] == ["timeout"]  # the one thing SGLang's flush reads: ?timeout=
    assert strict.WAITING_QUEUE_ABORT in string_constants(sglang_srt / "managers" / "tokenizer_manager.py")
    serving = (sglang_srt / "arg_groups" / "fields" / "serving.py").read_text()
    assert "Defaults to 'default' if not specified." in serving and '] = "default"' in serving
    text = (sglang_srt / "entrypoints" / "http_server.py").read_text()
    assert 'int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))' in text
    environ = (sglang_srt / "environ.py").read_text()
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)" in environ
    assert "SGLANG_FORCE_STREAM_INTERVAL = EnvInt(50)" in environ
    structs = ast.parse((sglang_srt / "managers" / "io_struct.py").read_text())
    flush_defaults = {node.name: s.value.value for node in structs.body if isinstance(node, ast.ClassDef)
                      for s in node.body
                      if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", "") == "flush_cache"}
    assert flush_defaults["UpdateWeightsFromDistributedReqInput"] is True  # the strict engine flushes by default
    assert flush_defaults["UpdateWeightsFromTensorReqInput"] is True


def test_strict_meta_info_has_the_keys_sglang_builds_for_finished_and_queue_aborted_requests(sglang_srt):
    from glue.embedded_engine.sequence import Sequence
    from glue.embedded_engine.request_schema import parse_generate

    manager = sglang_srt / "managers" / "tokenizer_manager.py"
    spans = assigned_dict_keys(method(sglang_srt / "utils" / "weight_versions.py", None,
                                      "add_weight_versions_to_meta_info"), "meta_info")
    assert spans == {"weight_versions", "weight_version"}
    finished_keys = assigned_dict_keys(method(manager, None, "_handle_batch_output"), "meta_info") | spans
    abort_keys = assigned_dict_keys(method(manager, None, "_handle_abort_req"), "meta_info") | spans
    [request], _ = parse_generate({"input_ids": [3, 4], "return_logprob": True}, vocab_size=32, max_context=64,
                                  next_rid=lambda: "r")
    seq = Sequence(request=request, on_done=lambda s: None, generator=torch.Generator(), output_ids=[5, 6],
                   logprobs=[-0.1, -0.2], versions=["a", "b"], finish_reason={"type": "length", "length": 2},
                   final_version="b")
    meta = strict.strict_output(seq)["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
            "completion_tokens", "cached_tokens", "weight_versions", "e2e_latency"} <= finished_keys
    logprob_keys = assigned_dict_keys(method(manager, None, "add_logprob_to_meta_info"), "meta_info")
    assert {"input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"} <= logprob_keys
    assert set(meta) - logprob_keys <= finished_keys
    queue_abort_keys = {"id", "finish_reason", "weight_version", "e2e_latency", "weight_versions", "completion_tokens"}
    assert queue_abort_keys <= abort_keys
    seq.aborted_in_queue = True
    queued = strict.strict_output(seq)
    assert set(queued["meta_info"]) - logprob_keys == \
        {"id", "finish_reason", "weight_version", "e2e_latency", "weight_versions", "completion_tokens"}
    assert queued["output_ids"] == [] and queued["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue"


def test_weight_version_spans_follow_sglangs_rules():
    assert strict.version_spans([], "v", 0) == [{"version": "v", "start": 0, "end": 0}]  # nothing generated
    assert strict.version_spans(["a", "a", "b"], "b", 3) == [{"version": "a", "start": 0, "end": 2},
                                                             {"version": "b", "start": 2, "end": 3}]
    # the tokenizer saw no token yet: one empty span of the first version (add_weight_versions_to_meta_info)
    assert strict.version_spans(["a", "b"], "c", 0) == [{"version": "a", "start": 0, "end": 0}]
    assert strict.version_spans(["a", "b", "b"], "c", 1) == [{"version": "a", "start": 0, "end": 1}]


# ---- SGLang's parameter names and TP shards for the weights checker ----
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_checker_names_are_sglangs_fused_ones_and_tp_shards_tile_the_weights(tmp_path, family):
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / family, family=family), dtype=torch.float32)
    whole, halves = rank_tensors(model, 0, 1), [rank_tensors(model, r, 2) for r in range(2)]
    layer = "model.layers.0"
    assert f"{layer}.self_attn.qkv_proj.weight" in whole and f"{layer}.self_attn.q_proj.weight" not in whole
    if family == "qwen2":
        assert f"{layer}.mlp.gate_up_proj.weight" in whole
        gate_up = whole[f"{layer}.mlp.gate_up_proj.weight"]  # [gate; up], each rank [gate_r; up_r]
        gate, up = gate_up.chunk(2)
        for r, half in enumerate(halves):
            expect = torch.cat([gate.chunk(2)[r], up.chunk(2)[r]])
            assert torch.equal(half[f"{layer}.mlp.gate_up_proj.weight"], expect)
    else:
        w13, w2 = whole[f"{layer}.mlp.experts.w13_weight"], whole[f"{layer}.mlp.experts.w2_weight"]
        assert w13.shape[0] == w2.shape[0] == 4 and w13.shape[1] == 2 * w2.shape[2]
        assert halves[0][f"{layer}.mlp.experts.w13_weight"].shape[1] == w13.shape[1] // 2
        assert torch.equal(torch.cat([h[f"{layer}.mlp.experts.w2_weight"] for h in halves], dim=2), w2)
    o_proj = f"{layer}.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([h[o_proj] for h in halves], dim=1), whole[o_proj])
    assert halves[0]["model.embed_tokens.weight"].shape[0] == 32  # vocab 32 padded to 64, split in two
    assert tensor_hash(torch.zeros(1)) == "df3f619804a92fdb"  # sha256 of 4 zero bytes, first 8 bytes


# ---- a real strict engine, TP=2 ----
@pytest.fixture(scope="module")
def strict_url(engine_processes, tiny_model_dir) -> str:
    return engine_processes.start(tiny_model_dir, "--sglang-strict", "--tp-size", "2", "--max-running-requests", "1",
                                  "--weight-sync-timeout-s", "30")


def join_group(url: str, world_size: int = 3, group_name: str = "weight_update_group"):
    """Host rank 0 of a gloo weight group the engine's TP ranks join; returns the trainer's group."""
    port, holder = free_port(), {}
    creator = threading.Thread(target=lambda: holder.update(group=create_process_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=world_size, group_name=group_name,
        timeout_s=30)))
    creator.start()
    status, answer = call(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size,
        "group_name": group_name, "backend": "gloo"})
    creator.join(timeout=60)
    assert status == 200 and answer == {"success": True, "message": "Succeeded to initialize custom process group."}
    return holder["group"]


def broadcast_update(url: str, group, named: list, **flags) -> tuple[int, dict]:
    body = {"names": [n for n, _ in named], "dtypes": [dtype_to_str(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named], **flags}
    reply: dict = {}
    poster = threading.Thread(target=lambda: reply.update(
        zip(("status", "answer"), call(url, "/update_weights_from_distributed", body))))
    poster.start()
    send_tensors(group, named)
    poster.join(timeout=60)
    return reply["status"], reply["answer"]


def wait_running(url: str) -> None:
    deadline = time.monotonic() + 30
    while call(url, "/server_info")[1]["internal_states"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "no request started running"
        time.sleep(0.05)


def start_long_request(url: str) -> tuple[threading.Thread, dict]:
    """A request that runs until aborted; its answer (or the error that ended it) lands in the dict."""
    result: dict = {}

    def run() -> None:
        try:
            result.update(call(url, "/generate", {**LONG, "rid": "long"})[1])
        except OSError as e:  # the engine went away
            result["error"] = e

    runner = threading.Thread(target=run)
    runner.start()
    wait_running(url)
    return runner, result


def test_a_strict_engine_starts_at_version_default_without_sluice_routes_or_hooks(strict_url):
    assert call(strict_url, "/model_info")[1]["weight_version"] == "default"
    assert generate(strict_url, {"input_ids": [3], "sampling_params": {"max_new_tokens": 2}})["meta_info"][
        "weight_version"] == "default"
    assert call(strict_url, "/get_weight_version")[0] == 404 and call(strict_url, "/weight_version")[0] == 404
    info = call(strict_url, "/get_server_info")[1]
    assert "sluice_capabilities" not in info and info["tp_size"] == 2
    assert set(info["internal_states"][0]) & {"forward_count", "is_paused", "memory_released", "weight_bytes"} == set()


def test_the_lenient_engine_advertises_its_extra_capabilities(engine_processes, tiny_model_dir):
    url = engine_processes.start(tiny_model_dir)
    info = call(url, "/get_server_info")[1]
    assert info["sluice_capabilities"] == ["bucket_checksums", "test_hooks", "delta_sync"]
    assert call(url, "/begin_weight_update", {})[0] == 200 and call(url, "/begin_weight_update", {})[0] == 200


def test_an_update_outside_a_session_is_refused_at_once_without_touching_the_group_or_payload(strict_url):
    group = join_group(strict_url)
    try:
        named = [("model.norm.weight", torch.ones(64))]
        t0 = time.monotonic()
        status, answer = call(strict_url, "/update_weights_from_distributed", {
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}, timeout=20)
        assert time.monotonic() - t0 < 5  # a receive would wait for the broadcast, up to the 30 s group timeout
        assert (status, answer) == (400, {"success": False, "message": strict.OUTSIDE_SESSION.format(
            route="update_weights_from_distributed")})
        status, answer = call(strict_url, "/update_weights_from_tensor", {"serialized_named_tensors": ["garbage"]})
        assert (status, answer["message"]) == (400, strict.OUTSIDE_SESSION.format(route="update_weights_from_tensor"))
        assert call(strict_url, "/end_weight_update", {}) == (400, {"success": False,
                                                                   "message": strict.NO_SESSION_OPEN})
        assert call(strict_url, "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
        assert call(strict_url, "/begin_weight_update", {})[1]["message"] == strict.SESSION_ALREADY_OPEN
        try:
            # both simulated TP ranks receive the broadcast (a rank that did not join would hang it)
            status, answer = broadcast_update(strict_url, group, named, weight_version="v1")
            assert (status, answer) == (200, {"success": True, "message": "Succeeded to update parameter online. "
                                                                          "Weight version updated to v1."})
            status, answer = call(strict_url, "/update_weights_from_tensor", {
                "serialized_named_tensors": ["one-handle"], "load_format": "flattened_bucket"})
            assert status == 400 and "exactly 2" in answer["message"] and set(answer) == {"success", "message"}
        finally:
            assert call(strict_url, "/end_weight_update", {})[0] == 200
        assert call(strict_url, "/model_info")[1]["weight_version"] == "v1"
    finally:
        call(strict_url, "/destroy_weights_update_group", {})
        destroy_process_group(group)


def test_flush_is_refused_while_a_request_runs_and_an_update_then_fails_after_recording_its_version(strict_url):
    before = call(strict_url, "/model_info")[1]["weight_version"]
    runner, result = start_long_request(strict_url)
    group = join_group(strict_url)
    try:
        assert call(strict_url, "/flush_cache") == (400, strict.FLUSH_FAILED)
        t0 = time.monotonic()
        assert call(strict_url, "/flush_cache?timeout=0.5") == (400, strict.FLUSH_TIMED_OUT)
        assert time.monotonic() - t0 >= 0.5
        assert call(strict_url, "/flush_cache?timeout=-1")[0] == 400
        assert call(strict_url, "/pause_generation", {"mode": "in_place"})[0] == 200
        assert call(strict_url, "/flush_cache") == (400, strict.FLUSH_FAILED)  # in place keeps the batch
        assert call(strict_url, "/begin_weight_update", {})[0] == 200
        status, answer = broadcast_update(strict_url, group, [("model.norm.weight", torch.ones(64))],
                                          weight_version="v2")
        assert call(strict_url, "/end_weight_update", {})[0] == 200
        assert (status, answer) == (400, {"success": False, "message": strict.FLUSH_REFUSED_AFTER_UPDATE})
        assert call(strict_url, "/model_info")[1]["weight_version"] == before  # the tokenizer never heard of v2
        assert call(strict_url, "/continue_generation", {})[0] == 200
        assert call(strict_url, "/pause_generation", {"mode": "retract"})[0] == 200
        assert call(strict_url, "/flush_cache") == (200, strict.FLUSH_DONE)  # retracted: nothing runs
    finally:
        call(strict_url, "/continue_generation", {})
        wait_running(strict_url)  # back in the batch, so the abort finds it running, not queued
        call(strict_url, "/abort_request", {"rid": "long"})
        runner.join(timeout=60)
        call(strict_url, "/destroy_weights_update_group", {})
        destroy_process_group(group)
    meta = result["meta_info"]
    assert [s["version"] for s in meta["weight_versions"]] == [before, "v2"]  # the scheduler recorded v2
    assert meta["finish_reason"]["message"] == "Aborted" and meta["num_retractions"] == 1
    call(strict_url, "/update_weight_version", {"new_version": before})


def test_a_request_aborted_from_the_waiting_queue_gets_sglangs_short_answer(strict_url):
    runner, first = start_long_request(strict_url)  # --max-running-requests 1: the next one waits
    queued: dict = {}
    waiter = threading.Thread(target=lambda: queued.update(generate(strict_url, {
        "input_ids": [5, 6, 7], "rid": "queued", "sampling_params": {"max_new_tokens": 4}})))
    waiter.start()
    time.sleep(0.5)
    call(strict_url, "/abort_request", {"rid": "queued"})
    waiter.join(timeout=30)
    call(strict_url, "/abort_request", {"rid": "long"})
    runner.join(timeout=60)
    assert queued["output_ids"] == [] and queued["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in queued["meta_info"]
    assert first["meta_info"]["finish_reason"]["message"] == "Aborted" and first["meta_info"]["prompt_tokens"] == 2


def test_the_weights_checker_answers_one_entry_per_tp_rank_under_sglangs_names(strict_url, sglang_srt):
    status, answer = call(strict_url, "/weights_checker", {"action": "checksum"})
    structs = class_fields(sglang_srt / "managers" / "io_struct.py")
    assert status == 200 and answer["message"] == "Success." and len(answer["ranks"]) == 2
    for tp_rank, info in enumerate(answer["ranks"]):
        assert set(info) == structs["ChecksumInfo"]
        [placement] = info["parallelism_info"]
        assert set(placement) == structs["ParallelismInfo"] and placement["tp_rank"] == tp_rank
        assert "model.layers.0.self_attn.qkv_proj.weight" in info["checksums"]
    first, second = (r["checksums"] for r in answer["ranks"])
    assert first["model.norm.weight"] == second["model.norm.weight"]  # replicated
    assert first["model.layers.0.mlp.gate_up_proj.weight"] != second["model.layers.0.mlp.gate_up_proj.weight"]


@pytest.mark.long  # 43 s on 2 cores (an engine of its own, two waits); the pause and continue routes stay in CI
def test_health_generate_answers_503_after_sglangs_wait_while_paused(engine_processes, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "2")
    url = engine_processes.start(tiny_model_dir, "--sglang-strict")
    assert call(url, "/health_generate")[0] == 200
    assert call(url, "/pause_generation", {"mode": "abort"})[0] == 200
    t0 = time.monotonic()
    assert call(url, "/health_generate")[0] == 503 and call(url, "/health")[0] == 503
    assert time.monotonic() - t0 >= 4  # two checks, each waiting out the 2 s
    assert call(url, "/continue_generation", {})[0] == 200
    assert call(url, "/health_generate")[0] == 200


def test_memory_routes_without_memory_saver_release_nothing_and_busy_release_kills_the_server(
        engine_processes, tiny_model_dir):
    url = engine_processes.start(tiny_model_dir, "--sglang-strict")
    assert call(url, "/release_memory_occupation", {}) == (200, None)
    generate(url, {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}})  # weights still there
    assert call(url, "/resume_memory_occupation", {}) == (200, None)
    proc = engine_processes.procs[-1]
    runner, _ = start_long_request(url)
    assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    with pytest.raises(OSError):  # SGLang's scheduler asserts idle; the failed assert takes the server down
        call(url, "/release_memory_occupation", {}, timeout=10)
    proc.wait(timeout=15)
    assert not is_alive(proc.pid)
    runner.join(timeout=30)
    assert "should be called only when server is idle" in engine_processes.log_of(url)


def test_a_tp2_tensor_update_takes_one_entry_per_rank_and_the_checker_sees_the_new_weights(strict_url):
    import uuid

    from weight_sync.buckets import pack_bucket, plan_buckets
    from weight_sync.ipc import SharedSegment, encode_shm_entries

    norm = torch.full((64,), 0.5)
    [layout] = plan_buckets([("model.norm.weight", "float32", [64])], 1 << 20)
    segment = SharedSegment(f"sluice-strict-test-{uuid.uuid4().hex}", layout.nbytes)
    try:
        pack_bucket(layout, {"model.norm.weight": norm}, segment.buffer)
        entries = encode_shm_entries(segment, layout, range(2))
        assert call(strict_url, "/begin_weight_update", {})[0] == 200
        try:
            # anything but exactly SGLang's payload, one entry per rank, is refused before a weight moves
            for bad, says in [([entries[0]], "has 1 entries; this engine has 2 TP rank(s)"),
                              ([entries[0], entries[0]], "serialized_named_tensors[1] repeats an earlier entry"),
                              (entries[::-1], "serialized_named_tensors[0] was made for TP rank 1"),
                              (entries + entries[:1], "has 3 entries")]:
                status, answer = call(strict_url, "/update_weights_from_tensor", {
                    "serialized_named_tensors": bad, "load_format": "flattened_bucket", "weight_version": "bad"})
                assert status == 400 and says in answer["message"] and set(answer) == {"success", "message"}, answer
            status, answer = call(strict_url, "/update_weights_from_tensor", {
                "serialized_named_tensors": entries, "load_format": None})
            assert status == 400 and "load_format None is not supported" in answer["message"]
            assert call(strict_url, "/model_info")[1]["weight_version"] != "bad"
            status, answer = call(strict_url, "/update_weights_from_tensor", {
                "serialized_named_tensors": entries, "load_format": "flattened_bucket", "weight_version": "t1"})
        finally:
            assert call(strict_url, "/end_weight_update", {})[0] == 200
    finally:
        segment.close()
    assert (status, answer) == (200, {"success": True, "message": "Success Weight version updated to t1."})
    ranks = call(strict_url, "/weights_checker", {})[1]["ranks"]
    assert {r["checksums"]["model.norm.weight"] for r in ranks} == {tensor_hash(norm)}
