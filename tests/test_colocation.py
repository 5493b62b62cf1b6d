"""Colocated placement for real: the embedded engine's /release_memory_occupation and /resume_memory_occupation
(SGLang's routes and `tags`), and a 3-step colocated CPU run where the trainer offloads before each rollout and the
engines release before each training step, measured at each phase start."""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from glue.metrics.logger import read_metrics
from launch.cli import main

DEMO = str(Path(__file__).resolve().parents[1] / "examples/configs/demo.yaml")


def post(url: str, payload: dict | None = None) -> tuple[int, dict]:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def greedy(url: str) -> tuple[int, dict]:
    return post(f"{url}/generate", {"input_ids": [1, 2, 3], "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}})


def state(url: str) -> dict:
    return post(f"{url}/get_server_info")[1]["internal_states"][0]


def test_released_engine_refuses_generates_frees_its_weights_and_after_resume_and_a_weight_update_serves_again(
        engine_processes, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    expected_bytes = sum(p.numel() * 4 for p in model.parameters())  # float32, tied tensors counted once
    vocab = model.config.vocab_size
    url = engine_processes.start(tiny_model_dir, "--num-threads", "1")
    status, before = greedy(url)
    assert status == 200 and state(url)["weight_bytes"] == expected_bytes

    assert post(f"{url}/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    status, body = greedy(url)
    assert status == 400 and "/resume_memory_occupation" in body["error"]["message"]
    assert state(url)["weight_bytes"] == expected_bytes  # the KV cache alone was released
    assert post(f"{url}/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert greedy(url)[1]["output_ids"] == before["output_ids"]

    assert post(f"{url}/release_memory_occupation", {"tags": None})[0] == 200  # null: every tag
    assert state(url)["weight_bytes"] == 0 and state(url)["memory_released"] == ["kv_cache", "weights"]
    assert greedy(url)[0] == 400
    assert post(f"{url}/update_weights_from_disk", {"model_path": tiny_model_dir})[1]["success"] is False
    assert post(f"{url}/resume_memory_occupation", {})[0] == 200
    assert state(url)["weight_bytes"] == expected_bytes
    # The contents were given up: all-zero weights give equal logits, so every token has logprob -ln(vocab).
    zeros = greedy(url)[1]["meta_info"]["output_token_logprobs"]
    assert all(abs(lp + math.log(vocab)) < 1e-5 for lp, _, _ in zeros)
    assert post(f"{url}/update_weights_from_disk", {"model_path": tiny_model_dir})[1]["success"] is True
    after = greedy(url)[1]
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert post(f"{url}/release_memory_occupation", {"tags": ["cuda_graph"]})[0] == 400  # not an engine memory


@pytest.mark.slow
def test_a_colocated_cpu_run_swaps_trainer_and_engine_memory_around_each_phase_and_trains_on_policy(tmp_path, capsys):
    argv = ["--config", DEMO, "cluster.placement=colocated", "sync.transport=ipc", "run.num_steps=3",
            f"run.output_dir={tmp_path}", "run.name=coloc", "rollout.prompts_per_step=4"]
    assert main(argv) == 0, capsys.readouterr().err
    records = read_metrics(tmp_path / "coloc" / "metrics.jsonl")
    assert [r["weights/version"] for r in records] == [1, 2, 3]
    # Resumed engines got the trainer's weights back before each rollout (zeros would be far off).
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3
    from transformers import AutoModelForCausalLM

    model_bytes = sum(p.numel() * 4 for p in
                      AutoModelForCausalLM.from_pretrained(tmp_path / "coloc" / "init_model").parameters())
    engine_bytes = 2 * model_bytes
    params = records[0]["colocation/trainer_bytes_in_train"]  # step 1: Adam has no state yet
    for r in records:
        assert r["colocation/trainer_bytes_in_rollout"] == 0  # offloaded while the engines generate
        assert r["colocation/engine_weight_bytes_in_rollout"] == engine_bytes
        assert r["colocation/engine_weight_bytes_in_train"] == 0  # released while the trainer trains
    # fp32 weights (also the main weights) and megatron DDP's fp32 gradient buffer (padded to its bucket alignment)
    assert 2 * model_bytes <= params < 2.1 * model_bytes
    # Later steps bring back the same plus Adam's two moments per parameter.
    assert [r["colocation/trainer_bytes_in_train"] - params for r in records[1:]] == [2 * model_bytes] * 2


def test_a_resumed_colocated_run_brings_the_engines_to_the_checkpoints_weights_before_its_first_rollout(
        engine_processes, tiny_model_dir, tmp_path):
    """Issue 26 item 1: runner.restore syncs through the colocation (glue.loop.controller.sync_weights) before any phase
    ran; the engines hold their start-up weights then, and must hold the checkpoint's, under its version, when the
    first rollout starts. The trainer here is a state dict with the checkpoint's weights (a LocalWeightSource) that
    counts its offloads; engine, bridge, client and colocation are the run's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from glue.loop.colocation import Colocated
    from glue.loop.config import SyncConfig
    from glue.loop.controller import sync_weights
    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.fleet.engine_client import EngineClient
    from weight_sync.bridge import make_bridge
    from weight_sync.buckets import tensor_checksum
    from weight_sync.engine_calls import weight_checksums, weight_version
    from weight_sync.sender import LocalWeightSource

    class CheckpointedTrainer(LocalWeightSource):
        def __init__(self, tensors, version):
            super().__init__(tensors)
            self.version, self.offloads = version, 0

        def offload(self) -> int:
            self.offloads += 1
            return 0

        def onload(self) -> int:
            return sum(t.numel() * t.element_size() for t in self.tensors.values())

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "seed3", seed=3), dtype=torch.float32)
    trainer = CheckpointedTrainer({n: p.detach().clone() for n, p in model.named_parameters()}, version=4)
    url = engine_processes.start(tiny_model_dir, "--num-threads", "1")
    bridge = make_bridge(SyncConfig(transport="broadcast", verify="checksum"), source=trainer, engine_urls=[url])
    client = EngineClient(url, [url])
    try:
        colocation = Colocated(trainer=trainer, bridge=bridge, engine_urls=[url])
        sync_weights(client, colocation, trainer.version)  # what runner.restore does
        colocation.before_rollout()  # the loop's first call
        assert weight_version(url, 30) == "4"
        assert weight_checksums(url, 30) == {n: tensor_checksum(t) for n, t in trainer.tensors.items()}
        assert trainer.offloads >= 1 and "sync/bytes" in colocation.metrics()
    finally:
        bridge.close()
