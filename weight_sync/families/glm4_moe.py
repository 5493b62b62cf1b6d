"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (`glm4_moe`): attention with q/k/v biases (`attention_bias`), optional per-head
q/k RMSNorm (`use_qk_norm`) and RoPE over part of each head (`partial_rotary_factor`, 0.5); the first
`first_k_dense_replace` layers dense, the rest MoE with `n_shared_experts` shared experts beside the routed ones and
DeepSeek-V3's router: sigmoid scores, the expert bias `e_score_correction_bias` added only to choose experts,
group-limited top-k (`n_group`, `topk_group`), the chosen scores renormalised and scaled by `routed_scaling_factor`.

The expert bias is frozen in training by default (the trainer sets megatron's bias update rate to 0): an RL run
keeps the engines' routing rule. The multi-token-prediction layers after the decoder's (`num_nextn_predict_layers`,
`model.layers.92` of GLM-4.5) are not in the HF model transformers builds, nor in the trainer's: they are kept frozen
and copied unchanged into every export."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_sync.families.base import MoeFamily
from weight_sync.families.table import ROUTER_BIAS, SHARED_EXPERTS, Entry, Rule, cfg, in_layer


@dataclass(frozen=True)
class Glm4Moe(MoeFamily):
    def check(self, hf_config: Any) -> None:
        super().check(hf_config)
        groups, chosen, top_k = int(cfg(hf_config, "n_group", 1)), int(cfg(hf_config, "topk_group", 1)), \
            int(hf_config.num_experts_per_tok)
        if groups > 1 and top_k != 2 * chosen:  # megatron sums a group's top topk/topk_group scores, HF its top 2
            raise ValueError(f"n_group={groups}, topk_group={chosen}, num_experts_per_tok={top_k}: megatron-core "
                             "scores a group by its top num_experts_per_tok / topk_group experts and HF by its top 2, "
                             "which agree only when num_experts_per_tok = 2 x topk_group")
        if not cfg(hf_config, "norm_topk_prob", True) and top_k > 1:
            raise ValueError("norm_topk_prob=false: megatron-core always renormalises the chosen sigmoid scores; "
                             "the trainer builds norm_topk_prob=true only")

    def num_experts(self, hf_config: Any) -> int:
        return int(cfg(hf_config, "n_routed_experts", 0))

    def frozen_layers(self, hf_config: Any) -> range:
        layers = int(cfg(hf_config, "num_hidden_layers"))
        return range(layers, layers + int(cfg(hf_config, "num_nextn_predict_layers", 0)))

    def is_moe_layer(self, hf_config: Any, layer: int) -> bool:
        return self.num_experts(hf_config) > 0 and layer >= int(cfg(hf_config, "first_k_dense_replace", 0))

    def has_qk_norm(self, hf_config: Any) -> bool:
        return bool(cfg(hf_config, "use_qk_norm", False))

    def mlp_rules(self, hf_config: Any, layer: int) -> list[Rule]:
        rules = super().mlp_rules(hf_config, layer)
        if not self.is_moe_layer(hf_config, layer):
            return rules
        return rules + [in_layer(e, layer) for e in (ROUTER_BIAS, *SHARED_EXPERTS)]

    def entries(self) -> tuple[Entry, ...]:
        return (*super().entries(), ROUTER_BIAS, *SHARED_EXPERTS)

    def megatron_fields(self, hf_config: Any) -> dict[str, Any]:
        fields = super().megatron_fields(hf_config)
        if not self.num_experts(hf_config):
            return fields
        fields.pop("moe_router_pre_softmax")  # megatron reads it for softmax scores only
        fields.update(
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(cfg(hf_config, "routed_scaling_factor", 1.0)),
            moe_shared_expert_intermediate_size=int(hf_config.moe_intermediate_size)
            * int(cfg(hf_config, "n_shared_experts", 0)) or None)
        if int(cfg(hf_config, "n_group", 1)) > 1:
            fields.update(moe_router_num_groups=int(hf_config.n_group), moe_router_group_topk=int(hf_config.topk_group))
        return fields

    def tiny_fields(self, *, hidden_size: int, num_heads: int, intermediate_size: int, num_experts: int,
                    moe_top_k: int) -> dict[str, Any]:
        """GLM-4.5's features on: one shared expert, the first layer dense, half-rotary heads, attention biases,
        scaled sigmoid routing with an expert bias."""
        return {"head_dim": hidden_size // num_heads, "n_routed_experts": num_experts,
                "num_experts_per_tok": moe_top_k, "moe_intermediate_size": intermediate_size // 4,
                "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                "norm_topk_prob": True, "routed_scaling_factor": 2.5, "attention_bias": True,
                "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 0}


FAMILY = Glm4Moe(
    name="glm4_moe", model_types=("glm4_moe",), examples=("zai-org/GLM-4.5", "zai-org/GLM-4.5-Air", "zai-org/GLM-4.6"),
    tiny_classes=("Glm4MoeConfig", "Glm4MoeForCausalLM"), name_pattern=r"glm-?4\.[5-9]|glm4_?moe",
    explicit_head_dim=True,
)
