"""GLM-4 dense (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): q/k/v biases (`attention_bias`), RoPE on interleaved pairs over
the first half of each head (`partial_rotary_factor` 0.5), the MLP's gate and up fused in the checkpoint
(`mlp.gate_up_proj`), and a norm after the attention and after the MLP, before each residual add
(`post_self_attn_layernorm`, `post_mlp_layernorm`), which the trainer builds as norms carried by the output
projections (glue.trainer.post_norm)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_sync.families.base import Family
from weight_sync.families.table import DENSE_MLP, FUSED_GATE_UP, POST_NORMS, Entry, Rule, in_layer


@dataclass(frozen=True)
class Glm4(Family):
    def megatron_fields(self, hf_config: Any) -> dict[str, Any]:
        return {**super().megatron_fields(hf_config), "rotary_interleaved": True}

    def mlp_rules(self, hf_config: Any, layer: int) -> list[Rule]:
        return [in_layer(FUSED_GATE_UP, layer), in_layer(DENSE_MLP[1], layer)]

    def layer_rules(self, hf_config: Any, layer: int) -> list[Rule]:
        return super().layer_rules(hf_config, layer) + [in_layer(e, layer) for e in POST_NORMS]

    def entries(self) -> tuple[Entry, ...]:
        return (*super().entries(), FUSED_GATE_UP, *POST_NORMS)

    def tiny_fields(self, *, hidden_size: int, num_heads: int, intermediate_size: int, num_experts: int,
                    moe_top_k: int) -> dict[str, Any]:
        """GLM-4's features on: q/k/v biases, half-rotary interleaved heads (and the sandwich norms it always has)."""
        return {"head_dim": hidden_size // num_heads, "attention_bias": True, "partial_rotary_factor": 0.5}


FAMILY = Glm4(
    name="glm4", model_types=("glm4",), examples=("zai-org/GLM-4-9B-0414", "zai-org/GLM-4-32B-0414",
                                                 "zai-org/GLM-Z1-9B-0414"),
    tiny_classes=("Glm4Config", "Glm4ForCausalLM"), name_pattern=r"glm-?4-\d|glm-?z1|glm4(?![.\d]|_?moe)",
    explicit_head_dim=True, post_norms=True,
)
