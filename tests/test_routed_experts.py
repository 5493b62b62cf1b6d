"""MoE routing replay (R3), rollout half, for real: two embedded engines serving a tiny Qwen3-MoE with
--enable-return-routed-experts behind the real sgl-router. The routing the engines answer is checked against the
HF model's own top-k recomputed from a teacher-forced forward over prompt + output; the router's handling of the
field, the client's direct route, a partial rollout's concatenation and a whole rollout step are checked end to
end. Field names and the encoding are checked against the installed sglang source."""
from __future__ import annotations

import ast
import asyncio
import base64
import importlib.util
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from glue.fleet.engine_client import EngineClient
from glue.fleet.fleet import RolloutFleet
from glue.rollout.manager import RolloutManager, append_generation
from glue.rollout.routed_experts import RoutedExpertsLayout
from glue.types import Sample, TrainBatch
from helpers.routing import reference_routing

SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
PROMPT = [0, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def fleet(tiny_moe_model_dir, tmp_path_factory):
    fleet = RolloutFleet(model_path=tiny_moe_model_dir, num_engines=2, log_dir=tmp_path_factory.mktemp("r3_logs"),
                         engine_args=["--num-threads", "1", "--enable-return-routed-experts"],
                         engine_startup_timeout_s=120)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def layout(tiny_moe_model_dir) -> RoutedExpertsLayout:
    return RoutedExpertsLayout.from_model_dir(tiny_moe_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_moe_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).eval()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def decode(text: str, layout: RoutedExpertsLayout) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.int32).reshape(-1, layout.num_layers, layout.top_k)


def sglang_srt() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (`pip install --no-deps sglang` provides the source this test reads)")
    return Path(next(iter(spec.submodule_search_locations))) / "srt"


def test_request_and_answer_names_and_the_encoding_are_sglangs():
    srt = sglang_srt()
    tree = ast.parse((srt / "managers" / "io_struct.py").read_text())
    generate = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    fields = {s.target.id: ast.unparse(s.annotation) for s in generate.body if isinstance(s, ast.AnnAssign)}
    assert fields["return_routed_experts"] == "bool" and fields["routed_experts_start_len"] == "int"
    answer = (srt / "managers" / "tokenizer_manager.py").read_text()
    assert 'meta_info["routed_experts"] = val' in answer and "b64encode(val.numpy().tobytes())" in answer
    capturer = (srt / "state_capturer" / "routed_experts.py").read_text()
    assert "pybase64.b64decode" in capturer and "dtype=np.int32" in capturer  # int32 values, base64
    rows = (srt / "state_capturer" / "base.py").read_text()
    assert "(num_tokens, num_layers, topk_size)" in rows and "[start_len : seqlen - 1]" in rows


def test_the_engine_answers_each_tokens_experts_equal_to_the_models_own_top_k(fleet, layout, hf_model):
    out = post(f"{fleet.engine_urls[0]}/generate", {"input_ids": PROMPT, "sampling_params": SAMPLING,
                                                    "return_routed_experts": True})
    routing = decode(out["meta_info"]["routed_experts"], layout)
    tokens = PROMPT + out["output_ids"]
    assert routing.shape == (len(tokens) - 1, 2, 2)  # every token run, 2 layers, top-2
    np.testing.assert_array_equal(routing, reference_routing(hf_model, tokens))
    plain = post(f"{fleet.engine_urls[0]}/generate", {"input_ids": PROMPT, "sampling_params": SAMPLING})
    assert "routed_experts" not in plain["meta_info"]


def test_a_resumed_request_brings_the_routing_of_its_new_positions_and_the_sample_concatenates(fleet, layout,
                                                                                              hf_model):
    engine = fleet.engine_urls[1]
    sample = Sample(prompt_tokens=PROMPT)
    first = post(f"{engine}/generate", {"input_ids": PROMPT, "sampling_params": SAMPLING, "return_logprob": True,
                                        "return_routed_experts": True, "routed_experts_start_len": 0})
    append_generation(sample, first, layout)
    assert sample.routed_experts.shape == (len(PROMPT) + 6 - 1, 2, 2)
    start = len(sample.routed_experts)  # the last token, not run yet
    second = post(f"{engine}/generate", {"input_ids": sample.prompt_tokens + sample.response_tokens,
                                         "sampling_params": SAMPLING, "return_logprob": True,
                                         "return_routed_experts": True, "routed_experts_start_len": start})
    assert len(decode(second["meta_info"]["routed_experts"], layout)) == 6
    append_generation(sample, second, layout)
    sample.reward = 0.0
    sample.validate()
    assert sample.routed_experts.dtype == np.int8 and sample.routed_experts.shape == (len(PROMPT) + 12 - 1, 2, 2)
    np.testing.assert_array_equal(sample.routed_experts, reference_routing(hf_model, PROMPT + sample.response_tokens))


