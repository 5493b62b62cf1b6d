"""Typed settings for the parts of the loop glue owns: the rollout fleet and the weight sync.

Light module: imports no backend, so `launch.config` can build and validate a run config anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0  # sampling temperature; the trainer scales logits by the same value
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # top-k sampling, -1 = off
    max_new_tokens: int = 8  # response length limit per generate call
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides the model's eos

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"rollout.sampling.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def to_sglang(self) -> dict[str, Any]:
        """SGLang's `sampling_params` JSON object."""
        params = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "max_new_tokens": self.max_new_tokens}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


@dataclass(kw_only=True)
class RolloutConfig:
    num_engines: int = 2  # inference engines behind the router
    function: str = "rollout_fns.single_turn:generate_group"  # rollout function, `module:attr`
    task: str = "rollout_fns.toy_tasks:EchoTask"  # task object/class with prompts() and reward(), `module:attr`
    task_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the task class
    prompts_per_step: int = 8  # groups per training step
    samples_per_prompt: int = 8  # group size (GRPO's G)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    router_policy: str = "round_robin"  # sgl-router load-balancing policy
    engine_startup_timeout_s: float = 120.0  # an engine not healthy by then fails the run with its log tail

    def __post_init__(self) -> None:
        for name in ("num_engines", "prompts_per_step", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError("rollout.samples_per_prompt must be >= 2: group-relative advantages need at least two samples")
        for name in ("function", "task"):
            path = getattr(self, name)
            if not isinstance(path, str) or not path.replace(":", ".").replace("_", "a").replace(".", "a").isalnum():
                raise ValueError(f"rollout.{name} must be an import path like 'pkg.module:attr', got {path!r}")


@dataclass(kw_only=True)
class SyncConfig:
    transport: Literal["broadcast", "ipc", "disk"] = "broadcast"  # broadcast (weight group), ipc (colocated, shared memory / CUDA IPC), disk (safetensors, the slow reference)
    backend: Literal["gloo", "nccl"] = "gloo"  # collective backend of the weight group (nccl on GPU); nccl also makes ipc share CUDA buffers
    bucket_bytes: int = 512 * 1024**2  # weights travel in flat buckets of at most this many bytes
    verify: Literal["checksum", "full", "off"] = "checksum"  # checksum: per bucket, both sides; full: also every engine tensor vs the trainer's
    master_address: str = "127.0.0.1"  # address the trainer's rank 0 listens on for the weight group
    disk_dir: str | None = None  # where the disk transport writes checkpoints; null: a temporary directory
    timeout_s: float = 300.0  # a sync that takes longer fails the run

    def __post_init__(self) -> None:
        if self.transport not in ("broadcast", "ipc", "disk"):
            raise ValueError(f"sync.transport must be 'broadcast', 'ipc' or 'disk', got {self.transport!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"sync.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.verify not in ("checksum", "full", "off"):
            raise ValueError(f"sync.verify must be 'checksum', 'full' or 'off', got {self.verify!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"sync.bucket_bytes must be >= 1 (default 512 MiB = 536870912), got {self.bucket_bytes}")
