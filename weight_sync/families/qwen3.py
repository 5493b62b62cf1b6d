"""Qwen3 (dense): per-head RMSNorm of queries and keys before RoPE (megatron's qk_layernorm); the HF config's head_dim
defaults to 128 whatever the width, so a tiny model sets it."""
from weight_sync.families.base import Family

FAMILY = Family(
    name="qwen3", model_types=("qwen3",), examples=("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),
    tiny_classes=("Qwen3Config", "Qwen3ForCausalLM"), name_pattern=r"qwen3", qk_norm=True, explicit_head_dim=True,
)
