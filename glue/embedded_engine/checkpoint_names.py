"""The engine's weights by HF *checkpoint* name, as SGLang's weight routes take them. Most checkpoint names are the
model's own parameter names; transformers 5 stores routed experts fused in 3-D parameters (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]) while checkpoints, the trainer's converter and SGLang name each expert's
`gate_proj` / `up_proj` / `down_proj` separately, so those names map to views into the fused parameters.
"""
from __future__ import annotations

import torch

_FUSED_EXPERTS = ".experts.gate_up_proj", ".experts.down_proj"


def checkpoint_tensors(model: torch.nn.Module, *, with_tied_copies: bool = True) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor holding those weights in `model` (the parameter itself or a view into a fused
    parameter; writing into it updates the model). Built per call: parameters may have been re-homed since.
    `with_tied_copies` also names a tied parameter under its second name (lm_head.weight of a tied model)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=not with_tied_copies):
        if name.endswith(_FUSED_EXPERTS[0]) and param.dim() == 3:
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
