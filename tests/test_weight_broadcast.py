"""The broadcast weight path for real: gloo groups across processes, SGLang's group layout, and an embedded engine
that receives a second model's weights and then generates exactly like that model."""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from conftest import free_port
from helpers.engines import call, generate, teacher_forced_logprobs
from weight_sync.broadcast import dtype_to_str, receive_tensors, send_tensors, str_to_dtype
from weight_sync.process_group import create_process_group, destroy_process_group
from helpers.forkserver import rank_context


def test_dtype_names_are_the_ones_sglang_resolves_with_getattr_torch():
    for dtype, name in [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                        (torch.int64, "int64")]:
        assert dtype_to_str(dtype) == name and getattr(torch, name) is dtype and str_to_dtype(name) is dtype
    assert str_to_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        str_to_dtype("float33")


def _receiver(port: int, names, dtypes, shapes, queue) -> None:
    group = create_process_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                                 group_name="weights", timeout_s=60)
    queue.put([(n, t.tolist()) for n, t in receive_tensors(group, names, dtypes, shapes)])
    destroy_process_group(group)


def test_send_tensors_reach_another_process_with_their_names_dtypes_and_shapes():
    tensors = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
               ("b", torch.tensor([1.5, -2.25], dtype=torch.bfloat16)), ("c", torch.tensor([[7]], dtype=torch.int64))]
    port, ctx = free_port(), rank_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, [n for n, _ in tensors], [dtype_to_str(t.dtype) for _, t in tensors],
                                               [list(t.shape) for _, t in tensors], queue))
    proc.start()
    try:
        group = create_process_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                     group_name="weights", timeout_s=60)
        send_tensors(group, tensors)
        assert queue.get(timeout=60) == [(n, t.tolist()) for n, t in tensors]
        destroy_process_group(group)
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def _join_like_sglang(port: int, queue) -> None:
    """What SGLang's init_custom_process_group does, through torch's own API: tcp rendezvous, a PrefixStore named
    after the group, torch's process-group helper (the engine process has a default group of its own)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=datetime.timedelta(seconds=60)))
    pg, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), PrefixStore("weight_update_group", store),
                                      group_name="weight_update_group", timeout=datetime.timedelta(seconds=60))
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    received = torch.empty(3, 4)
    dist.broadcast(received, src=0, group=pg)
    queue.put(received.tolist())


def test_trainer_rank_zero_meets_an_engine_that_joins_the_way_sglang_does():
    port, ctx = free_port(), rank_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=_join_like_sglang, args=(port, queue))
    proc.start()
    try:
        group = create_process_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                     group_name="weight_update_group", timeout_s=60)
        sent = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5
        send_tensors(group, [("w", sent)])
        assert queue.get(timeout=60) == sent.tolist()
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.fixture(scope="module")
def engine_url(engine_processes, tiny_model_dir) -> str:
    """An engine whose weights the tests below leave as they found them."""
    return engine_processes.start(tiny_model_dir)


def _hf_weights(model_dir: str):
    """The HF model in `model_dir` and its checkpoint tensors by checkpoint name (what trainers and SGLang use:
    one tensor per expert where transformers fuses experts into 3-D parameters)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, list(load_file(f"{model_dir}/model.safetensors").items())


