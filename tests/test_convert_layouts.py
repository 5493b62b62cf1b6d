"""HF <-> megatron conversion across parallel layouts (pure tensor tier): every family's name table, TP/PP/EP
placement, stage-local and expert-local numbering, vocab padding, and the errors that name the fix."""
from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from safetensors.torch import load_file

from weight_sync.convert import ParallelLayout, hf_to_megatron_local, megatron_to_hf, padded_vocab_size

BASE = dict(vocab_size=30, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # head_dim != hidden / heads, as in Qwen3
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {"head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "n_shared_experts": 1, "first_k_dense_replace": 1, "attention_bias": True, "use_qk_norm": True,
                  "partial_rotary_factor": 0.5}),
    # GLM-4: [gate; up] fused in the checkpoint, norms after the attention and the MLP
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 32, "attention_bias": True, "partial_rotary_factor": 0.5,
                                               "pad_token_id": 0}),
    # multi-latent attention: as many key heads as query heads, a query rank, latent widths TP 2 splits evenly
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
                     "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                     "topk_group": 1}),
    # fused experts (gate / up interleaved, down transposed, biases), attention sinks split with the heads
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                 "sliding_window": 4}),
}


def checkpoint(family: str, tmp_path_factory, **overrides) -> tuple[object, dict[str, torch.Tensor]]:
    """(HF config, the state as `save_pretrained` writes it): checkpoint names, so Qwen3-MoE experts are per-expert
    tensors even though transformers 5 fuses them in memory. Every element is distinct, so any mix-up shows."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        start = 0
        for p in model.parameters():
            p.copy_((torch.arange(p.numel(), dtype=torch.float32) + start).reshape(p.shape))
            start += p.numel()
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return config, load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: checkpoint(family, tmp_path_factory) for family in FAMILIES}


def layouts(num_layers: int, tp: int = 1, pp: int = 1, ep: int = 1, padded: int | None = None) -> list[ParallelLayout]:
    """Every rank of a TP x PP x EP grid (EP ranks also hold a copy of the dense weights, as in megatron)."""
    return [ParallelLayout.even(num_layers, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep,
                                padded_vocab_size=padded)
            for p, e, t in itertools.product(range(pp), range(ep), range(tp))]


GRIDS = {"tp1": dict(), "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_pp2": dict(tp=2, pp=2)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_hf_to_megatron_ranks_to_hf_is_bit_exact_for_every_family_and_layout(checkpoints, family, grid):
    config, hf_state = checkpoints[family]
    ranks = layouts(4, **GRIDS[grid], padded=padded_vocab_size(30, GRIDS[grid].get("tp", 1), divisible_by=16))
    states = [hf_to_megatron_local(hf_state, config, layout) for layout in ranks]
    back = megatron_to_hf(states, config, ranks)
    assert set(back) == set(hf_state), set(back) ^ set(hf_state)
    for name, t in hf_state.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss"])
def test_a_moe_family_round_trips_through_tp2_pp2_ep2_with_vocab_padding(checkpoints, family):
    config, hf_state = checkpoints[family]
    ranks = layouts(4, tp=2, pp=2, ep=2, padded=64)
    assert len(ranks) == 8
    states = [hf_to_megatron_local(hf_state, config, layout) for layout in ranks]
    back = megatron_to_hf(states, config, ranks)
    assert set(back) == set(hf_state)
    assert all(torch.equal(back[n], t) for n, t in hf_state.items())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_an_uneven_pipeline_of_one_and_three_layers_round_trips_bit_exactly(checkpoints, family):
    # num_layers_in_first_pipeline_stage=1: stage 0 holds layer 0 and the embedding, stage 1 layers 1-3 and the head
    config, hf_state = checkpoints[family]
    ranks = [ParallelLayout.pipeline(4, pp_rank=p, pp_size=2, first=1, tp_rank=t, tp_size=2, padded_vocab_size=32)
             for p in range(2) for t in range(2)]
    states = [hf_to_megatron_local(hf_state, config, layout) for layout in ranks]
    assert {n.split(".")[2] for n in states[0] if n.startswith("decoder.layers.")} == {"0"}
    assert {n.split(".")[2] for n in states[2] if n.startswith("decoder.layers.")} == {"0", "1", "2"}
    # global layer 1 is the second stage's local layer 0
    assert torch.equal(states[2]["decoder.layers.0.self_attention.q_layernorm.weight"],
                       hf_state["model.layers.1.self_attn.q_norm.weight"])
    back = megatron_to_hf(states, config, ranks)
    assert set(back) == set(hf_state), set(back) ^ set(hf_state)
    for name, t in hf_state.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_hf_names_follow_each_familys_checkpoint_conventions(checkpoints):
    moe = set(checkpoints["qwen3_moe"][1])
    for name in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.3.mlp.experts.0.down_proj.weight",
                 "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.self_attn.k_norm.weight", "lm_head.weight"):
        assert name in moe, name
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoints["qwen2"][1]
    assert "model.layers.0.self_attn.q_proj.bias" not in checkpoints["qwen3"][1]
    # per layer: q, k, v, o, q_norm, k_norm, 2 norms, router, 4 experts x 3; + embed, norm, lm_head
    assert len(moe) == 4 * (8 + 1 + 12) + 3


def test_pipeline_stages_number_their_layers_from_zero(checkpoints):
    config, hf_state = checkpoints["qwen3"]
    first, last = (hf_to_megatron_local(hf_state, config, layout) for layout in layouts(4, pp=2))
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" not in last
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert "output_layer.weight" not in first and "decoder.final_layernorm.weight" not in first
    assert {n.split(".")[2] for n in last if n.startswith("decoder.layers.")} == {"0", "1"}
    # global layer 3 is the second stage's local layer 1
    assert torch.equal(last["decoder.layers.1.self_attention.q_layernorm.weight"],
                       hf_state["model.layers.3.self_attn.q_norm.weight"])


def test_expert_parallel_ranks_number_their_experts_from_zero(checkpoints):
    config, hf_state = checkpoints["qwen3_moe"]
    rank0, rank1 = (hf_to_megatron_local(hf_state, config, layout) for layout in layouts(4, ep=2))
    experts = {n.split(".")[6] for n in rank1 if ".local_experts." in n}
    assert experts == {"0", "1"}
    # global expert 2 is EP rank 1's local expert 0; megatron fuses [gate; up] into linear_fc1
    fc1 = rank1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf_state["model.layers.0.mlp.experts.2.gate_proj.weight"],
                                       hf_state["model.layers.0.mlp.experts.2.up_proj.weight"]]))
    # the router and the attention are not expert-parallel: both ranks hold them whole
    for name in ("decoder.layers.0.mlp.router.weight", "decoder.layers.0.self_attention.linear_qkv.weight"):
        assert torch.equal(rank0[name], rank1[name])


def test_expert_mlps_split_over_tensor_parallel_ranks_like_the_dense_mlp(checkpoints):
    config, hf_state = checkpoints["qwen3_moe"]
    shard = hf_to_megatron_local(hf_state, config, layouts(4, tp=2)[1])
    gate = hf_state["model.layers.1.mlp.experts.3.gate_proj.weight"]  # [32, 64]
    up = hf_state["model.layers.1.mlp.experts.3.up_proj.weight"]
    down = hf_state["model.layers.1.mlp.experts.3.down_proj.weight"]  # [64, 32]
    prefix = "decoder.layers.1.mlp.experts.local_experts.3."
    assert torch.equal(shard[prefix + "linear_fc1.weight"], torch.cat([gate[16:], up[16:]]))
    assert torch.equal(shard[prefix + "linear_fc2.weight"], down[:, 16:])


def test_gpt_oss_experts_are_slices_of_the_fused_checkpoint_tensors_deinterleaved_and_transposed(checkpoints):
    config, hf_state = checkpoints["gpt_oss"]
    shard = hf_to_megatron_local(hf_state, config, layouts(4, tp=2, ep=2)[3])  # EP rank 1, TP rank 1
    gate_up = hf_state["model.layers.2.mlp.experts.gate_up_proj"][3]  # [H=64, 2I=64], gate at even columns
    gate_up_bias = hf_state["model.layers.2.mlp.experts.gate_up_proj_bias"][3]
    down = hf_state["model.layers.2.mlp.experts.down_proj"][3]  # [I=32, H=64]: [in, out]
    prefix = "decoder.layers.2.mlp.experts.local_experts.1."  # global expert 3
    gate, up = gate_up[:, 0::2].T, gate_up[:, 1::2].T  # [32, 64] each; TP rank 1 holds rows 16..31 of each
    assert torch.equal(shard[prefix + "linear_fc1.weight"], torch.cat([gate[16:], up[16:]]))
    assert torch.equal(shard[prefix + "linear_fc1.bias"], torch.cat([gate_up_bias[0::2][16:], gate_up_bias[1::2][16:]]))
    assert torch.equal(shard[prefix + "linear_fc2.weight"], down.T[:, 16:])
    assert torch.equal(shard[prefix + "linear_fc2.bias"], hf_state["model.layers.2.mlp.experts.down_proj_bias"][3])
    # sinks split with the query heads (4 heads, TP rank 1 holds heads 2 and 3); the router whole with its bias
    assert torch.equal(shard["decoder.layers.2.self_attention.core_attention.softmax_offset"],
                       hf_state["model.layers.2.self_attn.sinks"][2:])
    assert torch.equal(shard["decoder.layers.2.mlp.router.bias"], hf_state["model.layers.2.mlp.router.bias"])


def test_vocab_padding_adds_zero_rows_that_the_way_back_drops(checkpoints):
    config, hf_state = checkpoints["llama"]
    assert padded_vocab_size(30, 2, divisible_by=16) == 32
    ranks = layouts(4, tp=2, padded=32)
    last = hf_to_megatron_local(hf_state, config, ranks[1])
    assert last["output_layer.weight"].shape == (16, 64)
    assert torch.equal(last["output_layer.weight"][:14], hf_state["lm_head.weight"][16:])
    assert not last["output_layer.weight"][14:].any()
    back = megatron_to_hf([hf_to_megatron_local(hf_state, config, r) for r in ranks], config, ranks)
    assert back["lm_head.weight"].shape == (30, 64)


def test_tied_embeddings_give_the_last_stage_a_copy_and_no_lm_head(tmp_path_factory):
    config, hf_state = checkpoint("qwen3", tmp_path_factory, tie_word_embeddings=True, num_hidden_layers=2)
    assert "lm_head.weight" not in hf_state
    ranks = layouts(2, pp=2)
    states = [hf_to_megatron_local(hf_state, config, r) for r in ranks]
    assert torch.equal(states[1]["output_layer.weight"], hf_state["model.embed_tokens.weight"])
    assert "output_layer.weight" not in hf_to_megatron_local(hf_state, config, ParallelLayout())
    back = megatron_to_hf(states, config, ranks)
    assert set(back) == set(hf_state)


def test_a_missing_rank_names_the_tensor_and_asks_for_every_rank(checkpoints):
    config, hf_state = checkpoints["qwen3_moe"]
    ranks = layouts(4, ep=2)
    states = [hf_to_megatron_local(hf_state, config, r) for r in ranks]
    with pytest.raises(KeyError, match="experts.2.gate_proj.weight.*pass the state dict of every"):
        megatron_to_hf(states[:1], config, ranks[:1])


def test_tensors_outside_the_name_table_are_refused_on_both_sides(checkpoints):
    config, hf_state = checkpoints["qwen3"]
    with pytest.raises(ValueError, match=r"not in the qwen3 name table.*q_proj.bias.*attention_bias"):
        hf_to_megatron_local({**hf_state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}, config)
    state = hf_to_megatron_local(hf_state, config)
    state["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.zeros(256)
    with pytest.raises(ValueError, match="linear_qkv.bias.*not in the name table|not in the name table.*linear_qkv.bias"):
        megatron_to_hf(state, config)


def test_a_tp_size_that_splits_a_query_group_is_refused_with_the_fix(checkpoints):
    config, hf_state = checkpoints["qwen3"]
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 must divide num_key_value_heads=2"):
        hf_to_megatron_local(hf_state, config, ParallelLayout(tp_rank=0, tp_size=4))


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "glm4", "gpt_oss"])
def test_shards_copied_one_at_a_time_into_the_hf_tensors_rebuild_the_checkpoint(checkpoints, family):
    """`shard_into_hf` at TP=2, the vocab of 30 padded to 32 and to 64 (the second shard all padding): every kind
    (row, column, vocab, q/k/v with bias, gate/up, replicated), shards taken in reverse rank order, gives the
    checkpoint's tensors bit for bit."""
    from weight_sync.convert import local_name, rules, shard_into_hf, shard_rank

    config, hf_state = checkpoints[family]
    for padded in (32, 64):
        ranks = layouts(4, tp=2, padded=padded)
        states = [hf_to_megatron_local(hf_state, config, layout) for layout in ranks]
        for rule in rules(config):
            hf = [torch.full_like(hf_state[name], -1.0) for name in rule.hf]
            for state, layout in reversed(list(zip(states, ranks))):
                rank, size = shard_rank(rule, layout)
                shard_into_hf(rule, state[local_name(rule, layout, 4)], rank, size, hf, config)
            for name, tensor in zip(rule.hf, hf):
                expected = hf_state[name]
                if rule.is_expert_slice:  # the rule fills its expert's slice of a tensor of every expert
                    tensor, expected = tensor[rule.expert], expected[rule.expert]
                assert torch.equal(tensor, expected), (padded, name, rule.expert)
