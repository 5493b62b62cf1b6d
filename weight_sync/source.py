"""The source half of the bridge: runs where the full HF-named tensors are (trainer rank 0, or any process holding a
state dict) and sends them bucket by bucket into a channel — a weight group, a shared-memory segment or a checkpoint
directory. The driver-side transports (`weight_sync.transports`) tell it what to send and when.
"""
from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Mapping

import torch

from weight_sync.buckets import (BucketLayout, check_bucket_tensors, checksum, dtype_to_str, pack_bucket,
                                str_to_dtype)


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor weights-checker hash on CPU: the first 8 bytes of SHA-256 of the bytes, as 16 hex digits."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()[:16]


class _Channel:
    """One open channel. `pipeline` (the default) gives it two reusable buffers (shared segments for ipc), so one
    bucket is packed while the other travels. Broadcast: a packing thread works ahead, packing and checksumming
    bucket k+1 while bucket k is on the wire and while the engines check it. Ipc: the driver asks for bucket k+1
    while the engines copy bucket k out of the other segment. Off: one buffer, packing and sending one after the
    other (the reference the pipelined path is tested against). `streamed`: every bucket's tensors come with its
    send (a streaming source, such as the trainer's) and nothing can be packed ahead, so a broadcast channel keeps
    one buffer whatever `pipeline` says."""

    def __init__(self, spec: Mapping[str, Any], streamed: bool = False):
        self.kind = spec["kind"]
        self.layouts = [BucketLayout.from_json(i, m) for i, m in enumerate(spec["layouts"])]
        self.with_checksum = bool(spec.get("with_checksum", True))
        biggest = max((b.nbytes for b in self.layouts), default=0)
        depth = 2 if spec.get("pipeline", True) and len(self.layouts) > 1 else 1
        if streamed and self.kind == "broadcast":  # the broadcast ends before its send returns: one buffer is free
            depth = 1
        self.group = self.writer = None
        self.segments: list[Any] = []
        self.buffers: list[torch.Tensor] = []
        self.ahead: dict[int, Future] = {}  # bucket index -> its packing (and checksum) on the packing thread
        self.baseline: dict[int, torch.Tensor] = {}  # delta sync: bucket index -> a CPU copy of what was last sent
        self.prepared: dict[int, dict[str, Any]] = {}  # bucket index -> what `prepare` chose to send
        self._delta_buffer = torch.empty(0, dtype=torch.uint8)
        self._packer: ThreadPoolExecutor | None = None
        if self.kind == "broadcast":
            from weight_sync.process_group import create_process_group

            self.group = create_process_group(master_address=spec["master_address"], master_port=spec["master_port"],
                                              rank=0, world_size=spec["world_size"], group_name=spec["group_name"],
                                              backend=spec["backend"], timeout_s=spec.get("timeout_s", 300.0))
            self.buffers = [torch.empty(biggest, dtype=torch.uint8, device=self.group.device) for _ in range(depth)]
            if depth > 1:
                self._packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bucket-packer")
        elif self.kind == "ipc":
            if spec.get("device", "cpu") == "cuda":
                self.buffers = [torch.empty(biggest, dtype=torch.uint8, device="cuda") for _ in range(depth)]
            else:
                from weight_sync.ipc import SharedSegment

                self.segments = [SharedSegment(f"sluice-{os.getpid()}-{spec['name']}-{i}", biggest)
                                 for i in range(depth)]
                self.buffers = [s.buffer for s in self.segments]
        elif self.kind == "disk":
            from weight_sync.disk import CheckpointWriter

            self.writer = CheckpointWriter(spec["dir"], self.layouts)
        else:
            raise ValueError(f"unknown channel kind {self.kind!r}: use 'broadcast', 'ipc' or 'disk'")

    def check_staged(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every planned tensor is staged with its planned dtype and shape (checked when staging, so no bucket
        fails to pack half-way through a transfer), and nothing packed ahead from an earlier staging is kept."""
        for layout in self.layouts:
            check_bucket_tensors(layout, tensors)
        self.drop_ahead()
        self.prepared.clear()

    def drop_ahead(self) -> None:
        wait(list(self.ahead.values()))
        self.ahead.clear()

    def send(self, index: int, tensors: Mapping[str, torch.Tensor], ahead: bool = True) -> dict[str, Any]:
        if self.kind == "disk":
            t0 = time.perf_counter()
            out: dict[str, Any] = {"checksum": self.writer.write_bucket(index, tensors)}
            if index == len(self.layouts) - 1:
                out["path"] = self.writer.commit()
            return {**out, "pack_s": time.perf_counter() - t0}
        if self.kind == "broadcast":
            return self._broadcast(index, tensors, ahead)
        slot = index % len(self.buffers)
        out = self._pack(index, tensors, checksum_too=True)
        if self.segments:
            from weight_sync.ipc import encode_shm_handle

            out["handle"] = encode_shm_handle(self.segments[slot], self.layouts[index])
        else:
            from weight_sync.ipc import encode_cuda_handle

            torch.cuda.current_stream().synchronize()  # the engine reads the bucket from another process
            out["handle"] = encode_cuda_handle(self.buffers[slot], self.layouts[index])
        return out

    def _broadcast(self, index: int, tensors: Mapping[str, torch.Tensor], ahead: bool = True) -> dict[str, Any]:
        """Send bucket `index` (packed ahead, or now). Pipelined, the packing thread holds the next bucket before
        this one goes on the wire and gets the one after it once this broadcast frees its buffer; this call waits
        for the next bucket's packing before it returns, so a packing error surfaces here, after this bucket has
        landed everywhere, and no engine is left waiting inside a collective for a bucket that never comes."""
        from weight_sync.broadcast import broadcast_bucket, wait_unless_aborted

        prepared = self.prepared.pop(index, None)
        if prepared is not None:
            return self._broadcast_prepared(prepared)
        packing = self.ahead.pop(index, None)
        out = packing.result() if packing is not None else self._pack(index, tensors, checksum_too=False)
        if ahead:
            self._pack_ahead(index + 1, tensors)
        flat = self.buffers[index % len(self.buffers)][: self.layouts[index].nbytes]
        t0 = time.perf_counter()
        work = broadcast_bucket(self.group, flat, src=0, wait=False)
        try:
            if "checksum_s" not in out:  # packed here: checksum it while it is on the wire (both only read it)
                out.update(self._checksum(flat))
        finally:
            wait_unless_aborted(self.group, work)
        out["wire_s"] = time.perf_counter() - t0
        if ahead:
            self._pack_ahead(index + 2, tensors)
        following = self.ahead.get(index + 1)
        if following is not None and following.exception() is not None:  # waits for the packing to end
            del self.ahead[index + 1]
            raise following.exception()
        return {**out, "packed_ahead": packing is not None}

    def prepare(self, index: int, tensors: Mapping[str, torch.Tensor], delta: bool) -> dict[str, Any]:
        """Delta sync, broadcast: pack bucket `index` and choose what goes on the wire, the whole bucket or, with
        `delta` and a baseline of it, only its changed elements (`weight_sync.delta`) when that is smaller. The
        baseline then holds what was chosen (the engines hold it once the sync is confirmed; after a failure the
        bridge asks for the whole bucket). Returns the request fields the engines need (`names`, `dtypes`,
        `shapes`, `load_format`) and the bucket's `elements`, `changed` and `bytes_sent`; `send_bucket` sends it."""
        from weight_sync.delta import (DELTA_LOAD_FORMAT, delta_layout, delta_nbytes, delta_tensors, diff_bucket,
                                       slot_view)

        assert self.kind == "broadcast", "delta sync runs on the broadcast transport"
        layout = self.layouts[index]
        out = self._pack(index, tensors, checksum_too=False)
        flat = self.buffers[index % len(self.buffers)][: layout.nbytes]
        t0 = time.perf_counter()
        current = flat.cpu()
        elements = sum(s.nbytes // str_to_dtype(s.dtype).itemsize for s in layout.slots)
        base = self.baseline.get(index)
        changes = diff_bucket(layout, current, base) if delta and base is not None else None
        if changes is not None and delta_nbytes(layout, changes) < layout.nbytes:
            named = delta_tensors(layout, current, changes)
            wire = delta_layout(index, named)
            if self._delta_buffer.numel() < wire.nbytes:
                self._delta_buffer = torch.empty(wire.nbytes, dtype=torch.uint8, device=flat.device)
            sent = pack_bucket(wire, dict(named), self._delta_buffer) if wire.slots else self._delta_buffer[:0]
            for slot, positions in changes:
                slot_view(base, slot).index_copy_(0, positions, slot_view(current, slot).index_select(0, positions))
            # what the engine checks after scattering: the tensors it wrote, whole
            sums = self._checksum_of([slot_view(current, s) for s, _ in changes])
            fields = {**wire.to_json(), "load_format": DELTA_LOAD_FORMAT}
            changed = sum(p.numel() for _, p in changes)
        else:
            if base is None:
                base = self.baseline[index] = torch.empty(layout.nbytes, dtype=torch.uint8)
            base.copy_(current)
            sent, sums = flat, self._checksum(flat)
            fields = {**layout.to_json(), "load_format": "flattened_bucket"}
            changed = elements if changes is None else sum(p.numel() for _, p in changes)
        del fields["offsets"]
        out.update(sums)
        out["pack_s"] += time.perf_counter() - t0
        self.prepared[index] = {"flat": sent, "out": out}
        return {**fields, "elements": elements, "changed": changed, "bytes_sent": int(sent.numel())}

    def _checksum_of(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        from weight_sync.buckets import checksum_tensors

        t0 = time.perf_counter()
        value = checksum_tensors(tensors) if self.with_checksum else None
        return {"checksum": value, "checksum_s": time.perf_counter() - t0}

    def _broadcast_prepared(self, prepared: dict[str, Any]) -> dict[str, Any]:
        """Send what `prepare` chose (nothing goes on the wire for a delta with no changes: the engines receive
        nothing either)."""
        from weight_sync.broadcast import broadcast_bucket, wait_unless_aborted

        out, flat = prepared["out"], prepared["flat"]
        t0 = time.perf_counter()
        if flat.numel():
            wait_unless_aborted(self.group, broadcast_bucket(self.group, flat, src=0, wait=False))
        return {**out, "wire_s": time.perf_counter() - t0, "packed_ahead": False}

    def _pack_ahead(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Queue bucket `index` on the packing thread; its buffer is free (the broadcast before last, which used
        it, has ended)."""
        if self._packer is not None and index < len(self.layouts) and index not in self.ahead:
            self.ahead[index] = self._packer.submit(self._pack, index, tensors, True)

    def _pack(self, index: int, tensors: Mapping[str, torch.Tensor], checksum_too: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        flat = pack_bucket(self.layouts[index], tensors, self.buffers[index % len(self.buffers)])
        out: dict[str, Any] = {"pack_s": time.perf_counter() - t0}
        if checksum_too:
            out.update(self._checksum(flat))
        return out

    def _checksum(self, flat: torch.Tensor) -> dict[str, Any]:
        t0 = time.perf_counter()
        value = checksum(flat) if self.with_checksum else None
        return {"checksum": value, "checksum_s": time.perf_counter() - t0}

    def close(self) -> None:
        if self._packer is not None:
            self.drop_ahead()
            self._packer.shutdown(wait=True)
        if self.group is not None:
            from weight_sync.process_group import destroy_process_group

            destroy_process_group(self.group)
        for segment in self.segments:
            segment.close()
        if self.writer is not None:
            self.writer.close()
        self.buffers, self.segments = [], []


class BucketSource:
    """Channels by name plus the tensors of the sync in progress. One per source process."""

    def __init__(self) -> None:
        self.channels: dict[str, _Channel] = {}
        self.staged: Mapping[str, torch.Tensor] = {}

    def open_channel(self, name: str, spec: Mapping[str, Any], streamed: bool = False) -> None:
        """Open a channel; for `broadcast` this blocks until every engine has joined the group. `streamed`: every
        `send_bucket` will bring the bucket's tensors (`_Channel`)."""
        if name in self.channels:
            raise RuntimeError(f"weight channel {name!r} is already open; close it first")
        self.channels[name] = _Channel({**spec, "name": name}, streamed)

    def stage(self, tensors: Mapping[str, torch.Tensor], with_tensor_checksums: bool) -> dict[str, str] | None:
        """Hold `tensors` for the coming `send_bucket` calls; per-tensor checksums for a full verification."""
        for channel in self.channels.values():
            channel.check_staged(tensors)
        self.staged = tensors
        return {n: tensor_checksum(t) for n, t in tensors.items()} if with_tensor_checksums else None

    def send_bucket(self, channel: str, index: int, tensors: Mapping[str, torch.Tensor] | None = None
                    ) -> dict[str, Any]:
        """Send bucket `index` of the staged tensors, or of `tensors` (a streaming source's tensors of this bucket
        alone: checked against the bucket's layout, and nothing is packed ahead, since the next bucket's tensors
        do not exist yet)."""
        if channel not in self.channels:
            raise RuntimeError(f"weight channel {channel!r} is not open (open: {sorted(self.channels)})")
        if index in self.channels[channel].prepared:
            return self.channels[channel].send(index, {}, ahead=False)
        if tensors is None:
            return self.channels[channel].send(index, self.staged)
        check_bucket_tensors(self.channels[channel].layouts[index], tensors)
        return self.channels[channel].send(index, tensors, ahead=False)

    def prepare_bucket(self, channel: str, index: int, delta: bool,
                       tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Delta sync: choose what bucket `index` of the staged tensors (or of `tensors`, a streaming source's)
        sends, whole or as a delta (`_Channel.prepare`); the next `send_bucket` of it sends that."""
        if channel not in self.channels:
            raise RuntimeError(f"weight channel {channel!r} is not open (open: {sorted(self.channels)})")
        chosen = self.channels[channel]
        if tensors is not None:
            check_bucket_tensors(chosen.layouts[index], tensors)
        return chosen.prepare(index, self.staged if tensors is None else tensors, delta)

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

    def prepare_weight_bucket(self, channel: str, index: int, delta: bool) -> dict[str, Any]:
        return self._source.prepare_bucket(channel, index, delta)

    def close_weight_channel(self, name: str) -> None:
        self._source.close_channel(name)
