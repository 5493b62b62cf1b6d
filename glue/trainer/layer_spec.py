"""The trainer's megatron-core layer spec: the local (no Transformer Engine) spec, with megatron's apex-less norm
swapped for sluice's RMSNorm (glue.trainer.norm: sequence parallelism, a fused backward), and its unfused
DotProductAttention swapped for sluice's fused core attention unless `--attention-backend local` asks for the
unfused reference (megatron's attention and RoPE, torch's norm).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

from glue.trainer import rope
from glue.trainer.norm import CompiledRMSNorm, ReferenceRMSNorm, RMSNorm
from glue.trainer.te_spec import resolve_layer_spec, te_available, te_layer_spec

# megatron's unfused DotProductAttention sizes keys and values alike; multi-latent attention's differ
MLA_REFERENCE = ("multi-latent attention (deepseek_v3) runs on sluice's core attention, not megatron's unfused "
                 "reference: drop --attention-backend local / unfused")

POST_NORMS_TE = ("GLM-4's post-attention and post-MLP norms are built on the local layer spec only; set "
                 "trainer.layer_spec: local (or auto)")

# megatron's own attention adds sinks and windows on CUDA only, and its fused softmax swaps a packed row's block
# mask for the window mask (samples would see each other)
SINKS_ELSEWHERE = ("attention sinks and sliding windows (gpt_oss) run on sluice's core attention only: drop "
                   "--attention-backend local / unfused and trainer.layer_spec te")


def layer_spec(config: Any, choice: str = "auto", compiled: bool = False, post_norms: bool = False) -> Any:
    """Block submodules for GPTModel. `choice` (trainer.layer_spec) resolving to te: Transformer Engine's spec
    (glue.trainer.te_spec). Else the local one: MoE models get megatron's per-layer block spec (dense or MoE by
    `moe_layer_freq`; SequentialMLP experts, or with `moe_grouped_gemm` sluice's GroupedExperts
    (glue.trainer.grouped_experts), the same parameters run as two grouped products), dense ones the local layer spec on every layer; then every apex-less
    megatron norm is replaced by sluice's `RMSNorm` (torch's function on the reference spec) and the core
    attention is the one `config.attention_backend` names
    (glue.trainer.attention). `compiled` (trainer.compile): the norms and the RoPE rotation of the fast spec run
    under torch.compile. Sinks and sliding
    windows (gpt-oss) take the local spec with sluice's core attention (auto resolves to it)."""
    from glue.trainer.attention import core_attention_class  # lazy: imports megatron-core

    if post_norms and choice == "auto":  # Transformer Engine's fused layers have no slot for them
        choice = "local"
    if post_norms and resolve_layer_spec(choice) == "te":
        raise ValueError(POST_NORMS_TE)
    has_sinks_or_window = (getattr(config, "softmax_type", "vanilla") != "vanilla"
                           or getattr(config, "window_size", None) is not None)
    if resolve_layer_spec(choice) == "te" and has_sinks_or_window and choice == "te":
        raise ValueError(SINKS_ELSEWHERE)
    if resolve_layer_spec(choice) == "te" and not has_sinks_or_window:
        rope.install()
        return te_layer_spec(config)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if config.num_moe_experts:
        # SequentialMLP's spec (megatron's own grouped choice without TE is its legacy GroupedMLP, one transposed
        # tensor for every expert, which the converter does not read); swapped below for grouped experts
        sequential = copy.copy(config)
        sequential.moe_grouped_gemm = False
        spec = get_gpt_decoder_block_spec(sequential, use_transformer_engine=False, normalization="RMSNorm")
    else:
        layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm,
                                         multi_latent_attention=config.multi_latent_attention)
        spec = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    core_attention = core_attention_class(config.attention_backend)
    if has_sinks_or_window and core_attention is DotProductAttention:
        raise ValueError(SINKS_ELSEWHERE)
    if config.multi_latent_attention:
        if core_attention is DotProductAttention:
            raise ValueError(MLA_REFERENCE)
        _without_te_stand_ins()
    norm = CompiledRMSNorm if compiled else RMSNorm
    if core_attention is DotProductAttention:  # the unfused reference keeps megatron's RoPE and torch's norm too
        norm = ReferenceRMSNorm
    else:
        rope.install(compiled)
    swaps = {WrappedTorchNorm: norm, RMSNorm: norm, DotProductAttention: core_attention}
    if config.moe_grouped_gemm:
        from megatron.core.transformer.moe.experts import SequentialMLP

        from glue.trainer.grouped_experts import GroupedExperts  # lazy: imports megatron-core

        swaps[SequentialMLP] = GroupedExperts
    if post_norms:  # the attention's and the MLP's output projections (every RowParallelLinear of a dense layer)
        from megatron.core.tensor_parallel import RowParallelLinear

        from glue.trainer.post_norm import with_post_norm  # lazy: imports megatron-core

        if config.num_moe_experts:
            raise ValueError("post-attention / post-MLP norms are built for dense layers only")
        swaps[RowParallelLinear] = with_post_norm(norm)
    spec = _swap(spec, swaps)
    return _with_owned_expert_outputs(spec) if config.num_moe_experts and config.add_bias_linear else spec


def _with_owned_expert_outputs(node: Any) -> Any:
    """`node` with the routed experts' second linear returning an output of its own. megatron-core 0.16's MLP adds
    an expert's fc2 bias into the fc2 output in place (mlp.py: `output += output_bias * per_token_scale`), which
    autograd forbids where that output is the unchanged input of the TP reduce (expert TP 1, which biased experts
    need): an error in every backward."""
    from megatron.core.tensor_parallel import RowParallelLinear

    if isinstance(node, list):
        return [_with_owned_expert_outputs(item) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        fields = {f.name: getattr(node, f.name) for f in dataclasses.fields(node) if f.init}
        if "experts" in fields:
            return dataclasses.replace(node, experts=_swap(fields["experts"],
                                                           {RowParallelLinear: _owned_output_linear()}))
        return dataclasses.replace(node, **{name: _with_owned_expert_outputs(value) for name, value in fields.items()})
    return node


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


@functools.cache
def _owned_output_linear() -> type:
    """megatron's RowParallelLinear whose output is never a view of its input (one class for every model built)."""
    from megatron.core.tensor_parallel import RowParallelLinear

    class OwnedOutputRowParallelLinear(RowParallelLinear):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            output, bias = super().forward(*args, **kwargs)
            return (output.clone() if output._is_view() else output), bias

    return OwnedOutputRowParallelLinear


def _without_te_stand_ins() -> None:
    """megatron-core 0.16's multi_latent_attention sets HAVE_TE when its TE wrappers' module imports, which it does
    without Transformer Engine (its classes are then mocks), and then calls isinstance(..., a mock). Where TE does not
    import, tell that module so (fixed in megatron-core 0.19)."""
    from megatron.core.transformer import multi_latent_attention

    if not te_available():
        multi_latent_attention.HAVE_TE = False
