"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (`glm4_moe`): attention with q/k/v biases (`attention_bias`), optional per-head
q/k RMSNorm (`use_qk_norm`) and RoPE over part of each head (`partial_rotary_factor`, 0.5); DeepSeek-V3's MoE layers
(base.SigmoidRouterMoe: first dense layers, shared experts, the sigmoid router with its expert bias, group-limited
top-k, scaled weights) and its multi-token-prediction layer (`model.layers.92` of GLM-4.5), kept frozen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_sync.families.base import SigmoidRouterMoe
from weight_sync.families.table import cfg


@dataclass(frozen=True)
class Glm4Moe(SigmoidRouterMoe):
    def has_qk_norm(self, hf_config: Any) -> bool:
        return bool(cfg(hf_config, "use_qk_norm", False))

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
