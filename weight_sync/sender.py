"""The sending half of the bridge: runs where the full HF-named tensors are (a trainer's source rank, or any process
holding a state dict) and sends them bucket by bucket into its channels (`weight_sync.channels`). The driver-side
transports (`weight_sync.transports`) tell it what to send and when.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from weight_sync.buckets import BucketLayout, check_bucket_tensors, dtype_to_str, tensor_checksum
from weight_sync.channels import SenderChannel, open_channel


def tensor_sums_of(layout: BucketLayout, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-tensor checksums (`tensor_checksum`) of bucket `layout`'s tensors, for verify: full."""
    return {name: tensor_checksum(tensors[name]) for name in layout.names}


class BucketSender:
    """Channels by name plus the tensors of the sync in progress. One per sending process."""

    def __init__(self) -> None:
        self.channels: dict[str, SenderChannel] = {}
        self.staged: Mapping[str, torch.Tensor] = {}
        self._prepared_sums: dict[tuple[str, int], dict[str, str]] = {}  # delta sync: sums of buckets not yet sent

    def open_channel(self, name: str, spec: Mapping[str, Any], streamed: bool = False) -> None:
        """Open a channel; for `broadcast` this blocks until every engine has joined the group. `streamed`: every
        `send_bucket` will bring the bucket's tensors (`channels.BroadcastChannel`)."""
        if name in self.channels:
            raise RuntimeError(f"weight channel {name!r} is already open; close it first")
        self.channels[name] = open_channel({**spec, "name": name, "streamed": streamed})

    def stage(self, tensors: Mapping[str, torch.Tensor], with_tensor_checksums: bool) -> dict[str, str] | None:
        """Hold `tensors` for the coming `send_bucket` calls; per-tensor checksums for a full verification."""
        for channel in self.channels.values():
            channel.check_staged(tensors)
        self.staged = tensors
        self._prepared_sums.clear()
        return {n: tensor_checksum(t) for n, t in tensors.items()} if with_tensor_checksums else None

    def send_bucket(self, channel: str, index: int, tensors: Mapping[str, torch.Tensor] | None = None,
                    tensor_sums: bool = False) -> dict[str, Any]:
        """Send bucket `index` of the staged tensors, or of `tensors` (a streaming source's tensors of this bucket
        alone: checked against the bucket's layout, and nothing is packed ahead, since the next bucket's tensors
        do not exist yet), or as `prepare_bucket` chose it. Returns what the channel reports (checksum, handle or
        path, timings) and, with `tensor_sums`, the per-tensor checksums of the bucket's tensors (`tensor_sums`)."""
        chosen = self._channel(channel)
        sums = self._prepared_sums.pop((channel, index), None)
        if sums is not None or tensors is None:
            out = chosen.send(index, self.staged)  # a prepared bucket is sent as chosen, whatever the tensors
        else:
            check_bucket_tensors(chosen.layouts[index], tensors)
            out = chosen.send(index, tensors, ahead=False)
        if sums is None and tensor_sums:
            sums = tensor_sums_of(chosen.layouts[index], self.staged if tensors is None else tensors)
        return out if sums is None else {**out, "tensor_sums": sums}

    def prepare_bucket(self, channel: str, index: int, delta: bool, tensors: Mapping[str, torch.Tensor] | None = None,
                       tensor_sums: bool = False) -> dict[str, Any]:
        """Delta sync: choose what bucket `index` of the staged tensors (or of `tensors`, a streaming source's)
        sends, whole or as a delta (`channels.BroadcastChannel.prepare`); the next `send_bucket` of it sends that
        and, with `tensor_sums`, returns the per-tensor checksums taken here."""
        chosen = self._channel(channel)
        if tensors is not None:
            check_bucket_tensors(chosen.layouts[index], tensors)
        source = self.staged if tensors is None else tensors
        answer = chosen.prepare(index, source, delta)
        if tensor_sums:
            self._prepared_sums[channel, index] = tensor_sums_of(chosen.layouts[index], source)
        else:  # none left from a sync that failed between prepare and send
            self._prepared_sums.pop((channel, index), None)
        return answer

    def bucket_buffer(self, channel: str, index: int, device: torch.device) -> torch.Tensor:
        """Where bucket `index` of an ipc channel lies (the source packed it there) or is received into (a rank
        serving a copy on its own GPU)."""
        return self._channel(channel).buffer_for(index, device)

    def share_bucket(self, channel: str, index: int) -> dict[str, Any]:
        """The ipc entries of the bucket now in bucket `index`'s buffer (a rank serving a copy it received)."""
        return self._channel(channel).share(index)

    def _channel(self, name: str) -> SenderChannel:
        if name not in self.channels:
            raise RuntimeError(f"weight channel {name!r} is not open (open: {sorted(self.channels)})")
        return self.channels[name]

    def close_channel(self, name: str) -> None:
        channel = self.channels.pop(name, None)
        if channel is not None:
            channel.close()
        self._prepared_sums = {key: sums for key, sums in self._prepared_sums.items() if key[0] != name}

    def close(self) -> None:
        for name in list(self.channels):
            self.close_channel(name)
        self.staged = {}


class LocalWeightSource:
    """A `WeightSource` over a state dict in this process (tests, benchmarks, a checkpoint server)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)
        self._sender = BucketSender()

    def hf_weight_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, dtype_to_str(t.dtype), tuple(t.shape)) for n, t in self.tensors.items()]

    def open_weight_channel(self, name: str, spec: Mapping[str, Any]) -> None:
        self._sender.open_channel(name, spec)

    def stage_weights(self, with_tensor_checksums: bool = False) -> dict[str, str] | None:
        return self._sender.stage(self.tensors, with_tensor_checksums)

    def send_weight_bucket(self, channel: str, index: int) -> dict[str, Any]:
        return self._sender.send_bucket(channel, index)

    def prepare_weight_bucket(self, channel: str, index: int, delta: bool) -> dict[str, Any]:
        return self._sender.prepare_bucket(channel, index, delta)

    def close_weight_channel(self, name: str) -> None:
        self._sender.close_channel(name)
