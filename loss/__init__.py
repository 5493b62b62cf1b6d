"""Pure tensor math for RL losses (imports only torch): the controller calls `compute_advantages` once per step,
the trainer calls `compute_policy_loss` once per micro-batch and sums gradients. Methods are chosen by name
through the registries below, from `LossConfig` alone (`PRESETS`: whole algorithms by name); docs/algorithms.md lists
every method and its formula.

The names below are loaded on first use, so that `loss.config` (which `launch.config`, hence `sluice --help`,
imports) costs no torch import.
"""
from __future__ import annotations

import importlib
from typing import Any

WHERE = {  # public name -> the module that defines it
    "ADVANTAGE_ESTIMATORS": "loss.advantages", "gae": "loss.advantages", "whiten": "loss.advantages",
    "AGGREGATIONS": "loss.aggregation", "count_tokens_and_seqs": "loss.aggregation",
    "CLIP_REFERENCES": "loss.corrections", "CORRECTIONS": "loss.corrections", "OLD_LOGPROB_SOURCES": "loss.corrections",
    "ewma_proximal_logprobs": "loss.corrections",
    "KL_ESTIMATORS": "loss.kl", "token_entropy": "loss.kl",
    "POLICY_LOSSES": "loss.policy",
    "PRESETS": "loss.presets", "IncoherentLossWarning": "loss.presets",
    "LossConfig": "loss.config",
    "SftLossConfig": "loss.sft", "sft_loss": "loss.sft",
    "compute_advantages": "loss.compute", "compute_loss": "loss.compute", "compute_policy_loss": "loss.compute",
}
__all__ = sorted(WHERE)


def __getattr__(name: str) -> Any:
    if name not in WHERE:
        try:  # a submodule (loss.presets, loss.aggregation, ...)
            return importlib.import_module(f"loss.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'loss' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(WHERE[name]), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(WHERE))
