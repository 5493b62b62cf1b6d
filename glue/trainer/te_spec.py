"""`trainer.layer_spec`: which megatron-core layer spec the trainer builds, and Transformer Engine's when it is the
one (the local spec is glue.trainer.layer_spec). Light module: TE and megatron import inside the functions only.
"""
from __future__ import annotations

import functools
from typing import Any

TE_NEEDED = "trainer.layer_spec=te needs transformer_engine importable on the trainer nodes; use auto or local"
LAYER_SPECS = ("auto", "local", "te")


@functools.cache
def te_available() -> bool:
    """True when Transformer Engine's PyTorch modules import here: what megatron's TE spec is built from (the
    `transformer_engine` core can import without them). Cached: the import is slow and its answer does not change."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:  # no TE on this machine (CPU-only, no CUDA toolchain): the local spec serves
        return False
    return True


def resolve_layer_spec(choice: str) -> str:
    """`trainer.layer_spec` as this machine builds it: "te" or "local" (auto: te when Transformer Engine imports).
    ValueError for te without TE."""
    if choice not in LAYER_SPECS:
        raise ValueError(f"trainer.layer_spec must be one of {', '.join(LAYER_SPECS)}, got {choice!r}")
    if choice == "auto":
        return "te" if te_available() else "local"
    if choice == "te" and not te_available():
        raise ValueError(TE_NEEDED)
    return choice


def te_layer_spec(config: Any) -> Any:
    """Block submodules for GPTModel from megatron's TE spec, dense or MoE per layer by `moe_layer_freq`: TE linears
    and norms, each input norm fused into linear_qkv and a dense MLP's pre-MLP norm into linear_fc1 (the names
    weight_sync.convert.te_names maps), SequentialMLP experts. Needs TE, so a GPU machine: not run on CPU."""
    if not te_available():
        raise ValueError(TE_NEEDED)
    if config.moe_grouped_gemm:
        raise ValueError("--moe-grouped-gemm with trainer.layer_spec te builds TE's grouped experts, whose weights "
                         "(linear_fc1.weight0, ...) the HF converter does not name; drop the flag")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    # one call for dense and MoE: with no experts every layer gets the dense TE layer spec
    return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
