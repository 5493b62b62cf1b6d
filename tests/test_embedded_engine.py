"""The embedded engine over real loopback HTTP: SGLang's field names, logprobs equal to a teacher-forced HF forward,
finish reasons, 400s naming the field, pause / continue / abort, and a clear exit on a bad model path."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import REPO_ROOT
from helpers.engines import call, generate, teacher_forced_logprobs


@pytest.fixture(scope="module")
def engine_url(engine_processes, tiny_model_dir) -> str:
    return engine_processes.start(tiny_model_dir, "--seed", "0", "--max-running-requests", "8")


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_every_endpoint_answers_with_sglang_field_names(engine_url):
    assert call(engine_url, "/health")[0] == 200
    assert call(engine_url, "/health_generate")[0] == 200
    for path in ("/get_model_info", "/model_info"):
        status, info = call(engine_url, path)
        assert status == 200 and info["is_generation"] is True and info["weight_version"] == "0"
        assert {"model_path", "tokenizer_path", "architectures", "model_type"} <= set(info)
    for path in ("/get_server_info", "/server_info"):
        status, info = call(engine_url, path)
        assert status == 200 and info["tp_size"] == 1 and isinstance(info["internal_states"], list)
    assert call(engine_url, "/get_weight_version") == (200, {"weight_version": "0"})
    out = generate(engine_url, {"input_ids": [5, 6, 7], "rid": "probe", "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}})
    assert set(out) == {"output_ids", "meta_info"} and len(out["output_ids"]) == 3
    meta = out["meta_info"]
    assert meta["id"] == "probe" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 3}]
    assert [entry[1:] for entry in meta["output_token_logprobs"]] == [[t, None] for t in out["output_ids"]]
    assert call(engine_url, "/flush_cache", {})[0] == 200
    assert call(engine_url, "/abort_request", {"rid": "nothing-runs-under-this-rid"})[0] == 200
    status, answer = call(engine_url, "/update_weight_version", {"new_version": "7"})
    assert status == 200 and answer["success"] is True and answer["new_version"] == "7"
    assert call(engine_url, "/get_weight_version") == (200, {"weight_version": "7"})
    call(engine_url, "/update_weight_version", {"new_version": "0"})


def test_concurrent_prompts_of_different_lengths_get_logprobs_equal_to_a_teacher_forced_forward(
        engine_url, reference_model):
    prompts = [[3], [4, 9, 2, 7, 7], [10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 30, 31], [6, 6, 6, 6]]
    samplers = [{"temperature": 0.0}, {"temperature": 0.7}, {"temperature": 1.0, "top_p": 0.9},
                {"temperature": 1.3, "top_k": 5}, {"temperature": 0.0}, {"temperature": 0.8, "min_p": 0.02}]
    lengths = [300, 300, 300, 20, 25, 30]
    forwards_before = call(engine_url, "/server_info")[1]["internal_states"][0]["forward_count"]

    def one(i: int) -> dict:
        params = {**samplers[i], "max_new_tokens": lengths[i], "ignore_eos": True}
        return generate(engine_url, {"input_ids": prompts[i], "sampling_params": params, "return_logprob": True})

    # The first three start together; the other three arrive while those are decoding and join their batch.
    with ThreadPoolExecutor(len(prompts)) as pool:
        call(engine_url, "/pause_generation", {"mode": "in_place"})
        first = [pool.submit(one, i) for i in range(3)]
        time.sleep(0.3)
        call(engine_url, "/continue_generation", {})
        time.sleep(0.05)
        call(engine_url, "/pause_generation", {"mode": "in_place"})
        assert not any(f.done() for f in first), "the first requests finished before the others could join"
        later = [pool.submit(one, i) for i in range(3, 6)]
        time.sleep(0.3)
        call(engine_url, "/continue_generation", {})
        outputs = [f.result() for f in first + later]
    worst = 0.0
    for prompt, sampler, out in zip(prompts, samplers, outputs):
        tokens = out["output_ids"]
        engine_lp = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        temperature = sampler["temperature"] if sampler["temperature"] > 0 else 1.0
        reference = teacher_forced_logprobs(reference_model, prompt, tokens, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(engine_lp, reference)))
        if sampler["temperature"] == 0.0:  # greedy: every token is the argmax of the reference forward
            with torch.no_grad():
                logits = reference_model(torch.tensor([prompt + tokens])).logits[0]
            assert tokens == logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert worst < 1e-4, f"largest |engine - teacher-forced| logprob difference {worst:.2e}"
    total_tokens = sum(len(o["output_ids"]) for o in outputs)
    assert total_tokens == sum(lengths)
    forwards = call(engine_url, "/server_info")[1]["internal_states"][0]["forward_count"] - forwards_before
    assert forwards <= max(lengths) + len(prompts), f"{forwards} forwards for {total_tokens} tokens: not batched"


def test_stop_token_ids_and_max_new_tokens_give_sglang_finish_reasons(engine_url):
    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    free = generate(engine_url, {"input_ids": [2, 3, 4], "sampling_params": greedy})
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    stop = free["output_ids"][4]
    first = next(i for i, t in enumerate(free["output_ids"]) if t in (stop, 1))  # 1: save_tiny_model's eos
    stopping = {**greedy, "ignore_eos": False, "stop_token_ids": [stop]}
    stopped = generate(engine_url, {"input_ids": [2, 3, 4], "sampling_params": stopping})
    assert stopped["output_ids"] == free["output_ids"][: first + 1]  # the matched token is part of the output
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": free["output_ids"][first]}
    ignoring = generate(engine_url, {"input_ids": [2, 3, 4], "sampling_params": {**greedy, "stop_token_ids": [stop]}})
    assert ignoring["output_ids"] == free["output_ids"]  # SGLang's ignore_eos turns stop_token_ids off too
    none = generate(engine_url, {"input_ids": [2, 3, 4], "sampling_params": {**greedy, "max_new_tokens": 0}})
    assert none["output_ids"] == [] and none["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_the_models_eos_stops_generation_unless_ignore_eos(engine_url):
    eos = 1  # save_tiny_model's eos_token_id
    body = {"input_ids": [[7, 8]] * 8, "sampling_params": [
        {"temperature": 1.0, "max_new_tokens": 64, "sampling_seed": seed} for seed in range(8)]}
    outputs = generate(engine_url, body)
    for out in outputs:
        ids, reason = out["output_ids"], out["meta_info"]["finish_reason"]
        if reason["type"] == "stop":
            assert reason["matched"] == eos and ids[-1] == eos and eos not in ids[:-1]
        else:
            assert reason == {"type": "length", "length": 64} and eos not in ids
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outputs), "no sample hit eos in 8 x 64 draws"
    ignoring = generate(engine_url, {"input_ids": [7, 8], "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 64, "sampling_seed": 0, "ignore_eos": True}})
    assert ignoring["meta_info"]["finish_reason"] == {"type": "length", "length": 64}


def test_a_sampling_seed_gives_the_same_tokens_alone_or_inside_a_batch(engine_url):
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 1234, "ignore_eos": True}
    alone = generate(engine_url, {"input_ids": [9, 9], "sampling_params": params})
    batch = generate(engine_url, {"input_ids": [[1, 2, 3], [9, 9], [4]], "sampling_params": [
        {**params, "sampling_seed": 1}, params, {**params, "sampling_seed": 2}]})
    assert batch[1]["output_ids"] == alone["output_ids"]
    assert len({b["meta_info"]["id"] for b in batch}) == 3  # a batch without rids gets one id per prompt


@pytest.mark.parametrize("body, field", [
    ({"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ({"input_ids": "1 2 3"}, "input_ids"),
    ({"input_ids": [1, 2, 999]}, "input_ids"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [1], "sampling_params": {"temprature": 0.5}}, "sampling_params.temprature"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"text": "hello"}, "text"),  # this model has no tokenizer
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "made_up_field": 3}, "made_up_field"),
])
def test_a_bad_generate_payload_gets_a_400_naming_the_field(engine_url, body, field):
    status, answer = call(engine_url, "/generate", body)
    assert status == 400 and answer["error"]["field"] == field, answer
    assert field.split(".")[-1] in answer["error"]["message"]


def test_malformed_json_and_bad_control_payloads_get_400s(engine_url):
    req = urllib.request.Request(engine_url + "/generate", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["field"] == "body"
    assert call(engine_url, "/pause_generation", {"mode": "later"})[0] == 400
    status, answer = call(engine_url, "/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": []})
    assert status == 400 and answer["success"] is False and "same length" in answer["message"]
    status, answer = call(engine_url, "/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert status == 400 and answer["error"]["field"] == "master_port"
    status, answer = call(engine_url, "/update_weights_from_disk", {"model_path": "/nowhere", "weight_version": 3})
    assert status == 400 and answer["success"] is False and "weight_version must be a string" in answer["message"]
    assert call(engine_url, "/health")[0] == 200  # and the engine is still up


def _generate_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(generate(url, body)), daemon=True)
    thread.start()
    return thread, result


def test_pause_holds_new_generation_until_continue(engine_url):
    status, answer = call(engine_url, "/pause_generation", {"mode": "in_place"})
    assert (status, answer["status"]) == (200, "ok")
    try:
        thread, result = _generate_in_background(engine_url, {"input_ids": [3, 4], "sampling_params": {
            "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
        thread.join(timeout=1.5)
        assert thread.is_alive() and not result, "generation ran while the engine was paused"
    finally:
        assert call(engine_url, "/continue_generation", {})[0] == 200
    thread.join(timeout=30)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_pause_in_abort_mode_returns_running_requests_with_an_abort_finish_reason(engine_url):
    thread, result = _generate_in_background(engine_url, {"input_ids": [3, 4], "rid": "long-one", "sampling_params": {
        "max_new_tokens": 2000, "temperature": 1.0, "ignore_eos": True}})
    time.sleep(0.5)
    assert call(engine_url, "/pause_generation", {})[0] == 200  # SGLang's default mode is "abort"
    try:
        thread.join(timeout=10)
        assert not thread.is_alive()
        reason = result["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and result["meta_info"]["id"] == "long-one"
        assert 0 < len(result["output_ids"]) < 2000
    finally:
        call(engine_url, "/continue_generation", {})


def test_abort_request_by_rid_ends_only_that_request(engine_url):
    long = {"max_new_tokens": 2000, "temperature": 1.0, "ignore_eos": True}
    t1, r1 = _generate_in_background(engine_url, {"input_ids": [5], "rid": "victim", "sampling_params": long})
    t2, r2 = _generate_in_background(engine_url, {"input_ids": [6], "rid": "bystander", "sampling_params": {
        **long, "max_new_tokens": 300}})
    time.sleep(0.5)
    assert call(engine_url, "/abort_request", {"rid": "victim"})[0] == 200
    t1.join(timeout=10)
    t2.join(timeout=60)
    assert r1["meta_info"]["finish_reason"]["type"] == "abort" and len(r1["output_ids"]) < 2000
    assert r2["meta_info"]["finish_reason"] == {"type": "length", "length": 300}


def test_a_client_that_hangs_up_frees_its_running_request(engine_url):
    # 2,000 tokens take several seconds (one row, ~2 ms a step); the row must be gone well before that
    body = json.dumps({"input_ids": [2], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}).encode()
    host, port = engine_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.5)
        assert call(engine_url, "/server_info")[1]["internal_states"][0]["num_running_reqs"] == 1
    deadline = time.monotonic() + 1.0
    while call(engine_url, "/server_info")[1]["internal_states"][0]["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert call(engine_url, "/server_info")[1]["internal_states"][0]["num_running_reqs"] == 0


def test_an_engine_given_a_bad_model_path_exits_nonzero_with_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "glue.embedded_engine", "--model-path", str(tmp_path / "missing"),
                           "--port", "1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--model-path" in proc.stderr and "config.json" in proc.stderr


def test_an_engine_given_a_device_it_cannot_run_on_exits_2_naming_the_flag(tmp_path):
    from glue.embedded_engine.tiny_model import save_tiny_model

    model_path = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=0)
    proc = subprocess.run([sys.executable, "-m", "glue.embedded_engine", "--model-path", model_path, "--port", "1",
                           "--device", "tpu"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--device 'tpu'" in proc.stderr and "cpu or cuda" in proc.stderr


def test_sigterm_answers_a_paused_engines_waiting_request_with_abort_and_the_engine_exits_at_once(
        engine_processes, tiny_model_dir):
    # a run killed while its engines are paused for a weight sync: before, aiohttp waited its default minute for
    # the request the pause held, and the engine outlived the run that far
    url = engine_processes.start(tiny_model_dir)
    proc = engine_processes.procs[-1]
    assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(generate, url, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
        time.sleep(1.0)
        assert not waiting.done(), "the pause must hold the request"
        started = time.monotonic()
        proc.terminate()
        proc.wait(timeout=30)
        seconds = time.monotonic() - started
        answer = waiting.result(timeout=10)
    assert answer["meta_info"]["finish_reason"]["type"] == "abort" and answer["output_ids"] == []
    assert seconds < 10, f"the engine took {seconds:.1f} s to exit after SIGTERM"
