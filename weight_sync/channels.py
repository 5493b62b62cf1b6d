"""The sender's channels, one class per transport: where a bucket goes on the process that holds the tensors — a
weight group's broadcast buffer, a shared segment (or CUDA buffer) an engine maps, a checkpoint shard on disk.
`weight_sync.sender.BucketSender` holds them by name; `open_channel` builds one from the driver's spec.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Mapping, NoReturn, Protocol

import torch

from weight_sync.broadcast import broadcast_bucket, wait_unless_aborted
from weight_sync.buckets import (BucketLayout, check_bucket_tensors, checksum, checksum_tensors, pack_bucket,
                                str_to_dtype)
from weight_sync.delta import DELTA_LOAD_FORMAT, delta_layout, delta_nbytes, delta_tensors, diff_bucket, slot_view
from weight_sync.disk import CheckpointWriter
from weight_sync.ipc import SharedSegment, encode_cuda_entries, encode_shm_entries
from weight_sync.process_group import create_process_group, destroy_process_group, planned_device

Tensors = Mapping[str, torch.Tensor]


class SenderChannel(Protocol):
    """One open channel: `send` moves bucket `index` (from `tensors`) and reports its checksum, timings and, by
    transport, a handle or a path; `prepare` (delta sync, broadcast only) chooses a bucket's form before `send`."""

    layouts: list[BucketLayout]

    def check_staged(self, tensors: Tensors) -> None: ...
    def send(self, index: int, tensors: Tensors, ahead: bool = True) -> dict[str, Any]: ...
    def prepare(self, index: int, tensors: Tensors, delta: bool) -> dict[str, Any]: ...
    def close(self) -> None: ...


# ---- helpers every channel shares
def layouts_of(spec: Mapping[str, Any]) -> list[BucketLayout]:
    return [BucketLayout.from_json(i, meta) for i, meta in enumerate(spec["layouts"])]


def buffer_count(spec: Mapping[str, Any], layouts: list[BucketLayout]) -> int:
    """Two reusable buffers when pipelined (`pipeline`, the default), so one bucket is packed while the other
    travels; one otherwise (the reference the pipelined path is tested against), or with a single bucket."""
    return 2 if spec.get("pipeline", True) and len(layouts) > 1 else 1


def biggest_bucket(layouts: list[BucketLayout]) -> int:
    return max((b.nbytes for b in layouts), default=0)


def check_layouts(layouts: list[BucketLayout], tensors: Tensors) -> None:
    """Every planned tensor is staged with its planned dtype and shape: checked when staging, so no bucket fails to
    pack half-way through a transfer."""
    for layout in layouts:
        check_bucket_tensors(layout, tensors)


