"""The ipc transport's handles: a bucket shared by name instead of copied through a socket, for colocated engines.
CPU: a POSIX shared-memory file (/dev/shm) the source creates once and reuses every sync; the engine keeps it mapped
(`MappedSegments`) and copies the weights out before it answers. GPU: a CUDA IPC handle in SGLang's `flattened_bucket` payload.
Handles travel as base64 strings in `UpdateWeightsFromTensorReqInput.serialized_named_tensors`.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
from typing import Any

import torch

from weight_sync.buckets import BucketLayout

SHM_DIR = "/dev/shm"
HANDLE_KIND = "sluice_shm"  # the embedded engine's CPU handle; SGLang's CUDA payloads are pickles instead


class SharedSegment:
    """A shared-memory file of a fixed size, mapped as a flat uint8 tensor; `close()` unmaps and unlinks it."""

    def __init__(self, name: str, nbytes: int):
        if "/" in name or not name:
            raise ValueError(f"shared-memory segment names are plain file names, got {name!r}")
        self.path = os.path.join(SHM_DIR, name)
        self.nbytes = max(int(nbytes), 1)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
        finally:
            os.close(fd)
        self.buffer: torch.Tensor | None = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)

    def close(self) -> None:
        self.buffer = None  # drops the mapping
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def encode_shm_handle(segment: SharedSegment, layout: BucketLayout) -> str:
    """The handle an engine needs to read `layout`'s bucket from `segment`: path, size and the metadata list."""
    payload = {"kind": HANDLE_KIND, "path": segment.path, "nbytes": layout.nbytes, "metadata": layout.to_json()}
    return base64.b64encode(json.dumps(payload).encode()).decode()


def decode_shm_handle(handle: str, index: int = 0) -> tuple[BucketLayout, str]:
    """Engine side: the bucket's layout and its segment's path, checked (a path outside /dev/shm, or a segment
    smaller than its bucket, is refused)."""
    try:
        payload = json.loads(base64.b64decode(handle, validate=True))
    except ValueError as e:
        raise ValueError(f"serialized_named_tensors[{index}] is not a base64 JSON shared-memory handle ({e}); the "
                         "embedded engine reads only sluice's CPU handles") from None
    if not isinstance(payload, dict) or payload.get("kind") != HANDLE_KIND:
        raise ValueError(f"serialized_named_tensors[{index}]: expected a handle of kind {HANDLE_KIND!r}")
    path = os.path.realpath(str(payload.get("path", "")))
    if os.path.dirname(path) != SHM_DIR:
        raise ValueError(f"serialized_named_tensors[{index}]: segment {path!r} is not a file in {SHM_DIR}")
    layout = BucketLayout.from_json(index, payload["metadata"])
    if int(payload.get("nbytes", -1)) != layout.nbytes or os.path.getsize(path) < layout.nbytes:
        raise ValueError(f"serialized_named_tensors[{index}]: segment {path} is smaller than its {layout.nbytes}-byte bucket")
    return layout, path


def open_shm_handle(handle: str, index: int = 0) -> tuple[BucketLayout, torch.Tensor]:
    """Engine side: the bucket's layout and a fresh mapping of its bytes. Drop the tensor (and every view of it) to
    unmap; the file itself belongs to the source."""
    layout, path = decode_shm_handle(handle, index)
    if layout.nbytes == 0:
        return layout, torch.empty(0, dtype=torch.uint8)
    return layout, torch.from_file(path, shared=True, size=layout.nbytes, dtype=torch.uint8)


class MappedSegments:
    """Engine side: the source's segments kept mapped across buckets and syncs. A fresh mapping faults every page
    in again on first touch: here, copying 221 MB out of a fresh mapping took 27 ms against 16 ms through a kept
    one. A mapping is dropped once its file is gone or replaced (the source closed or reopened its channel; an
    unlinked file's memory lives as long as someone maps it), when more than `keep` are held, and on `clear()`."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.maps: dict[str, tuple[tuple[int, int, int], torch.Tensor]] = {}  # path -> ((dev, inode, size), mapping)

    def open(self, handle: str, index: int = 0) -> tuple[BucketLayout, torch.Tensor]:
        """The bucket's layout and a view of its bytes through a kept mapping (mapped now if need be)."""
        layout, path = decode_shm_handle(handle, index)
        self.prune()
        if layout.nbytes == 0:
            return layout, torch.empty(0, dtype=torch.uint8)
        identity = _identity(path)
        kept = self.maps.pop(path, None)
        if kept is None or kept[0] != identity or kept[1].numel() < layout.nbytes:
            kept = (identity, torch.from_file(path, shared=True, size=identity[2], dtype=torch.uint8))
        self.maps[path] = kept  # newest last
        while len(self.maps) > self.keep:
            del self.maps[next(iter(self.maps))]
        return layout, kept[1][: layout.nbytes]

    def prune(self) -> None:
        """Unmap every segment whose file is gone or is another file now."""
        for path, (identity, _) in list(self.maps.items()):
            try:
                same = _identity(path) == identity
            except FileNotFoundError:
                same = False
            if not same:
                del self.maps[path]

    def clear(self) -> None:
        self.maps.clear()


def _identity(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size


def encode_cuda_handle(flat: torch.Tensor, layout: BucketLayout) -> str:
    """GPU: SGLang's flattened-bucket payload, `{"flattened_tensor": <CUDA IPC handle>, "metadata": [...]}`,
    pickled by torch's multiprocessing reductions and base64-encoded (what SGLang's MultiprocessingSerializer sends).
    The source must keep `flat` alive and unchanged until every engine has answered."""
    from multiprocessing.reduction import ForkingPickler  # torch >= 2.11 no longer re-exports it

    import torch.multiprocessing  # noqa: F401  registers torch's CUDA tensor reductions with ForkingPickler

    if flat.device.type != "cuda":
        raise ValueError(f"encode_cuda_handle shares CUDA tensors; this bucket is on {flat.device}")
    metadata: list[Any] = []
    try:  # SGLang unpickles its own metadata class; fall back to dicts where sglang is not importable
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as Meta
    except ImportError:
        Meta = None
    for s in layout.slots:
        fields = dict(name=s.name, shape=torch.Size(s.shape), dtype=getattr(torch, s.dtype), start_idx=s.offset,
                      end_idx=s.offset + s.nbytes, numel=s.nbytes)
        metadata.append(Meta(**fields) if Meta is not None else fields)
    data = ForkingPickler.dumps({"flattened_tensor": flat[: layout.nbytes], "metadata": metadata})
    return base64.b64encode(bytes(data)).decode()


def open_cuda_handle(handle: str) -> dict[str, Any]:
    """Inverse of `encode_cuda_handle` in the receiving process (a trusted peer: this unpickles)."""
    return pickle.loads(base64.b64decode(handle))
