"""The megatron-core trainer: Ray actors (one per rank) on gloo/NCCL, driven by `TrainerGroup` from the driver.

Light package import: `TrainerConfig` only; megatron, ray and torch.distributed load in the modules that need them.
"""
from glue.trainer.config import TrainerConfig

__all__ = ["TrainerConfig"]
