"""Routing capture (R3) for each MoE family the embedded engine serves: a tiny random model of each, built by
transformers, must record exactly the experts its family's formula picks, recomputed here from the router weights,
and must record something else once the router's choice is perturbed."""
from __future__ import annotations

import pytest
import torch
import transformers

from glue.embedded_engine.routed_experts import RoutingRecorder
from weight_sync.families import FAMILIES, MoeFamily

TOKENS = torch.tensor([[5, 17, 3, 42, 9, 60], [1, 2, 33, 33, 7, 50]])  # two rows: the recording is row-major
TOP_K = 2


def tiny(config: transformers.PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def run(model, recorder: RoutingRecorder) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One forward of TOKENS: the recorded routing `[tokens, layers, top_k]` and each layer's MoE block input
    `[tokens, hidden]` (what its router saw)."""
    seen = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0].flatten(0, -2)))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=TOKENS)
    finally:
        for hook in hooks:
            hook.remove()
    return recorder.take(*TOKENS.shape).flatten(0, 1), seen


def assert_recorded_as(model, recorder: RoutingRecorder, choice, dense: set[int], dense_value: int = -1,
                       unordered: bool = False) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Every MoE layer's recording equals `choice(layer.mlp, block_input)` (as sets per token where the family's
    top-k is `sorted=False`), every dense layer holds `dense_value`; returns what `run` returns."""
    recorded, seen = run(model, recorder)
    layers = len(model.model.layers)
    assert recorded.shape == (TOKENS.numel(), layers, TOP_K) and recorded.dtype == torch.int32
    assert sorted(recorder.routers) == [i for i in range(layers) if i not in dense]
    for i, layer in enumerate(model.model.layers):
        if i in dense:
            assert (recorded[:, i] == dense_value).all(), f"dense layer {i}"
            continue
        got, want = recorded[:, i], choice(layer.mlp, seen[i]).int()
        if unordered:
            got, want = got.sort(dim=-1).values, want.sort(dim=-1).values
        assert torch.equal(got, want), f"layer {i}: recorded {got.tolist()}, the formula picks {want.tolist()}"
    return recorded, seen


def softmax_top_k(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.softmax(h @ weight.T, dim=-1).topk(TOP_K, dim=-1).indices


def group_limited_top_k(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
                        topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's choice: sigmoid scores plus the correction bias, only the `topk_group` groups whose two best
    biased scores sum highest stay eligible, then the top-k of those."""
    grouped = (torch.sigmoid(h @ weight.T) + bias).view(len(h), n_group, -1)
    best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(topk_group, dim=-1).indices
    eligible = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter(1, best_groups, True)
    return grouped.masked_fill(~eligible[..., None], float("-inf")).flatten(1).topk(TOP_K, dim=-1).indices


def differs_somewhere(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)


def test_qwen3_moe_routing_is_recorded_as_the_top_k_of_its_softmaxed_router_logits():
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=TOP_K, moe_intermediate_size=8, mlp_only_layers=[0])
    model = tiny(config)
    recorder = RoutingRecorder(model)
    choice = lambda mlp, h: softmax_top_k(h, mlp.gate.weight)  # noqa: E731
    first, _ = assert_recorded_as(model, recorder, choice, dense={0})
    with torch.no_grad():
        model.model.layers[2].mlp.gate.weight.normal_()
    again, _ = assert_recorded_as(model, recorder, choice, dense={0})
    assert torch.equal(again[:, 1], first[:, 1]) and not torch.equal(again[:, 2], first[:, 2])


def test_mixtral_routing_is_recorded_as_the_top_k_of_its_softmaxed_router_logits():
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=TOP_K)
    model = tiny(config)
    recorder = RoutingRecorder(model)
    choice = lambda mlp, h: softmax_top_k(h, mlp.gate.weight)  # noqa: E731
    first, _ = assert_recorded_as(model, recorder, choice, dense=set())
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.neg_()
    again, _ = assert_recorded_as(model, recorder, choice, dense=set())
    assert not torch.equal(again[:, 0], first[:, 0])


def check_biased_group_limited_routing(config: transformers.PretrainedConfig, dense_value: int) -> None:
    """The recording of a DeepSeek-V3-style router (deepseek_v3, glm4_moe) with a random correction bias is its
    group-limited biased top-k; the bias and the group limit each change that choice for some token here, and a new
    bias changes what is recorded."""
    model = tiny(config)
    moe_layers = [layer.mlp for layer in model.model.layers[config.first_k_dense_replace:]]
    with torch.no_grad():
        for mlp in moe_layers:  # a wider router than the 0.02 init, so the scores, not only the bias, decide
            mlp.gate.weight.normal_(0.0, 0.5)
            mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    recorder = RoutingRecorder(model, dense_layer_value=dense_value)
    n_group, topk_group = config.n_group, config.topk_group
    choice = lambda mlp, h: group_limited_top_k(h, mlp.gate.weight, mlp.gate.e_score_correction_bias,  # noqa: E731
                                                n_group, topk_group)
    dense = set(range(config.first_k_dense_replace))
    first, seen = assert_recorded_as(model, recorder, choice, dense, dense_value, unordered=True)
    i, mlp = config.first_k_dense_replace, moe_layers[0]
    unbiased = group_limited_top_k(seen[i], mlp.gate.weight, torch.zeros(config.n_routed_experts), n_group, topk_group)
    ungrouped = group_limited_top_k(seen[i], mlp.gate.weight, mlp.gate.e_score_correction_bias, 1, 1)
    assert differs_somewhere(first[:, i], unbiased) and differs_somewhere(first[:, i], ungrouped)
    with torch.no_grad():
        for mlp in moe_layers:
            mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    again, _ = assert_recorded_as(model, recorder, choice, dense, dense_value, unordered=True)
    assert differs_somewhere(again[:, i], first[:, i])


def test_deepseek_v3_routing_is_recorded_as_its_biased_group_limited_top_k_choice():
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=TOP_K, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5)
    check_biased_group_limited_routing(config, dense_value=-1)


def test_glm4_moe_routing_is_recorded_as_its_biased_group_limited_top_k_choice_with_the_strict_dense_zero():
    config = transformers.Glm4MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=TOP_K,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5)
    check_biased_group_limited_routing(config, dense_value=0)


def test_gpt_oss_routing_is_recorded_as_the_top_k_of_its_biased_router_logits():
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
                                       num_experts_per_tok=TOP_K)
    model = tiny(config)
    recorder = RoutingRecorder(model)
    choice = lambda mlp, h: (h @ mlp.router.weight.T + mlp.router.bias).topk(TOP_K, dim=-1).indices  # noqa: E731
    first, _ = assert_recorded_as(model, recorder, choice, dense=set())
    with torch.no_grad():
        model.model.layers[1].mlp.router.bias.normal_(0.0, 1.0)
    again, _ = assert_recorded_as(model, recorder, choice, dense=set())
    assert not torch.equal(again[:, 1], first[:, 1])


def test_a_dense_model_is_refused_in_one_line_naming_the_routers_looked_for():
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ValueError, match=r"no MoE top-k routers \(a \*TopKRouter at model\.layers\[i\]\.mlp\.gate "
                                         r"or \.mlp\.router\)") as refused:
        RoutingRecorder(tiny(config))
    assert "\n" not in str(refused.value)


def test_a_moe_layer_whose_router_did_not_run_is_refused_rather_than_recorded_as_dense():
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=TOP_K)
    model = tiny(config)
    recorder = RoutingRecorder(model)
    model.model.layers[1].mlp.forward = lambda hidden_states: hidden_states  # as a fused kernel skipping the router
    with torch.no_grad():
        model(input_ids=TOKENS)
    with pytest.raises(RuntimeError, match=r"the routers of MoE layers \[1\] did not run in the last forward"):
        recorder.take(*TOKENS.shape)


@pytest.mark.parametrize("family", sorted(f.name for f in FAMILIES.values() if isinstance(f, MoeFamily)))
def test_the_rollout_sides_routing_layout_is_the_familys_own(tmp_path, family):
    # the sizes the rollout decodes each token's routing with come from the family (weight_sync.families), so its
    # dense layers are the layers the family's table gives no router
    from glue.embedded_engine.tiny_model import tiny_config
    from glue.rollout.routed_experts import RoutedExpertsLayout

    config = tiny_config(family=family, num_layers=3, num_experts=4)
    config.save_pretrained(tmp_path)
    layout = RoutedExpertsLayout.from_model_dir(tmp_path)
    routers = {rule.layer for rule in FAMILIES[family].rules(config) if rule.megatron.endswith("mlp.router.weight")}
    assert layout.dense_layers == tuple(i for i in range(3) if i not in routers)
    assert (layout.num_layers, layout.num_experts, layout.top_k) == (3, 4, 2)