def timed_pack(layout: BucketLayout, tensors: Tensors, buffer: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The packed bucket (a view of `buffer`) and `pack_s`."""
    t0 = time.perf_counter()
    flat = pack_bucket(layout, tensors, buffer)
    return flat, {"pack_s": time.perf_counter() - t0}


def timed_checksum(flat: torch.Tensor, with_checksum: bool) -> dict[str, Any]:
    """`checksum` (None when the bridge does not verify) and `checksum_s` of a packed bucket."""
    t0 = time.perf_counter()
    value = checksum(flat) if with_checksum else None
    return {"checksum": value, "checksum_s": time.perf_counter() - t0}


def timed_checksum_of(tensors: list[torch.Tensor], with_checksum: bool) -> dict[str, Any]:
    """`timed_checksum` of the bucket these tensors would make, without packing them."""
    t0 = time.perf_counter()
    value = checksum_tensors(tensors) if with_checksum else None
    return {"checksum": value, "checksum_s": time.perf_counter() - t0}


def refuse_delta(kind: str) -> NoReturn:
    raise ValueError(f"delta sync runs on the broadcast transport; this channel is {kind!r}")


# ---- the three transports
class BroadcastChannel:
    """The source's side of a weight group: one broadcast per bucket. Pipelined, a packing thread works ahead,
    packing and checksumming bucket k+1 while bucket k is on the wire and while the engines check it. `streamed`
    (a streaming source, such as the trainer's: every bucket's tensors come with its send) packs nothing ahead and
    keeps one buffer whatever `pipeline` says: the broadcast ends before its send returns, so one buffer is free."""

    def __init__(self, spec: Mapping[str, Any]):
        self.layouts = layouts_of(spec)
        self.with_checksum = bool(spec.get("with_checksum", True))
        depth = 1 if spec.get("streamed", False) else buffer_count(spec, self.layouts)
        self.group = create_process_group(master_address=spec["master_address"], master_port=spec["master_port"],
                                          rank=0, world_size=spec["world_size"], group_name=spec["group_name"],
                                          backend=spec["backend"], timeout_s=spec.get("timeout_s", 300.0),
                                          device=planned_device())
        size = biggest_bucket(self.layouts)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.group.device) for _ in range(depth)]
        self.ahead: dict[int, Future] = {}  # bucket index -> its packing (and checksum) on the packing thread
        self.baseline: dict[int, torch.Tensor] = {}  # delta sync: bucket index -> a CPU copy of what was last sent
        self.prepared: dict[int, dict[str, Any]] = {}  # bucket index -> what `prepare` chose to send
        self._delta_buffer = torch.empty(0, dtype=torch.uint8)
        self._packer = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="bucket-packer") if depth > 1 else None)

    def check_staged(self, tensors: Tensors) -> None:
        """`check_layouts`, and nothing packed ahead from an earlier staging is kept."""
        check_layouts(self.layouts, tensors)
        self._drop_ahead()
        self.prepared.clear()

    def _drop_ahead(self) -> None:
        wait(list(self.ahead.values()))
        self.ahead.clear()

    def send(self, index: int, tensors: Tensors, ahead: bool = True) -> dict[str, Any]:
        """Send bucket `index` (as `prepare` chose it, packed ahead, or packed now). Pipelined, the packing thread
        holds the next bucket before this one goes on the wire and gets the one after it once this broadcast frees
        its buffer; this call waits for the next bucket's packing before it returns, so a packing error surfaces
        here, after this bucket has landed everywhere, and no engine is left waiting inside a collective for a
        bucket that never comes."""
        prepared = self.prepared.pop(index, None)
        if prepared is not None:
            return self._send_prepared(prepared)
        packing = self.ahead.pop(index, None)
        out = packing.result() if packing is not None else self._pack(index, tensors, checksum_too=False)
        if ahead:
            self._pack_ahead(index + 1, tensors)
        flat = self.buffers[index % len(self.buffers)][: self.layouts[index].nbytes]
        t0 = time.perf_counter()
        work = broadcast_bucket(self.group, flat, src=0, wait=False)
        try:
            if "checksum_s" not in out:  # packed here: checksum it while it is on the wire (both only read it)
                out.update(timed_checksum(flat, self.with_checksum))
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

    def prepare(self, index: int, tensors: Tensors, delta: bool) -> dict[str, Any]:
        """Delta sync: pack bucket `index` and choose what goes on the wire, the whole bucket or, with `delta` and a
        baseline of it, only its changed elements (`weight_sync.delta`) when that is smaller. The baseline then
        holds what was chosen (the engines hold it once the sync is confirmed; after a failure the bridge asks for
        the whole bucket). Returns the request fields the engines need (`names`, `dtypes`, `shapes`,
        `load_format`) and the bucket's `elements`, `changed` and `bytes_sent`; the next `send` of it sends it."""
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
            sums = timed_checksum_of([slot_view(current, s) for s, _ in changes], self.with_checksum)
            fields = {**wire.to_json(), "load_format": DELTA_LOAD_FORMAT}
            changed = sum(p.numel() for _, p in changes)
        else:
            if base is None:
                base = self.baseline[index] = torch.empty(layout.nbytes, dtype=torch.uint8)
            base.copy_(current)
            sent, sums = flat, timed_checksum(flat, self.with_checksum)
            fields = {**layout.to_json(), "load_format": "flattened_bucket"}
            changed = elements if changes is None else sum(p.numel() for _, p in changes)
        del fields["offsets"]
        out.update(sums)
        out["pack_s"] += time.perf_counter() - t0
        self.prepared[index] = {"flat": sent, "out": out}
        return {**fields, "elements": elements, "changed": changed, "bytes_sent": int(sent.numel())}

    def _send_prepared(self, prepared: dict[str, Any]) -> dict[str, Any]:
        """Send what `prepare` chose (nothing goes on the wire for a delta with no changes: the engines receive
        nothing either)."""
        out, flat = prepared["out"], prepared["flat"]
        t0 = time.perf_counter()
        if flat.numel():
            wait_unless_aborted(self.group, broadcast_bucket(self.group, flat, src=0, wait=False))
        return {**out, "wire_s": time.perf_counter() - t0, "packed_ahead": False}

    def _pack_ahead(self, index: int, tensors: Tensors) -> None:
        """Queue bucket `index` on the packing thread; its buffer is free (the broadcast before last, which used
        it, has ended)."""
        if self._packer is not None and index < len(self.layouts) and index not in self.ahead:
            self.ahead[index] = self._packer.submit(self._pack, index, tensors, True)

    def _pack(self, index: int, tensors: Tensors, checksum_too: bool) -> dict[str, Any]:
        flat, out = timed_pack(self.layouts[index], tensors, self.buffers[index % len(self.buffers)])
        if checksum_too:
            out.update(timed_checksum(flat, self.with_checksum))
        return out

    def close(self) -> None:
        if self._packer is not None:
            self._drop_ahead()
            self._packer.shutdown(wait=True)
        destroy_process_group(self.group)
        self.buffers = []


class IpcChannel:
    """Buffers engines map instead of receiving a copy, reused every sync, on this process's device (allocated with
    the first bucket): CUDA buffers shared by CUDA IPC handle, or POSIX shared segments on CPU. Pipelined there are
    two: the driver asks for bucket k+1 while the engines copy bucket k out of the other one. Each bucket answers
    `handles`: one SGLang `serialized_named_tensors` entry for each engine TP rank in `tp_ranks` (the engine ranks
    on this process's GPU that it serves, weight_sync.ipc). The source packs a bucket (`send`); a process that serves
    a copy of it on another GPU receives it into `buffer_for` and shares it with `share`."""

    def __init__(self, spec: Mapping[str, Any]):
        self.layouts = layouts_of(spec)
        self.with_checksum = bool(spec.get("with_checksum", True))
        self.tp_ranks = [int(r) for r in spec["tp_ranks"]] if "tp_ranks" in spec else list(
            range(int(spec.get("tp_size", 1))))
        self.name = spec["name"]
        self.count, self.size = buffer_count(spec, self.layouts), biggest_bucket(self.layouts)
        self.buffers: list[torch.Tensor] = []
        self.segments: list[SharedSegment] = []  # CPU only: the files the stand-ins name
        self.handles_made = 0  # entries serialized over the channel's life (a CUDA entry holds one IPC reference)

    def check_staged(self, tensors: Tensors) -> None:
        check_layouts(self.layouts, tensors)

    def send(self, index: int, tensors: Tensors, ahead: bool = True) -> dict[str, Any]:
        """Pack and checksum bucket `index` into its buffer; the `handles` engines read it through and the
        `device` type it is shared from."""
        layout = self.layouts[index]
        device = tensors[layout.names[0]].device if layout.slots else torch.device("cpu")
        flat, out = timed_pack(layout, tensors, self.buffer_for(index, device))
        out.update(timed_checksum(flat, self.with_checksum))
        return {**out, **self.share(index)}

    def buffer_for(self, index: int, device: torch.device) -> torch.Tensor:
        """The buffer bucket `index` goes into (allocated on `device` with the first bucket), its size exactly."""
        if not self.buffers:
            self._allocate(device)
        return self.buffers[index % len(self.buffers)][: self.layouts[index].nbytes]

    def share(self, index: int) -> dict[str, Any]:
        """The entries of the bucket now in bucket `index`'s buffer, for this channel's engine ranks."""
        layout, slot = self.layouts[index], index % len(self.buffers)
        self.handles_made += len(self.tp_ranks)
        if self.segments:
            entries = encode_shm_entries(self.segments[slot], layout, self.tp_ranks, planned_device())
            return {"device": "cpu", "handles": entries}
        torch.cuda.current_stream(self.buffers[slot].device).synchronize()  # the engine reads from another process
        return {"device": "cuda", "handles": encode_cuda_entries(self.buffers[slot], layout, self.tp_ranks)}

    def _allocate(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.buffers = [torch.empty(self.size, dtype=torch.uint8, device=device) for _ in range(self.count)]
        elif device.type == "cpu":
            self.segments = [SharedSegment(f"sluice-{os.getpid()}-{self.name}-{i}", self.size)
                             for i in range(self.count)]
            self.buffers = [s.buffer for s in self.segments]
        else:
            raise ValueError(f"the ipc transport shares CUDA or CPU buffers; the source's weights are on {device}")

    def prepare(self, index: int, tensors: Tensors, delta: bool) -> dict[str, Any]:
        refuse_delta("ipc")

    def close(self) -> None:
        for segment in self.segments:
            segment.close()
        self.buffers, self.segments = [], []


class DiskChannel:
    """A safetensors checkpoint, one shard per bucket (`weight_sync.disk.CheckpointWriter`); the last bucket's send
    renames it into place and reports its `path`."""

    def __init__(self, spec: Mapping[str, Any]):
        self.layouts = layouts_of(spec)
        self.writer = CheckpointWriter(spec["dir"], self.layouts)

    def check_staged(self, tensors: Tensors) -> None:
        check_layouts(self.layouts, tensors)

    def send(self, index: int, tensors: Tensors, ahead: bool = True) -> dict[str, Any]:
        t0 = time.perf_counter()
        out: dict[str, Any] = {"checksum": self.writer.write_bucket(index, tensors)}
        if index == len(self.layouts) - 1:
            out["path"] = self.writer.commit()
        return {**out, "pack_s": time.perf_counter() - t0}

    def prepare(self, index: int, tensors: Tensors, delta: bool) -> dict[str, Any]:
        refuse_delta("disk")

    def close(self) -> None:
        self.writer.close()


CHANNELS: dict[str, Callable[[Mapping[str, Any]], SenderChannel]] = {
    "broadcast": BroadcastChannel, "ipc": IpcChannel, "disk": DiskChannel}


def open_channel(spec: Mapping[str, Any]) -> SenderChannel:
    """The channel of `spec["kind"]` (`CHANNELS`), open (broadcast: blocks until every engine has joined)."""
    make = CHANNELS.get(spec["kind"])
    if make is None:
        raise ValueError(f"unknown channel kind {spec['kind']!r}: use 'broadcast', 'ipc' or 'disk'")
    return make(spec)
