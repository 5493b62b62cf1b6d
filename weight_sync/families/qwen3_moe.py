"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with routed experts in every `decoder_sparse_step`-th
layer not listed in `mlp_only_layers`; softmax router, top-k weights renormalised with `norm_topk_prob`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_sync.families.base import MoeFamily
from weight_sync.families.table import cfg


@dataclass(frozen=True)
class Qwen3Moe(MoeFamily):
    def is_moe_layer(self, hf_config: Any, layer: int) -> bool:
        """HF Qwen3-MoE's rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
        if self.num_experts(hf_config) == 0:
            return False
        step = int(cfg(hf_config, "decoder_sparse_step", 1))
        return layer not in (cfg(hf_config, "mlp_only_layers", []) or []) and (layer + 1) % step == 0

    def renormalises_top_k(self, hf_config: Any) -> bool:
        return bool(cfg(hf_config, "norm_topk_prob", False))

    def tiny_fields(self, *, hidden_size: int, num_heads: int, intermediate_size: int, num_experts: int,
                    moe_top_k: int) -> dict[str, Any]:
        """Experts each a quarter of the dense MLP, renormalised top-k weights."""
        return {"head_dim": hidden_size // num_heads, "num_experts": num_experts, "num_experts_per_tok": moe_top_k,
                "moe_intermediate_size": intermediate_size // 4, "norm_topk_prob": True}


FAMILY = Qwen3Moe(
    name="qwen3_moe", model_types=("qwen3_moe",), examples=("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"),
    tiny_classes=("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), name_pattern=r"qwen3.*-a\d+b|qwen3.*moe|moe",
    qk_norm=True, explicit_head_dim=True,
)