def _sync(url: str, named: list[tuple[str, torch.Tensor]], version: str, group_name: str = "weight_update_group"):
    """The trainer side of one sync: group (rank 0, in a thread) + /init, then /update + send_tensors."""
    port = free_port()
    holder: dict = {}
    creator = threading.Thread(target=lambda: holder.update(group=create_process_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name=group_name, timeout_s=60)))
    creator.start()
    status, answer = call(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": group_name, "backend": "gloo"})
    creator.join(timeout=60)
    assert status == 200 and answer["success"] is True, answer
    group = holder["group"]
    reply: dict = {}
    body = {"names": [n for n, _ in named], "dtypes": [dtype_to_str(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name, "weight_version": version,
            "flush_cache": True}
    poster = threading.Thread(target=lambda: reply.update(zip(("status", "answer"), call(url, "/update_weights_from_distributed", body))))
    poster.start()
    send_tensors(group, named)
    poster.join(timeout=60)
    call(url, "/destroy_weights_update_group", {"group_name": group_name})
    destroy_process_group(group)
    return reply["status"], reply["answer"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_an_engine_that_receives_another_models_weights_generates_like_that_model(engine_processes, tmp_path, family):
    from glue.embedded_engine.tiny_model import save_tiny_model

    start_dir = save_tiny_model(tmp_path / "seed0", family=family, seed=0)
    url = engine_processes.start(start_dir)
    old_model, _ = _hf_weights(start_dir)
    new_model, new_weights = _hf_weights(save_tiny_model(tmp_path / "seed1", family=family, seed=1))
    if family == "qwen3_moe":  # per-expert checkpoint names land in the engine's fused expert parameters
        assert any(n.endswith("experts.3.up_proj.weight") for n, _ in new_weights)
    status, answer = _sync(url, new_weights, version="1")
    assert status == 200 and answer["success"] is True, answer
    assert call(url, "/get_weight_version") == (200, {"weight_version": "1"})
    for prompt in ([3, 4, 5], [9]):
        out = generate(url, {"input_ids": prompt, "return_logprob": True,
                             "sampling_params": {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}})
        tokens = out["output_ids"]
        engine_lp = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        new_lp = teacher_forced_logprobs(new_model, prompt, tokens, 1.0)
        old_lp = teacher_forced_logprobs(old_model, prompt, tokens, 1.0)
        assert max(abs(a - b) for a, b in zip(engine_lp, new_lp)) < 1e-4
        assert max(abs(a - b) for a, b in zip(engine_lp, old_lp)) > 1e-2  # and not like the model it started with
        with torch.no_grad():
            greedy = new_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
        assert tokens == greedy and out["meta_info"]["weight_version"] == "1"


def test_an_update_with_an_unknown_name_or_a_wrong_shape_loads_nothing_and_names_the_problem(engine_url, tiny_model_dir):
    url = engine_url
    probe = {"input_ids": [3, 4, 5], "return_logprob": True,
             "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}}
    before = generate(url, probe)
    _, weights = _hf_weights(tiny_model_dir)
    zeros = [(n, torch.zeros_like(t)) for n, t in weights]
    status, answer = _sync(url, zeros + [("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))], version="5")
    assert status == 400 and answer["success"] is False and "model.layers.9.mlp.up_proj.weight" in answer["message"]
    name, tensor = weights[0]
    status, answer = _sync(url, [(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]))] + zeros[1:], version="5")
    assert status == 400 and name in answer["message"] and "shape" in answer["message"]
    assert call(url, "/get_weight_version") == (200, {"weight_version": "0"})
    assert generate(url, probe)["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_an_engine_asked_for_an_nccl_group_on_cpu_answers_success_false_without_hanging(engine_url):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: nccl would be a valid backend here")
    url = engine_url
    status, answer = call(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
        "group_name": "g", "backend": "nccl"}, timeout=30)
    assert status == 400 and answer["success"] is False and "gloo" in answer["message"]


def test_a_request_paused_in_place_across_a_sync_reports_both_weight_versions(engine_url, tiny_model_dir):
    _, same_weights = _hf_weights(tiny_model_dir)  # the same values: the version changes, the model does not
    result: dict = {}
    body = {"input_ids": [4, 2], "sampling_params": {"temperature": 0.0, "max_new_tokens": 1500, "ignore_eos": True}}
    runner = threading.Thread(target=lambda: result.update(generate(engine_url, body)))
    runner.start()
    time.sleep(0.3)
    assert call(engine_url, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        status, answer = _sync(engine_url, same_weights, version="1")
        assert status == 200 and answer["success"] is True, answer
    finally:
        call(engine_url, "/continue_generation", {})
    runner.join(timeout=60)
    call(engine_url, "/update_weight_version", {"new_version": "0"})
    spans = result["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"], spans
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 1500
    assert result["meta_info"]["weight_version"] == "1"
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 1500}
