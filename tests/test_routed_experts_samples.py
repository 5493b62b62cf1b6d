"""MoE routing replay (R3) without processes: the wire decoding, a sample's routing through partial rollouts and
checkpoints, the train batch layout, the engine's recorder and request checks, and the client's engine choice.
Expected arrays are written out by hand."""
from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import torch

from glue.rollout.routed_experts import RoutedExpertsLayout, append_routed_experts, start_len_for
from glue.types import Sample, TrainBatch
from helpers.routing import LAYOUT, rows, wire


def test_the_layout_keeps_ids_in_int8_up_to_127_experts_and_in_int16_beyond():
    assert RoutedExpertsLayout(num_layers=48, top_k=8, num_experts=127).dtype == np.int8
    assert RoutedExpertsLayout(num_layers=48, top_k=8, num_experts=128).dtype == np.int16
    with pytest.raises(ValueError, match="num_experts"):
        RoutedExpertsLayout(num_layers=1, top_k=1, num_experts=40000)


def test_the_layout_comes_from_an_moe_config_and_a_dense_model_is_refused(tiny_moe_model_dir, tiny_model_dir):
    assert RoutedExpertsLayout.from_model_dir(tiny_moe_model_dir) == RoutedExpertsLayout(num_layers=2, top_k=2,
                                                                                         num_experts=4)
    with pytest.raises(ValueError, match="not an MoE model"):
        RoutedExpertsLayout.from_model_dir(tiny_model_dir)


def test_a_partial_rollouts_answers_concatenate_to_prompt_plus_response_minus_one_rows():
    sample = Sample(prompt_tokens=[0, 4, 5])
    assert start_len_for(sample) == 0
    sample.append_response([6, 7], [-0.1, -0.2], version=0)  # aborted after 2 tokens: positions 0..3 were run
    append_routed_experts(sample, {"routed_experts": wire(rows(0, 4))}, LAYOUT, new_tokens=2)
    assert start_len_for(sample) == 4  # the resumed request sends 5 tokens and asks from the last one on
    sample.append_response([8, 9, 10], [-0.3, -0.4, -0.5], version=1)  # after the sync: positions 4..6
    append_routed_experts(sample, {"routed_experts": wire(rows(4, 3))}, LAYOUT, new_tokens=3)
    assert sample.routed_experts.dtype == np.int8 and sample.routed_experts.shape == (7, 2, 2)
    np.testing.assert_array_equal(sample.routed_experts, np.array(rows(0, 7)))
    sample.reward = 1.0
    sample.validate()


def test_an_answer_without_routing_or_with_other_rows_is_refused_and_one_without_tokens_adds_none():
    sample = Sample(prompt_tokens=[0, 4, 5])
    append_routed_experts(sample, {"routed_experts": ""}, LAYOUT, new_tokens=0)  # aborted while queued
    assert sample.routed_experts is None
    sample.append_response([6], [-0.1], version=0)
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        append_routed_experts(sample, {}, LAYOUT, new_tokens=1)
    with pytest.raises(ValueError, match="4 rows; expected 3"):
        append_routed_experts(sample, {"routed_experts": wire(rows(0, 4))}, LAYOUT, new_tokens=1)
    with pytest.raises(ValueError, match="whole rows"):
        append_routed_experts(sample, {"routed_experts": wire([[[1, 2, 3]]])}, LAYOUT, new_tokens=1)
    with pytest.raises(ValueError, match=r"outside \[-1, 4\)"):
        append_routed_experts(sample, {"routed_experts": wire([[[0, 1], [2, 4]]] * 3)}, LAYOUT, new_tokens=1)


def test_validate_refuses_routing_that_does_not_cover_prompt_plus_response_minus_one():
    sample = Sample(prompt_tokens=[0, 4], response_tokens=[5, 6], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0],
                    versions=[0, 0], reward=0.0, routed_experts=np.zeros((4, 2, 2), dtype=np.int8))
    with pytest.raises(ValueError, match=r"routed_experts must be an integer array \[3, layers, top_k\]"):
        sample.validate()


