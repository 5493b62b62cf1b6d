"""HF <-> megatron-core name/layout conversion and tensor-parallel sharding (pure tensor tier)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from weight_sync.convert import fuse_qkv, gather_from_tp, hf_to_megatron, megatron_to_hf, shard_for_tp

SHAPE = dict(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, tie_word_embeddings=False)


def _distinct_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every element of every tensor gets a different value, so any layout mix-up changes the result."""
    state, start = {}, 0
    for name, t in model.state_dict().items():
        state[name] = (torch.arange(t.numel(), dtype=torch.float32) + start).reshape(t.shape) * 1e-3
        start += t.numel()
    return state


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(family):
    torch.manual_seed(0)
    if family == "qwen2":
        config = Qwen2Config(**SHAPE)
        model = Qwen2ForCausalLM(config)
    else:
        config = LlamaConfig(**SHAPE)
        model = LlamaForCausalLM(config)
    hf_state = _distinct_state(model)
    mcore = hf_to_megatron(hf_state, config)
    has_bias = "decoder.layers.0.self_attention.linear_qkv.bias" in mcore
    assert has_bias == (family == "qwen2"), "Qwen2 carries a qkv bias, Llama does not"
    # per layer: 2 norms, linear_proj, fc2, fused qkv, fused fc1 (+ qkv bias); + embedding, final norm, output
    assert len(mcore) == 2 * (7 if has_bias else 6) + 3
    back = megatron_to_hf(mcore, config)
    assert set(back) == set(hf_state)
    for name, t in hf_state.items():
        assert torch.equal(back[name], t), name


def test_fused_qkv_is_group_major_with_each_groups_queries_then_key_then_value():
    # 4 query heads, 2 kv groups, head_dim 1, hidden 1: q heads 0,1 share group 0; q heads 2,3 share group 1.
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, ng=2, head_dim=1)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]


def test_tp2_shard_of_qkv_holds_whole_query_groups_and_fc1_holds_both_halves():
    config = Qwen2Config(**SHAPE)
    mcore = hf_to_megatron(_distinct_state(Qwen2ForCausalLM(config)), config)
    qkv = mcore["decoder.layers.0.self_attention.linear_qkv.weight"]  # [2 groups * (2 q + k + v) * 16, 64]
    assert torch.equal(shard_for_tp("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 1, 2), qkv[64:])
    fc1 = mcore["decoder.layers.0.mlp.linear_fc1.weight"]  # [gate 128; up 128]
    shard = shard_for_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    assert torch.equal(shard, torch.cat([fc1[64:128], fc1[192:256]]))
    proj = mcore["decoder.layers.0.self_attention.linear_proj.weight"]  # row-parallel: columns split
    assert torch.equal(shard_for_tp("decoder.layers.0.self_attention.linear_proj.weight", proj, 0, 2), proj[:, :32])


def test_shard_then_gather_at_tp2_is_bit_exact_for_every_tensor():
    config = Qwen2Config(**SHAPE)
    mcore = hf_to_megatron(_distinct_state(Qwen2ForCausalLM(config)), config)
    for name, full in mcore.items():
        shards = [shard_for_tp(name, full, r, 2) for r in range(2)]
        if "norm" not in name:
            assert shards[0].numel() * 2 == full.numel(), f"{name} should be split, not replicated"
        assert torch.equal(gather_from_tp(name, shards), full), name


def test_a_tp_size_that_does_not_divide_the_tensor_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3"):
        shard_for_tp("output_layer.weight", torch.zeros(32, 4), 0, 3)


def test_a_missing_hf_weight_names_the_weight():
    config = LlamaConfig(**SHAPE)
    state = _distinct_state(LlamaForCausalLM(config))
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(state, config)
