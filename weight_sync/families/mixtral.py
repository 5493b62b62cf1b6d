"""Mixtral (Mixtral-8x7B, Mixtral-8x22B): Llama's attention, routed experts in every layer, no shared expert. The
checkpoint keeps the MoE block as `block_sparse_moe` with each expert's `w1` (gate), `w3` (up) and `w2` (down) and
the router at `gate`; config.json counts experts in `num_local_experts`, each as wide as `intermediate_size`. The
router softmaxes over every expert, keeps the top `num_experts_per_tok` and always renormalises them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_sync.families.base import MoeFamily
from weight_sync.families.table import cfg


@dataclass(frozen=True)
class Mixtral(MoeFamily):
    def check(self, hf_config: Any) -> None:
        super().check(hf_config)
        if cfg(hf_config, "sliding_window") is not None:
            raise ValueError(f"sliding_window={cfg(hf_config, 'sliding_window')}: sliding-window attention is not "
                             "supported by the megatron trainer yet; set sliding_window: null (Mixtral's released "
                             "checkpoints have it null)")

    def tiny_fields(self, *, hidden_size: int, num_heads: int, intermediate_size: int, num_experts: int,
                    moe_top_k: int) -> dict[str, Any]:
        return {"num_local_experts": num_experts, "num_experts_per_tok": moe_top_k, "sliding_window": None}


FAMILY = Mixtral(
    name="mixtral", model_types=("mixtral",),
    examples=("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x22B-v0.1"),
    tiny_classes=("MixtralConfig", "MixtralForCausalLM"), name_pattern=r"mixtral",
    moe_block="block_sparse_moe", expert_names=("w1", "w3", "w2"), expert_width="intermediate_size",
)
