"""HF <-> megatron-core weight conversion for every model family of weight_sync.families (whose modules hold the
name tables): a parallel layout per rank and megatron-core's pipeline split (`layout`), both directions built on them
(`mapping`), and Transformer Engine's names for the same tensors (`te_names`).

The trainer loads checkpoints with `hf_to_megatron_local` (or `hf_to_megatron` + `shard_for_tp`); the weight bridge
turns megatron tensors back into HF checkpoint names with `megatron_to_hf` (+ `gather_from_tp` per tensor), from
either layer spec's names (TE's grouped experts too); `in_names_of` renames a converted state for a TE model.
"""
from weight_sync.convert.layout import ParallelLayout, padded_vocab_size, stage_layer_ranges
from weight_sync.convert.mapping import (attention_shape, fuse_qkv, gather_from_tp, hf_to_megatron,
                                         hf_to_megatron_local, local_name, megatron_to_hf, rule_to_hf, shard_for_tp,
                                         shard_into_hf, shard_rank, split_qkv, tp_split_kind)
from weight_sync.convert.te_names import from_te_names, in_names_of, to_te_names, uses_grouped_experts, uses_te_names
from weight_sync.families import is_moe_layer, is_tied, num_experts, rules

__all__ = [
    "ParallelLayout", "attention_shape", "from_te_names", "fuse_qkv", "gather_from_tp", "hf_to_megatron",
    "hf_to_megatron_local", "in_names_of", "is_moe_layer", "is_tied", "local_name", "megatron_to_hf", "num_experts",
    "padded_vocab_size", "rule_to_hf", "rules", "shard_for_tp", "shard_into_hf", "shard_rank", "split_qkv",
    "stage_layer_ranges", "to_te_names", "tp_split_kind", "uses_grouped_experts", "uses_te_names",
]
