"""The megatron-core trainer: Ray actors (one per rank) on gloo/NCCL, driven by `TrainerGroup` from the driver.

May import: fleet, embedded_engine, metrics, types, plugins; loss and weight_sync. Never loop, rollout or rewards.
Light package import: `TrainerConfig` only; megatron, ray and torch.distributed load in the modules that need them.
"""
from glue.trainer.config import TrainerConfig

__all__ = ["TrainerConfig"]
