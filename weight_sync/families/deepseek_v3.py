"""DeepSeek-V3 / V3.1 / R1, Kimi-K2 and Moonlight (`deepseek_v3`): multi-latent attention (MLA: queries whole or
through a low rank `q_lora_rank`, keys and values through `kv_lora_rank` plus one shared RoPE key of
`qk_rope_head_dim`, per-head `qk_nope_head_dim` / `v_head_dim`), RoPE on interleaved pairs, default or YaRN with its
mscale; and the MoE layers of base.SigmoidRouterMoe (first dense layers, shared experts, the sigmoid router with its
expert bias, group-limited top-k, scaled weights), with the MTP layer kept frozen.

The trainer builds MLA as megatron-core's MLASelfAttention (an MLATransformerConfig: the fields below) on the local
layer spec with sluice's core attention, which takes keys of `qk_nope + qk_rope` dims and values of `v_head_dim`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_sync.families.base import SigmoidRouterMoe, rope_parameters, rope_theta
from weight_sync.families.table import MLA_KV, MLA_Q, MLA_Q_LORA, Entry, cfg

# HF's YaRN fields -> megatron-core's MLATransformerConfig fields (DeepSeek-V3's config.json: factor 40, mscale 1,
# mscale_all_dim 1, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1)
YARN_FIELDS = {"factor": ("rotary_scaling_factor", float), "mscale": ("mscale", float),
               "mscale_all_dim": ("mscale_all_dim", float),
               "original_max_position_embeddings": ("original_max_position_embeddings", int),
               "beta_fast": ("beta_fast", float), "beta_slow": ("beta_slow", float)}


@dataclass(frozen=True)
class DeepseekV3(SigmoidRouterMoe):
    def check(self, hf_config: Any) -> None:
        super().check(hf_config)
        if cfg(hf_config, "attention_bias", False):
            raise ValueError("attention_bias=true: megatron-core's multi-latent attention has no projection biases; "
                             "the trainer builds attention_bias=false (every released DeepSeek-V3 / Kimi-K2)")
        if not cfg(hf_config, "rope_interleave", True):
            raise ValueError("rope_interleave=false: megatron-core's multi-latent attention rotates interleaved "
                             "pairs, as every released DeepSeek-V3 checkpoint does; use rope_interleave: true")
        if rope_parameters(hf_config).get("truncate", True) is False:
            raise ValueError("YaRN with truncate=false: megatron-core rounds YaRN's correction range to whole dims; "
                             "drop truncate from rope_scaling")

    def has_qk_norm(self, hf_config: Any) -> bool:
        return True  # megatron's q_layernorm / kv_layernorm are MLA's q_a_layernorm / kv_a_layernorm

    def has_qkv_bias(self, hf_config: Any) -> bool:
        return False

    def attention_entries(self, hf_config: Any) -> list[Entry]:
        query = MLA_Q if cfg(hf_config, "q_lora_rank") is None else MLA_Q_LORA
        return [*query, *MLA_KV]

    def entries(self) -> tuple[Entry, ...]:
        return (*super().entries(), *MLA_Q, *MLA_Q_LORA, *MLA_KV)

    def megatron_fields(self, hf_config: Any) -> dict[str, Any]:
        fields = super().megatron_fields(hf_config)
        rope = rope_parameters(hf_config)
        fields.update(multi_latent_attention=True, q_lora_rank=cfg(hf_config, "q_lora_rank"),
                      kv_lora_rank=int(cfg(hf_config, "kv_lora_rank")),
                      qk_head_dim=int(cfg(hf_config, "qk_nope_head_dim")),
                      qk_pos_emb_head_dim=int(cfg(hf_config, "qk_rope_head_dim")),
                      v_head_dim=int(cfg(hf_config, "v_head_dim")), rotary_base=rope_theta(hf_config),
                      rope_type="yarn" if rope["rope_type"] == "yarn" else "rope")
        if rope["rope_type"] == "yarn":
            fields.update({field: kind(rope[hf]) for hf, (field, kind) in YARN_FIELDS.items() if hf in rope})
        return fields

    def tiny_fields(self, *, hidden_size: int, num_heads: int, intermediate_size: int, num_experts: int,
                    moe_top_k: int) -> dict[str, Any]:
        """DeepSeek-V3's features on: MLA with a query rank, YaRN with mscale (a context of 2048 tokens scaled 4x
        from 512: YaRN blends the frequencies of every position), one shared expert, the first layer dense, scaled
        sigmoid routing with an expert bias in two groups."""
        head = hidden_size // num_heads
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0}
        return {"num_key_value_heads": num_heads, "q_lora_rank": hidden_size // 2, "kv_lora_rank": hidden_size // 4,
                "qk_nope_head_dim": head, "qk_rope_head_dim": head // 2, "v_head_dim": head,
                "n_routed_experts": num_experts, "num_experts_per_tok": moe_top_k,
                "moe_intermediate_size": intermediate_size // 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                "n_group": 2 if moe_top_k == 2 and num_experts % 2 == 0 else 1, "topk_group": 1,
                "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0,
                "max_position_embeddings": 2048, "rope_parameters": yarn}


FAMILY = DeepseekV3(
    name="deepseek_v3", model_types=("deepseek_v3", "kimi_k2"),
    examples=("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1", "moonshotai/Kimi-K2-Instruct",
              "moonshotai/Moonlight-16B-A3B"),
    tiny_classes=("DeepseekV3Config", "DeepseekV3ForCausalLM"), name_pattern=r"deepseek|kimi|moonlight",
    rope_types=("default", "yarn"),
)