def test_routing_survives_a_json_checkpoint_compactly():
    routing = np.array(rows(0, 4), dtype=np.int16)
    sample = Sample(prompt_tokens=[0, 4, 5], response_tokens=[6, 7], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0],
                    versions=[0, 0], routed_experts=routing)
    text = json.dumps(sample.to_dict())
    back = Sample.from_dict(json.loads(text))
    assert back.routed_experts.dtype == np.int16
    np.testing.assert_array_equal(back.routed_experts, routing)
    assert json.loads(text)["routed_experts"]["shape"] == [4, 2, 2]
    assert Sample.from_dict(Sample(prompt_tokens=[1]).to_dict()).routed_experts is None


def test_the_train_batch_aligns_routing_with_token_positions_and_pads_with_minus_one():
    a = Sample(prompt_tokens=[0, 4], response_tokens=[5, 6, 7], loss_mask=[1, 1, 1], rollout_logprobs=[0.0] * 3,
               versions=[0] * 3, reward=1.0, routed_experts=np.array(rows(0, 4), dtype=np.int8))
    b = Sample(prompt_tokens=[0, 4, 5], response_tokens=[6], loss_mask=[1], rollout_logprobs=[0.0],
               versions=[0], reward=0.0, routed_experts=np.array(rows(10, 3), dtype=np.int8))
    batch = TrainBatch.from_samples([a, b], [1.0, -1.0])
    assert batch.tokens.shape == (2, 5) and batch.routed_experts.shape == (2, 5, 2, 2)
    assert batch.routed_experts.dtype == torch.int8
    expected = np.full((2, 5, 2, 2), -1)
    expected[0, :4] = rows(0, 4)  # tokens 0..3 of row 0; token 4 (the last) has none
    expected[1, :3] = rows(10, 3)  # tokens 0..2 of row 1; token 3 (the last) and the padding have none
    np.testing.assert_array_equal(batch.routed_experts.numpy(), expected)
    # RouterReplay's target for layer 1 in megatron's sequence-first token order: [T * B, K]
    target = batch.routed_experts[:, :, 1].transpose(0, 1).reshape(-1, 2)
    assert target[1].tolist() == rows(10, 1)[0][1] and target[2].tolist() == rows(1, 1)[0][1]


def test_the_train_batch_has_no_routing_without_it_and_refuses_a_mix():
    plain = Sample(prompt_tokens=[0, 4], response_tokens=[5], loss_mask=[1], rollout_logprobs=[0.0], versions=[0],
                   reward=0.0)
    assert TrainBatch.from_samples([plain, plain], [0.0, 0.0]).routed_experts is None
    routed = Sample(**{**plain.__dict__, "routed_experts": np.zeros((2, 2, 2), dtype=np.int8)})
    with pytest.raises(ValueError, match="every sample or none"):
        TrainBatch.from_samples([plain, routed], [0.0, 0.0])


def test_the_recorder_keeps_each_positions_first_routing_and_marks_dense_layers_minus_one():
    import transformers

    from glue.embedded_engine.sequence import Sequence
    from glue.embedded_engine.request_schema import GenerationRequest, SamplingSettings
    from glue.embedded_engine.routed_experts import RoutingRecorder, encode_routed_experts

    config = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[0])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    recorder = RoutingRecorder(model)
    assert set(recorder.routers) == {1}
    request = GenerationRequest(rid="r", input_ids=[3, 4, 5], sampling=SamplingSettings(max_new_tokens=4),
                                return_logprob=False, return_routed_experts=True)
    seq = Sequence(request=request, on_done=lambda s: None, generator=torch.Generator())
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        model(input_ids=ids[:, :3])
        recorder.record([seq], [0], 3)  # prefill: positions 0..2
        first = torch.cat(seq.routing).clone()
        model.model.layers[1].mlp.gate.weight.mul_(-1)  # new weights route differently
        [logits] = model(input_ids=ids, output_router_logits=True).router_logits  # the one MoE layer
        recorder.record([seq], [0], 4)  # a retracted request's second prefill: only position 3 is new
    routing = torch.cat(seq.routing)
    assert seq.routed_len == 4 and torch.equal(routing[:3], first)
    assert (routing[:, 0] == -1).all()  # layer 0 is dense
    assert torch.equal(routing[3, 1], torch.topk(torch.softmax(logits[3], -1), 2).indices.int())
    assert not torch.equal(routing[:3, 1], torch.topk(torch.softmax(logits[:3], -1), 2).indices.int())
    answer = np.frombuffer(base64.b64decode(encode_routed_experts(seq.routing, 1, 5)), dtype=np.int32)
    np.testing.assert_array_equal(answer.reshape(-1, 2, 2), torch.cat(seq.routing)[1:4].numpy())


