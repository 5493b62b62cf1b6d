"""Model families, one module each: everything sluice knows of a family (config.json -> megatron-core fields, the
HF <-> megatron name table with each tensor's layout kind, dense and MoE layers, what the trainer refuses, a tiny
random model) in `weight_sync/families/<family>.py`, behind `base.Family`. The trainer, the converter, the plan,
the memory estimate, launch's shrink and the embedded engine ask `family_of(hf_config)` and never test `model_type`
themselves. Adding a family is one module plus its tests, and a line in FAMILIES below; docs/models.md lists them.

Light: imports no torch and no transformers (launch.config reads the family names)."""
from __future__ import annotations

from typing import Any

from weight_sync.families import deepseek_v3, glm4, glm4_moe, gpt_oss, llama, mixtral, qwen2, qwen3, qwen3_moe
from weight_sync.families.base import Family, MoeFamily, is_tied, rope_parameters, rope_theta
from weight_sync.families.table import Rule, cfg

# sluice's name -> family, in the order a checkpoint's name is matched against their name patterns (the more
# specific first: a qwen3 MoE name also matches qwen3's pattern, and "moonlight_moe" qwen3_moe's "moe")
FAMILIES: dict[str, Family] = {f.name: f for f in (deepseek_v3.FAMILY, glm4_moe.FAMILY, glm4.FAMILY, gpt_oss.FAMILY,
                                                  mixtral.FAMILY, qwen3_moe.FAMILY, qwen3.FAMILY, qwen2.FAMILY,
                                                  llama.FAMILY)}
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}

__all__ = ["BY_MODEL_TYPE", "FAMILIES", "Family", "MoeFamily", "family_of", "is_moe_layer", "is_tied", "kind_by_suffix",
           "num_experts", "rope_parameters", "rope_theta", "rules"]


def family_of(hf_config: Any) -> Family:
    """The family of an HF config object or config.json dict, by its model_type."""
    kind = cfg(hf_config, "model_type", "llama")
    if kind not in BY_MODEL_TYPE:
        raise ValueError(f"model_type {kind!r} is not supported by the megatron trainer yet; supported: "
                         f"{tuple(BY_MODEL_TYPE)} (docs/models.md)")
    return BY_MODEL_TYPE[kind]


def rules(hf_config: Any) -> list[Rule]:
    """Every tensor of the model in HF module order (the family's name table placed in the model)."""
    return family_of(hf_config).rules(hf_config)


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (0 for a dense family)."""
    return family_of(hf_config).num_experts(hf_config)


def is_moe_layer(hf_config: Any, layer: int) -> bool:
    return family_of(hf_config).is_moe_layer(hf_config, layer)


def kind_by_suffix() -> dict[str, str]:
    """megatron name suffix -> layout kind, over every family's table (for callers that only have a name)."""
    table: dict[str, str] = {}
    for family in FAMILIES.values():
        for e in family.entries():
            suffix = ".".join(e.megatron.split(".")[-2:])
            assert table.setdefault(suffix, e.kind) == e.kind, f"suffix {suffix} has two layout kinds"
    return table
