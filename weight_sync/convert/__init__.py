"""HF <-> megatron-core weight conversion for Llama/Qwen2, Qwen3 and Qwen3-MoE: one name table per family
(`names`), a parallel layout per rank (`layout`), and both directions built on them (`mapping`).

The trainer loads checkpoints with `hf_to_megatron_local` (or `hf_to_megatron` + `shard_for_tp`); the weight bridge
turns megatron tensors back into HF checkpoint names with `megatron_to_hf` (+ `gather_from_tp` per tensor).
"""
from weight_sync.convert.layout import ParallelLayout, padded_vocab_size
from weight_sync.convert.mapping import (attention_shape, fuse_qkv, gather_from_tp, hf_to_megatron,
                                         hf_to_megatron_local, local_name, megatron_to_hf, rule_to_hf, shard_for_tp,
                                         shard_into_hf, shard_rank, split_qkv, tp_split_kind)
from weight_sync.convert.names import FAMILIES, is_moe_layer, is_tied, num_experts, rules

__all__ = [
    "FAMILIES", "ParallelLayout", "attention_shape", "fuse_qkv", "gather_from_tp", "hf_to_megatron",
    "hf_to_megatron_local", "is_moe_layer", "is_tied", "local_name", "megatron_to_hf", "num_experts",
    "padded_vocab_size", "rule_to_hf", "rules", "shard_for_tp", "shard_into_hf", "shard_rank", "split_qkv", "tp_split_kind",
]
