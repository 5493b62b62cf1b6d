"""The engine's weights by HF *checkpoint* name, as SGLang's weight routes take them. Most checkpoint names are the
model's own parameter names; transformers 5 stores routed experts fused in 3-D parameters (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]) while checkpoints, the trainer's converter and SGLang name each expert's
`gate_proj` / `up_proj` / `down_proj` separately, so those names map to views into the fused parameters, and the
model's family (weight_sync.families) renames them as its checkpoints do (Mixtral's `block_sparse_moe.experts.{e}.w1`).
gpt-oss's checkpoints hold its experts fused as the model does, under the same names.
"""
from __future__ import annotations

import torch

from weight_sync.families import BY_MODEL_TYPE, Family

_FUSED_EXPERTS = ".experts.gate_up_proj", ".experts.down_proj"


def checkpoint_tensors(model: torch.nn.Module, *, with_tied_copies: bool = True) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor holding those weights in `model` (the parameter itself or a view into a fused
    parameter; writing into it updates the model). Built per call: parameters may have been re-homed since.
    `with_tied_copies` also names a tied parameter under its second name (lm_head.weight of a tied model)."""
    family = family_of_model(model)
    fused = family is not None and family.fused_experts_in_checkpoint  # gpt-oss: checkpoint and model alike
    named = loaded_tensors(model, with_tied_copies=with_tied_copies, split_experts=not fused)
    return {family.checkpoint_name(name): t for name, t in named.items()} if family else named


def family_of_model(model: torch.nn.Module) -> Family | None:
    """The family of a loaded HF model; None for one the trainer does not build (the engine still serves it, under
    the model's own names)."""
    return BY_MODEL_TYPE.get(getattr(getattr(model, "config", None), "model_type", None))


def loaded_tensors(model: torch.nn.Module, *, with_tied_copies: bool = True, split_experts: bool = True
                   ) -> dict[str, torch.Tensor]:
    """As `checkpoint_tensors`, by the loaded model's own names with its fused experts named one by one
    (`mlp.experts.{e}.gate_proj.weight`): the same names in every MoE family whose checkpoints name each expert
    (`split_experts`)."""
    held = model.state_dict(keep_vars=True)  # persistent buffers are checkpoint tensors too (DeepSeek's expert bias)
    out: dict[str, torch.Tensor] = {n: b for n, b in model.named_buffers() if n in held}
    for name, param in model.named_parameters(remove_duplicate=not with_tied_copies):
        if not split_experts:
            out[name] = param
        elif name.endswith(_FUSED_EXPERTS[0]) and param.dim() == 3:
            prefix, half = name[: -len("gate_up_proj")], param.shape[1] // 2
            for e in range(param.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = param.data[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = param.data[e, half:]
        elif name.endswith(_FUSED_EXPERTS[1]) and param.dim() == 3:
            prefix = name[: -len("down_proj")]
            for e in range(param.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = param.data[e]
        else:
            out[name] = param
    return out
