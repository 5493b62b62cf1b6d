"""The transport half of the `sync:` section: how weights travel from the trainer to the engines (the loop's
half, when they travel, is glue.loop.config.SyncConfig, which extends this class).

Light module: imports no backend, so a run config builds and validates anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class BridgeConfig:
    """What `weight_sync.make_bridge` builds: transport, collective backend, buckets, sources and checks."""

    transport: Literal["broadcast", "ipc", "disk"] | None = None  # broadcast (weight group), ipc (colocated: SGLang's /update_weights_from_tensor, CUDA IPC handles on GPU, shared memory on CPU), disk (safetensors, the slow reference); null: ipc for colocated SGLang engines, else broadcast
    backend: Literal["gloo", "nccl"] = "gloo"  # collective backend of the broadcast transport's weight group (nccl on GPU)
    bucket_bytes: int = 512 * 1024**2  # weights travel in flat buckets of at most this many bytes
    pipeline: bool | None = None  # pack bucket k+1 while bucket k is on the wire (two reused buffers, smaller buckets); null: on with nccl, off with gloo (on 2 shared CPU cores the packing thread competes with gloo; bench medians were 0.41-0.67 of a raw gloo broadcast either way, within the noise, and ipc was slower pipelined)
    sources: Literal["one", "parallel"] | None = None  # broadcast: one (trainer rank 0 sends every bucket) or parallel (each pipeline stage and expert group sends its own through its own weight group); null: parallel when the trainer has several stages / expert groups
    delta: bool = False  # broadcast, embedded engines: after a sync every engine confirmed, send each bucket as its changed elements (positions + values) where that is smaller; any failure or fleet change makes the next sync whole. Costs each source rank a CPU copy of the weights it sends (2 bytes/param in bf16)
    verify: Literal["auto", "checksum", "full", "off"] = "auto"  # after every sync each engine's version is checked; checksum: also every bucket, both sides (engines that report bucket checksums: sluice's embedded engine); full: also every engine tensor vs the trainer's (embedded engine); auto: checksum where every engine reports bucket checksums, else versions only (SGLang)
    master_address: str | None = None  # address trainer rank 0 hosts the weight group on; null: its node's address as Ray reports it (set it on machines with several networks)
    disk_dir: str | None = None  # where the disk transport writes checkpoints; null: a temporary directory
    timeout_s: float = 300.0  # a sync that takes longer fails the run
    max_retries: int = 2  # a sync that fails while every engine answers is sent again this many times, on weight groups built anew (fault/sync_retries); an engine that answers nothing is replaced instead

    def __post_init__(self) -> None:
        if self.transport not in (None, "broadcast", "ipc", "disk"):
            raise ValueError(f"sync.transport must be 'broadcast', 'ipc' or 'disk' (or null: ipc for colocated SGLang "
                             f"engines, else broadcast), got {self.transport!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"sync.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.sources not in (None, "one", "parallel"):
            raise ValueError(f"sync.sources must be 'one' or 'parallel' (or null: parallel when the trainer has "
                             f"several stages / expert groups), got {self.sources!r}")
        if self.sources == "parallel" and self.transport not in (None, "broadcast"):
            raise ValueError(f"sync.sources: parallel needs sync.transport: broadcast (got {self.transport!r}); "
                             "set sync.sources: one")
        if self.delta and self.transport not in (None, "broadcast"):
            raise ValueError(f"sync.delta: true needs sync.transport: broadcast (got {self.transport!r}): ipc copies "
                             "in memory and disk is the reference path; set sync.delta: false")
        if self.verify not in ("auto", "checksum", "full", "off"):
            raise ValueError(f"sync.verify must be 'auto', 'checksum', 'full' or 'off', got {self.verify!r}")
        if self.max_retries < 0:
            raise ValueError(f"sync.max_retries must be >= 0, got {self.max_retries}")
        if self.bucket_bytes < 1:
            raise ValueError(f"sync.bucket_bytes must be >= 1 (default 512 MiB = 536870912), got {self.bucket_bytes}")

    def chosen_transport(self, colocated_sglang: bool) -> str:
        """`transport`, or its default: ipc where the engines are SGLang's and share the trainer's GPUs (an NCCL group
        cannot hold two ranks of one GPU, and SGLang colocates through /update_weights_from_tensor), else
        broadcast."""
        if self.transport is not None:
            return self.transport
        return "ipc" if colocated_sglang else "broadcast"
