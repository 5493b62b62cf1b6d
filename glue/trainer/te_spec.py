"""`trainer.layer_spec`: which megatron-core layer spec the trainer builds, and Transformer Engine's when it is the
one (the local spec is glue.trainer.layer_spec); the megatron options that run on TE's kernels. Light module: TE
and megatron import inside the functions only.
"""
from __future__ import annotations

import functools
from typing import Any

TE_NEEDED = "trainer.layer_spec=te needs transformer_engine importable on the trainer nodes; use auto or local"
LAYER_SPECS = ("auto", "local", "te")
# megatron-core fields whose megatron code runs on Transformer Engine: set, each needs TE on every trainer node.
# (--moe-grouped-gemm needs none: TE's grouped experts on the te spec, sluice's on the local one.)
TE_OPTIONS = {
    "use_precision_aware_optimizer": "TE's FusedAdam holds the main weights and Adam moments (megatron's "
                                     "OptimizerConfig imports it)",
    "moe_permute_fusion": "TE's fused token permutation (megatron's fused_permute)",
    "moe_router_fusion": "TE's fused top-k routing (megatron's fused_topk_with_score_function)",
}


@functools.cache
def te_available() -> bool:
    """True when Transformer Engine's PyTorch modules import here: what megatron's TE spec is built from (the
    `transformer_engine` core can import without them). Cached: the import is slow and its answer does not change."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:  # no TE on this machine (CPU-only, no CUDA toolchain): the local spec serves
        return False
    return True


def te_options(megatron: dict[str, Any]) -> list[str]:
    """The flags set in `megatron` (trainer.megatron) that need Transformer Engine, as `--flag-name`s. With
    `--optimizer-cpu-offload` the precision-aware path is megatron's hybrid optimizer, whose Adam is torch's where TE
    does not import, so `--use-precision-aware-optimizer` needs no TE there (slime's scripts pass both)."""
    offload = bool(megatron.get("optimizer_cpu_offload"))
    return ["--" + name.replace("_", "-") for name in TE_OPTIONS
            if megatron.get(name) and not (offload and name == "use_precision_aware_optimizer")]


def check_te_options(megatron: dict[str, Any]) -> None:
    """ValueError (one line naming the flags and the fix) when `megatron` sets TE options and TE does not import
    on this machine."""
    needs = te_options(megatron)
    if needs and not te_available():
        which = "it" if len(needs) == 1 else "them"
        raise ValueError(f"{', '.join(needs)} {'needs' if len(needs) == 1 else 'need'} transformer-engine, which does "
                         f"not import on this machine (the trainer nodes share its venv): install transformer-engine"
                         f"[pytorch] there or drop {which}")


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
    and norms, each input norm fused into linear_qkv and a dense MLP's pre-MLP norm into linear_fc1, routed experts
    as SequentialMLP or, with `moe_grouped_gemm`, TE's grouped experts (the names weight_sync.convert.te_names maps).
    Needs TE, so a GPU machine: not run on CPU."""
    if not te_available():
        raise ValueError(TE_NEEDED)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    # one call for dense and MoE: with no experts every layer gets the dense TE layer spec
    return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
