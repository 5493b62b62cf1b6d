"""Transformer Engine's megatron parameter names <-> the local spec's, by name alone. The converter's tables speak
local names; a TE model's state passes `from_te_names` on its way to HF, and a converted state `to_te_names` on its
way into a TE model (`in_names_of` picks the set from the model's own parameter names).

TE's layer spec fuses each layer's input norm into `linear_qkv` and a dense MLP's pre-MLP norm into `linear_fc1`
(MoE layers keep a norm module of their own), and adds `_extra_state` entries (FP8 metadata, no weights); the q/k
norms, the final norm and every other tensor are named alike in both (megatron-core 0.16 gpt_layer_specs).
"""
from __future__ import annotations

from typing import Iterable, TypeVar

Value = TypeVar("Value")

# (local spec name, TE spec name), under decoder.layers.{layer}.
INPUT_NORM = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
PRE_MLP_NORM = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
DENSE_FC1 = "mlp.linear_fc1.weight"  # a dense MLP's first linear; routed experts' sit under mlp.experts.
EXTRA_STATE = "_extra_state"


def uses_te_names(names: Iterable[str]) -> bool:
    """True when `names` (a model's parameter names or a state dict's keys) are TE's: a layer's input norm is fused
    (every TE layer has one, dense or MoE)."""
    return any(_prefix(name, INPUT_NORM[1]) is not None for name in names)


def from_te_names(state: dict[str, Value]) -> dict[str, Value]:
    """`state` in local names, `_extra_state` entries dropped; a state already in local names comes back as it is."""
    out: dict[str, Value] = {}
    for name, value in state.items():
        if name.endswith(EXTRA_STATE):
            continue
        for local, te in (INPUT_NORM, PRE_MLP_NORM):
            prefix = _prefix(name, te)
            name = name if prefix is None else prefix + local
        if name in out:
            raise ValueError(f"{name!r} is in the state twice, under its local and its Transformer Engine name; a "
                             "state dict holds one layer spec's names")
        out[name] = value
    return out


def to_te_names(state: dict[str, Value]) -> dict[str, Value]:
    """`state` (local names) in TE's names: input norms fused into linear_qkv, pre-MLP norms into linear_fc1 where
    the layer has a dense MLP (TE's spec fuses nothing into routed experts)."""
    out: dict[str, Value] = {}
    for name, value in state.items():
        prefix = _prefix(name, INPUT_NORM[0])
        if prefix is not None:
            name = prefix + INPUT_NORM[1]
        prefix = _prefix(name, PRE_MLP_NORM[0])
        if prefix is not None and prefix + DENSE_FC1 in state:
            name = prefix + PRE_MLP_NORM[1]
        out[name] = value
    return out


def in_names_of(state: dict[str, Value], model_names: Iterable[str]) -> dict[str, Value]:
    """`state` (local names, as the converter makes it) in the name set of a model whose parameters are
    `model_names`."""
    return to_te_names(state) if uses_te_names(model_names) else state


def _prefix(name: str, suffix: str) -> str | None:
    """What comes before `suffix` in `name` (ending in "."), or None when `name` is not `<prefix>.<suffix>`."""
    return name[: -len(suffix)] if name.endswith("." + suffix) else None