def test_sgl_router_drops_the_field_so_the_client_sends_r3_requests_to_the_engines(fleet, layout):
    through_router = post(f"{fleet.router_url}/generate", {"input_ids": PROMPT, "sampling_params": SAMPLING,
                                                           "return_routed_experts": True})
    assert through_router["output_ids"] and "routed_experts" not in through_router["meta_info"]

    client = EngineClient(fleet.router_url, fleet.engine_urls)
    before = [server_state(u)["forward_count"] for u in fleet.engine_urls]

    async def run():
        try:
            return await asyncio.gather(*(client.generate(PROMPT, SAMPLING, routed_experts_start_len=0)
                                          for _ in range(6)))
        finally:
            await client.aclose()

    for out in asyncio.run(run()):
        assert decode(out["meta_info"]["routed_experts"], layout).shape == (len(PROMPT) + 6 - 1, 2, 2)
    after = [server_state(u)["forward_count"] for u in fleet.engine_urls]
    assert all(a > b for a, b in zip(after, before)), f"both engines serve direct requests: {before} -> {after}"


def server_state(engine_url: str) -> dict:
    with urllib.request.urlopen(f"{engine_url}/get_server_info", timeout=5) as resp:
        return json.loads(resp.read())["internal_states"][0]


def test_a_rollout_step_with_routing_on_yields_samples_and_a_train_batch_with_routing(fleet, layout, hf_model):
    client = EngineClient(fleet.router_url, fleet.engine_urls)
    manager = RolloutManager(function_path="rollout_fns.single_turn:generate_group",
                             task_path="rollout_fns.toy_tasks:EchoTask", client=client,
                             sampling_params={"max_new_tokens": 8, "temperature": 1.0}, prompts_per_step=2,
                             samples_per_prompt=3, seed=0, routed_experts=layout)

    async def run():
        try:
            return await manager.generate_step()
        finally:
            await client.aclose()

    samples = [s for g in asyncio.run(run()) for s in g.samples]
    assert len(samples) == 6 and all(s.status.value in ("completed", "truncated") for s in samples)
    for s in samples:
        tokens = s.prompt_tokens + s.response_tokens
        np.testing.assert_array_equal(s.routed_experts, reference_routing(hf_model, tokens))
    batch = TrainBatch.from_samples(samples, [0.0] * len(samples))
    T = batch.tokens.shape[1]
    assert batch.routed_experts.shape == (6, T, 2, 2) and batch.routed_experts.dtype == torch.int8
    for b, s in enumerate(samples):
        n = batch.seq_lens[b]
        np.testing.assert_array_equal(batch.routed_experts[b, : n - 1].numpy(), s.routed_experts)
        assert (batch.routed_experts[b, n - 1:] == -1).all()  # the last token and the padding
    # the step's payload is reported: 2 layers x top-2 int8 = 4 bytes per routed position
    from glue.loop.batch import rollout_metrics
    from glue.types import Group

    metrics = rollout_metrics([Group(group_id=0, samples=samples)])
    assert metrics["moe/routing_bytes_per_token"] == 4.0
    assert metrics["moe/routing_bytes"] == 4.0 * sum(len(s.prompt_tokens) + len(s.response_tokens) - 1 for s in samples)


def test_a_sample_aborted_mid_generation_and_resumed_carries_the_routing_of_both_requests(fleet, layout, hf_model):
    client = EngineClient(fleet.router_url, fleet.engine_urls)
    manager = RolloutManager(function_path="rollout_fns.single_turn:generate_group",
                             task_path="rollout_fns.toy_tasks:EchoTask", client=client,
                             sampling_params={"max_new_tokens": 150, "temperature": 1.0, "ignore_eos": True},
                             prompts_per_step=1, samples_per_prompt=2, seed=1, routed_experts=layout)

    async def run():
        try:
            group = asyncio.ensure_future(manager.next_group()[1])
            while sum(server_state(u)["forward_count"] for u in fleet.engine_urls) < started + 20:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(client.pause_generation, "abort")  # hands back the tokens so far
            await asyncio.to_thread(client.continue_generation)
            return await group
        finally:
            await client.aclose()

    started = sum(server_state(u)["forward_count"] for u in fleet.engine_urls)
    samples = asyncio.run(run()).samples
    assert [s.metadata.get("resumes") for s in samples] == [1, 1]
    for s in samples:
        assert len(s.response_tokens) == 150
        tokens = s.prompt_tokens + s.response_tokens
        np.testing.assert_array_equal(s.routed_experts, reference_routing(hf_model, tokens))
