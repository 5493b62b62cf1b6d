"""Transformer Engine's megatron parameter names <-> the local spec's, by name alone. The converter's tables speak
local names; a TE model's state passes `from_te_names` on its way to HF, and a converted state `to_te_names` on its
way into a TE model (`in_names_of` picks the set from the model's own parameter names).

TE's layer spec fuses each layer's input norm into `linear_qkv` and a dense MLP's pre-MLP norm into `linear_fc1`
(MoE layers keep a norm module of their own), and adds `_extra_state` entries (FP8 metadata, no weights); the q/k
norms, the final norm and every other tensor are named alike in both (megatron-core 0.16 gpt_layer_specs). With
`--moe-grouped-gemm` its routed experts are one TE GroupedLinear per projection (TEGroupedMLP), expert i's weight
named `weight{i}` (EP-local i, the same tensor SequentialMLP names `local_experts.{i}.linear_fc*.weight`).
"""
from __future__ import annotations

import re
from typing import Iterable, TypeVar

Value = TypeVar("Value")

# (local spec name, TE spec name), under decoder.layers.{layer}.
INPUT_NORM = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
PRE_MLP_NORM = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
DENSE_FC1 = "mlp.linear_fc1.weight"  # a dense MLP's first linear; routed experts' sit under mlp.experts.
EXTRA_STATE = "_extra_state"
# routed experts, under decoder.layers.{layer}.mlp.experts.: SequentialMLP's per-expert modules, TEGroupedMLP's
# grouped linears, and megatron's legacy GroupedMLP (every expert fused into weight1 / weight2, transposed)
LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight")
GROUPED_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)")
LEGACY_GROUPED = re.compile(r".*\.mlp\.experts\.weight[12]")
LEGACY_REFUSED = ("is a weight of megatron's legacy GroupedMLP (--moe-use-legacy-grouped-gemm), which holds every "
                  "expert in one transposed tensor; the converter reads SequentialMLP's or TE's grouped experts: "
                  "drop --moe-use-legacy-grouped-gemm")


def uses_te_names(names: Iterable[str]) -> bool:
    """True when `names` (a model's parameter names or a state dict's keys) are TE's: a layer's input norm is fused
    (every TE layer has one, dense or MoE)."""
    return any(_prefix(name, INPUT_NORM[1]) is not None for name in names)


def uses_grouped_experts(names: Iterable[str]) -> bool:
    """True when `names` hold TE's grouped experts (`mlp.experts.linear_fc1.weight0`, ...)."""
    return any(GROUPED_EXPERT.fullmatch(name) for name in names)


def from_te_names(state: dict[str, Value]) -> dict[str, Value]:
    """`state` in local names, `_extra_state` entries dropped, grouped experts as SequentialMLP's; a state already
    in local names comes back as it is. ValueError for the legacy GroupedMLP's fused expert weights."""
    out: dict[str, Value] = {}
    for name, value in state.items():
        if name.endswith(EXTRA_STATE):
            continue
        if LEGACY_GROUPED.fullmatch(name):
            raise ValueError(f"{name!r} {LEGACY_REFUSED}")
        for local, te in (INPUT_NORM, PRE_MLP_NORM):
            prefix = _prefix(name, te)
            name = name if prefix is None else prefix + local
        grouped = GROUPED_EXPERT.fullmatch(name)
        if grouped:
            experts, linear, index = grouped.groups()
            name = f"{experts}local_experts.{index}.{linear}.weight"
        if name in out:
            raise ValueError(f"{name!r} is in the state twice, under its local and its Transformer Engine name; a "
                             "state dict holds one layer spec's names")
        out[name] = value
    return out


def to_te_names(state: dict[str, Value], *, grouped_experts: bool = False) -> dict[str, Value]:
    """`state` (local names) in TE's names: input norms fused into linear_qkv, pre-MLP norms into linear_fc1 where
    the layer has a dense MLP (TE's spec fuses nothing into routed experts); with `grouped_experts`
    (--moe-grouped-gemm) each routed expert's linears as `weight{i}` of the layer's grouped linears."""
    out: dict[str, Value] = {}
    for name, value in state.items():
        prefix = _prefix(name, INPUT_NORM[0])
        if prefix is not None:
            name = prefix + INPUT_NORM[1]
        prefix = _prefix(name, PRE_MLP_NORM[0])
        if prefix is not None and prefix + DENSE_FC1 in state:
            name = prefix + PRE_MLP_NORM[1]
        expert = LOCAL_EXPERT.fullmatch(name) if grouped_experts else None
        if expert:
            experts, index, linear = expert.groups()
            name = f"{experts}{linear}.weight{index}"
        out[name] = value
    return out


def in_names_of(state: dict[str, Value], model_names: Iterable[str]) -> dict[str, Value]:
    """`state` (local names, as the converter makes it) in the name set of a model whose parameters are
    `model_names`: TE's names where the model has them, its routed experts grouped where they are."""
    names = list(model_names)
    if not uses_te_names(names):
        return state
    return to_te_names(state, grouped_experts=uses_grouped_experts(names))


def _prefix(name: str, suffix: str) -> str | None:
    """What comes before `suffix` in `name` (ending in "."), or None when `name` is not `<prefix>.<suffix>`."""
    return name[: -len(suffix)] if name.endswith("." + suffix) else None