def test_the_engine_refuses_routing_it_does_not_record_and_a_start_past_the_prompt():
    from glue.embedded_engine.request_schema import RequestError, parse_generate

    body = {"input_ids": [1, 2, 3], "return_routed_experts": True}
    with pytest.raises(RequestError, match="--enable-return-routed-experts"):
        parse_generate(body, vocab_size=32, max_context=64, next_rid=lambda: "r")
    [request], _ = parse_generate({**body, "routed_experts_start_len": 3}, vocab_size=32, max_context=64,
                                  next_rid=lambda: "r", records_routing=True)
    assert request.return_routed_experts and request.routed_experts_start_len == 3
    with pytest.raises(RequestError, match="more than the 3 input tokens"):
        parse_generate({**body, "routed_experts_start_len": 4}, vocab_size=32, max_context=64, next_rid=lambda: "r",
                       records_routing=True)


def test_the_client_sends_r3_requests_to_the_engine_with_the_fewest_in_flight_taking_ties_in_turn():
    from glue.fleet.engine_client import EngineClient

    client = EngineClient("http://router", ["http://e0", "http://e1", "http://e2"])
    assert [client._pick_engine() for _ in range(4)] == ["http://e0/generate", "http://e1/generate",
                                                         "http://e2/generate", "http://e0/generate"]
    client._in_flight_by_url.update({"http://e0": 2, "http://e1": 1, "http://e2": 3})
    assert {client._pick_engine() for _ in range(3)} == {"http://e1/generate"}


def test_the_single_turn_restart_policy_drops_the_routing_of_the_thrown_away_tokens():
    from glue.rollout.manager import RolloutContext
    from rollout_fns.single_turn import generate_one

    class Engine:
        """Answers SGLang's JSON: first an abort after 2 tokens, then a full answer of 3 tokens."""

        def __init__(self):
            self.calls = []

        async def generate(self, input_ids, sampling_params, return_logprob=True, routed_experts_start_len=None):
            self.calls.append(routed_experts_start_len)
            n, kind = (2, "abort") if len(self.calls) == 1 else (3, "length")
            out = list(range(10, 10 + n))
            return {"output_ids": out, "meta_info": {
                "output_token_logprobs": [[-0.5, t, None] for t in out], "finish_reason": {"type": kind},
                "weight_version": "0", "routed_experts": wire(rows(routed_experts_start_len, len(input_ids) + n - 1
                                                                   - routed_experts_start_len))}}

    engine = Engine()
    ctx = RolloutContext(client=engine, sampling_params={"max_new_tokens": 3}, reward_fn=lambda s: 0.0, group_id=0,
                         partial_rollouts="restart", routed_experts=LAYOUT)
    sample = asyncio.run(generate_one(ctx, {"prompt_tokens": [0, 4]}, 0))
    assert engine.calls == [0, 0] and sample.metadata["discarded_tokens"] == 2
    np.testing.assert_array_equal(sample.routed_experts, np.array(rows(0, 4)))


