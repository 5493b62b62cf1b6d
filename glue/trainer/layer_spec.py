"""The trainer's megatron-core layer spec: the local (no Transformer Engine) spec, with megatron's apex-less norm
swapped for an RMSNorm that also runs under sequence parallelism (without apex, megatron's local spec builds
`torch.nn.RMSNorm` and refuses `--sequence-parallel`, which megatron requires for MoE with TP and EP > 1), and its
unfused DotProductAttention swapped for sluice's fused core attention unless `--attention-backend local` asks for it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from glue.trainer import rope
from glue.trainer.te_spec import GROUPED_GEMM_LOCAL, resolve_layer_spec, te_layer_spec


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with a learnt scale named `weight` (the name the converter knows). Under
    sequence parallelism each TP rank normalises its own slice of the sequence, so the scale's gradient is partial:
    the `sequence_parallel` mark makes the trainer sum it over TP, as megatron does for its own norms."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"sluice's local layer spec builds RMSNorm models only, got normalization="
                             f"{config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def layer_spec(config: Any, choice: str = "auto") -> Any:
    """Block submodules for GPTModel. `choice` (trainer.layer_spec) resolving to te: Transformer Engine's spec
    (glue.trainer.te_spec). Else the local one: MoE models get megatron's per-layer block spec (dense or MoE by
    `moe_layer_freq`, SequentialMLP experts), dense ones the local layer spec on every layer; then every apex-less
    megatron norm is replaced by `RMSNorm` and the core attention is the one `config.attention_backend` names
    (glue.trainer.attention). Grouped-GEMM experts (`moe_grouped_gemm`) are built by the TE spec only."""
    from glue.trainer.attention import core_attention_class  # lazy: imports megatron-core

    if resolve_layer_spec(choice) == "te":
        rope.install()
        return te_layer_spec(config)
    if config.moe_grouped_gemm:
        raise ValueError(GROUPED_GEMM_LOCAL)

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if config.num_moe_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
        spec = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    core_attention = core_attention_class(config.attention_backend)
    if core_attention is not DotProductAttention:  # the unfused reference keeps megatron's own RoPE too
        rope.install()
    return _swap(spec, {WrappedTorchNorm: RMSNorm, DotProductAttention: core_attention})


def _swap(node: Any, swaps: dict[type, type]) -> Any:
    """`node` (a spec tree of ModuleSpecs, submodule dataclasses and lists) with each class in `swaps` replaced."""
    if isinstance(node, type) and node in swaps:
        return swaps[node]
    if isinstance(node, list):
        return [_swap(item, swaps) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: _swap(getattr(node, f.name), swaps)
                                            for f in dataclasses.fields(node) if f.init})
    return node
