"""The source half of the bridge: runs where the full HF-named tensors are (trainer rank 0, or any process holding a
state dict) and sends them bucket by bucket into a channel — a weight group, a shared-memory segment or a checkpoint
directory. The driver-side transports (`weight_sync.transports`) tell it what to send and when.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

import torch

from weight_sync.buckets import BucketLayout, checksum, dtype_to_str, pack_bucket


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor weights-checker hash on CPU: the first 8 bytes of SHA-256 of the bytes, as 16 hex digits."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()[:16]


class _Channel:
    def __init__(self, spec: Mapping[str, Any]):
        self.kind = spec["kind"]
        self.layouts = [BucketLayout.from_json(i, m) for i, m in enumerate(spec["layouts"])]
        self.with_checksum = bool(spec.get("with_checksum", True))
        biggest = max((b.nbytes for b in self.layouts), default=0)
        self.group = self.segment = self.writer = None
        if self.kind == "broadcast":
            from weight_sync.process_group import create_process_group

            self.group = create_process_group(master_address=spec["master_address"], master_port=spec["master_port"],
                                              rank=0, world_size=spec["world_size"], group_name=spec["group_name"],
                                              backend=spec["backend"], timeout_s=spec.get("timeout_s", 300.0))
            self.buffer = torch.empty(biggest, dtype=torch.uint8, device=self.group.device)
        elif self.kind == "ipc":
            if spec.get("device", "cpu") == "cuda":
                self.buffer = torch.empty(biggest, dtype=torch.uint8, device="cuda")
            else:
                from weight_sync.ipc import SharedSegment

                self.segment = SharedSegment(f"sluice-{os.getpid()}-{spec['name']}", biggest)
                self.buffer = self.segment.buffer
        elif self.kind == "disk":
            from weight_sync.disk import CheckpointWriter

            self.writer = CheckpointWriter(spec["dir"], self.layouts)
        else:
            raise ValueError(f"unknown channel kind {self.kind!r}: use 'broadcast', 'ipc' or 'disk'")

    def send(self, index: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        layout = self.layouts[index]
        if self.kind == "disk":
            out: dict[str, Any] = {"checksum": self.writer.write_bucket(index, tensors)}
            if index == len(self.layouts) - 1:
                out["path"] = self.writer.commit()
            return out
        flat = pack_bucket(layout, tensors, self.buffer)
        if self.kind == "broadcast":  # checksum while the bucket is on the wire (both only read it)
            from weight_sync.broadcast import broadcast_bucket

            work = broadcast_bucket(self.group, flat, src=0, wait=False)
            out = {"checksum": checksum(flat) if self.with_checksum else None}
            work.wait()
            return out
        out = {"checksum": checksum(flat) if self.with_checksum else None}
        if self.segment is not None:
            from weight_sync.ipc import encode_shm_handle

            out["handle"] = encode_shm_handle(self.segment, layout)
        else:
            from weight_sync.ipc import encode_cuda_handle

            out["handle"] = encode_cuda_handle(self.buffer, layout)
        return out

    def close(self) -> None:
        if self.group is not None:
            from weight_sync.process_group import destroy_process_group

            destroy_process_group(self.group)
        if self.segment is not None:
            self.segment.close()
        if self.writer is not None:
            self.writer.close()
        self.buffer = None


class BucketSource:
    """Channels by name plus the tensors of the sync in progress. One per source process."""

    def __init__(self) -> None:
        self.channels: dict[str, _Channel] = {}
        self.staged: Mapping[str, torch.Tensor] = {}

    def open_channel(self, name: str, spec: Mapping[str, Any]) -> None:
        """Open a channel; for `broadcast` this blocks until every engine has joined the group."""
        if name in self.channels:
            raise RuntimeError(f"weight channel {name!r} is already open; close it first")
        self.channels[name] = _Channel({**spec, "name": name})

    def stage(self, tensors: Mapping[str, torch.Tensor], with_tensor_checksums: bool) -> dict[str, str] | None:
        """Hold `tensors` for the coming `send_bucket` calls; per-tensor checksums for a full verification."""
        self.staged = tensors
        return {n: tensor_checksum(t) for n, t in tensors.items()} if with_tensor_checksums else None

    def send_bucket(self, channel: str, index: int) -> dict[str, Any]:
        if channel not in self.channels:
            raise RuntimeError(f"weight channel {channel!r} is not open (open: {sorted(self.channels)})")
        return self.channels[channel].send(index, self.staged)

    def close_channel(self, name: str) -> None:
        channel = self.channels.pop(name, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for name in list(self.channels):
            self.close_channel(name)
        self.staged = {}


class LocalWeightSource:
    """A `WeightSource` over a state dict in this process (tests, benchmarks, a checkpoint server)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)
        self._source = BucketSource()

    def hf_weight_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, dtype_to_str(t.dtype), tuple(t.shape)) for n, t in self.tensors.items()]

    def open_weight_channel(self, name: str, spec: Mapping[str, Any]) -> None:
        self._source.open_channel(name, spec)

    def stage_weights(self, with_tensor_checksums: bool = False) -> dict[str, str] | None:
        return self._source.stage(self.tensors, with_tensor_checksums)

    def send_weight_bucket(self, channel: str, index: int) -> dict[str, Any]:
        return self._source.send_bucket(channel, index)

    def close_weight_channel(self, name: str) -> None:
        self._source.close_channel(name)
