"""Typed settings of the megatron-core trainer (the `trainer:` section of a run config).

Light module: imports no backend, so a run config can be built and validated anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TrainerConfig:
    tensor_model_parallel_size: int = 1  # Megatron TP degree; the trainer starts TP x PP Ray actors
    pipeline_model_parallel_size: int = 1  # Megatron PP degree (only 1 in this first form)
    lr: float = 1e-3  # AdamW learning rate (tiny random models need a high one)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # max global gradient norm (0 turns clipping off)
    micro_batch_size: int = 8  # rows per forward/backward; gradients accumulate over the batch
    num_mini_batches: int = 1  # optimizer steps (PPO mini-batches) per train_step, each bumps the version
    num_epochs: int = 1  # passes over the batch per train_step
    seed: int = 0  # parameter-init / dropout RNG seed (weights come from the HF checkpoint)
    temperature: float = 1.0  # logits are divided by this before log-softmax, to match the engines' sampling
    num_cpus_per_worker: float = 0.5  # Ray CPUs reserved per trainer actor (fractional so actors never starve)
    master_port: int = 0  # rendezvous port of the trainer's torch.distributed group (0 = pick a free one)

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "micro_batch_size", "num_mini_batches", "num_epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"trainer.{name} must be an integer >= 1, got {value!r}")
        if self.pipeline_model_parallel_size != 1:
            raise ValueError(f"trainer.pipeline_model_parallel_size={self.pipeline_model_parallel_size} is not supported "
                             "by this first-form trainer; set it to 1 (use tensor_model_parallel_size to shard)")
        if not self.lr > 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"trainer.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"trainer.adam_eps must be > 0, got {self.adam_eps}")
        if self.grad_clip < 0:
            raise ValueError(f"trainer.grad_clip must be >= 0 (0 = no clipping), got {self.grad_clip}")
        if not self.temperature > 0:
            raise ValueError(f"trainer.temperature must be > 0 (it must equal the sampling temperature), got {self.temperature}")
        if not self.num_cpus_per_worker > 0:
            raise ValueError(f"trainer.num_cpus_per_worker must be > 0, got {self.num_cpus_per_worker}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"trainer.master_port must be a TCP port or 0, got {self.master_port}")

    @property
    def world_size(self) -> int:
        """Number of trainer ranks (TP x PP; data parallelism comes later)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size