def test_an_answer_aborted_in_sglangs_waiting_queue_without_routing_is_resumed_not_a_failed_group():
    """SGLang's `_handle_abort_req` (tokenizer_manager.py) answers a request aborted in its waiting queue (retracted
    there, then paused with mode "abort") with the tokens it had streamed and no `routed_experts`: the sample drops
    those tokens, stays aborted and the resumed request generates them again with their routing."""
    from glue.loop.batch import rollout_metrics
    from glue.rollout.manager import RolloutContext
    from glue.types import Group
    from rollout_fns.single_turn import generate_one

    class Engine:
        """First SGLang's waiting-queue abort after 2 streamed tokens (no routing), then 3 tokens with routing."""

        def __init__(self):
            self.calls = []

        async def generate(self, input_ids, sampling_params, return_logprob=True, routed_experts_start_len=None):
            self.calls.append((len(input_ids), routed_experts_start_len))
            if len(self.calls) == 1:
                return {"output_ids": [10, 11], "meta_info": {
                    "output_token_logprobs": [[-0.5, 10, None], [-0.5, 11, None]], "weight_version": "0",
                    "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}
            out = [12, 13, 14]
            return {"output_ids": out, "meta_info": {
                "output_token_logprobs": [[-0.5, t, None] for t in out], "finish_reason": {"type": "length"},
                "weight_version": "1", "routed_experts": wire(rows(routed_experts_start_len, len(input_ids) + 3 - 1
                                                                   - routed_experts_start_len))}}

    engine = Engine()
    ctx = RolloutContext(client=engine, sampling_params={"max_new_tokens": 3}, reward_fn=lambda s: 1.0, group_id=0,
                         routed_experts=LAYOUT)
    sample = asyncio.run(generate_one(ctx, {"prompt_tokens": [0, 4]}, 0))
    assert engine.calls == [(2, 0), (2, 0)]  # resumed from the prompt: the 2 unrouted tokens were dropped
    assert sample.response_tokens == [12, 13, 14] and sample.versions == [1, 1, 1]
    assert sample.metadata["aborts_without_routing"] == 1 and sample.metadata["discarded_tokens"] == 2
    np.testing.assert_array_equal(sample.routed_experts, np.array(rows(0, 4)))
    sample.validate()
    metrics = rollout_metrics([Group(group_id=0, samples=[sample])])
    assert metrics["rollout/aborts_without_routing"] == 1.0 and metrics["rollout/discarded_tokens"] == 2.0


def test_a_layout_from_a_deepseek_or_qwen_moe_config_names_its_dense_layers(tmp_path):
    def layout_of(config: dict) -> RoutedExpertsLayout:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return RoutedExpertsLayout.from_model_dir(tmp_path)

    deepseek = {"num_hidden_layers": 6, "num_experts_per_tok": 2, "n_routed_experts": 8, "first_k_dense_replace": 1,
                "moe_layer_freq": 2}  # layer i has experts iff i >= 1 and i % 2 == 0
    assert layout_of(deepseek).dense_layers == (0, 1, 3, 5)
    qwen3 = {"num_hidden_layers": 4, "num_experts_per_tok": 2, "num_experts": 8, "mlp_only_layers": [3],
             "decoder_sparse_step": 1}
    assert layout_of(qwen3).dense_layers == (3,)
    qwen2 = {"num_hidden_layers": 4, "num_experts_per_tok": 2, "num_experts": 8, "decoder_sparse_step": 2}
    assert layout_of(qwen2).dense_layers == (0, 2)  # (i + 1) % 2 == 0 has experts
    mixtral = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "num_local_experts": 8}
    assert layout_of(mixtral).dense_layers == ()


def test_sglangs_zeros_in_layers_without_experts_decode_as_no_expert_not_expert_0():
    """SGLang gives every decoder layer a slot and leaves a dense layer's at 0 (state_capturer/base.py: a zeroed
    buffer that only MoE routers write); the embedded engine writes -1. Both decode to -1 there."""
    from glue.rollout.routed_experts import decode_routed_experts

    layout = RoutedExpertsLayout(num_layers=3, top_k=2, num_experts=4, dense_layers=(0,))
    sglang = [[[0, 0], [1, 3], [2, 0]], [[0, 0], [0, 2], [3, 1]]]  # 2 positions; layer 0 dense
    embedded = [[[-1, -1], [1, 3], [2, 0]], [[-1, -1], [0, 2], [3, 1]]]
    expected = np.array(embedded, dtype=np.int8)
    np.testing.assert_array_equal(decode_routed_experts(wire(sglang), layout), expected)
    np.testing.assert_array_equal(decode_routed_experts(wire(embedded), layout), expected)
    with pytest.raises(ValueError, match="dense_layers"):
        RoutedExpertsLayout(num_layers=3, top_k=2, num_experts=4, dense_layers=(3,))
