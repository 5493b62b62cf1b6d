"""The ipc transport's payload, for colocated engines: each bucket is shared by handle instead of copied through a
socket, as SGLang 0.5.23's `/update_weights_from_tensor` reads it: `serialized_named_tensors` holds one entry per
engine TP rank, each its own base64 ForkingPickler pickle of `{"flattened_tensor": ..., "metadata": [...]}`
(`load_format: "flattened_bucket"`), and each entry is made by the source on that rank's own device. GPU: the
tensor is a CUDA bucket, a CUDA IPC handle naming its device by UUID. CPU: a stand-in naming a POSIX shared-memory
segment the source reuses every sync (`SharedSegment`) and the device its maker stands for, which engines keep mapped
(`MappedSegments`); only sluice's embedded engine reads it.
"""
from __future__ import annotations

import base64
import binascii
import inspect
import io
import os
import pickle
import types
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from weight_sync.buckets import BucketLayout, dtype_to_str

SHM_DIR = "/dev/shm"
ENVELOPE_KEYS = ("flattened_tensor", "metadata")  # what SGLang's weight updater reads of an entry, by key
METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")  # FlattenedTensorMetadata's, by attribute
STAND_IN_FIELDS = ("sluice_shm", "nbytes", "tp_rank", "device")  # the CPU stand-in for the tensor (device: the one
# its maker stands on where devices are modeled, else None: a CUDA handle's device is in the handle itself)
DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device (SGLang's patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX)
REBUILD_CUDA = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
# The globals an entry may name: what sluice's entries use (metadata as SimpleNamespace, torch.Size and dtypes, a
# CUDA tensor's rebuild), every one on SGLang's SafeUnpickler allowlist (utils/common.py ALLOWED_GLOBALS), which
# refuses any other global, sglang's own modules included (tests/test_weight_ipc_payload.py reads the list).
ALLOWED_GLOBALS = frozenset({("types", "SimpleNamespace"), ("torch", "Size"), ("torch", "Tensor"),
                             ("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage"), REBUILD_CUDA,
                             *(("torch", dtype_to_str(d)) for d in _DTYPES)})


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


# ---- the source's side
def metadata_of(layout: BucketLayout) -> list[types.SimpleNamespace]:
    """The bucket's metadata as SGLang reads it: one object per tensor with FlattenedTensorMetadata's fields, read
    by attribute (a dict would fail there). SimpleNamespace, not SGLang's class: sglang need not be importable
    where the source runs, SGLang's unpickler admits it, and its updater copies the fields into its own class."""
    return [types.SimpleNamespace(name=s.name, shape=torch.Size(s.shape), dtype=getattr(torch, s.dtype),
                                  start_idx=s.offset, end_idx=s.offset + s.nbytes, numel=s.nbytes)
            for s in layout.slots]


def encode_cuda_entries(buffer: torch.Tensor, layout: BucketLayout, tp_ranks: Sequence[int]) -> list[str]:
    """One entry per engine TP rank in `tp_ranks` (the ranks on this buffer's GPU) for the bucket packed at the start
    of CUDA `buffer`, each its own serialization (CUDA IPC counts references per serialization: SGLang's ranks each
    deserialize only their own, so an entry made and never read would hold a reference for good). The source must
    keep `buffer` alive and unchanged until every engine has answered."""
    if buffer.device.type != "cuda":
        raise ValueError(f"encode_cuda_entries shares CUDA tensors; this bucket is on {buffer.device}")
    envelope = {"flattened_tensor": buffer[: layout.nbytes], "metadata": metadata_of(layout)}
    return [serialize_entry(envelope) for _ in tp_ranks]


def encode_shm_entries(segment: SharedSegment, layout: BucketLayout, tp_ranks: Sequence[int],
                       device: str | None = None) -> list[str]:
    """The CPU stand-in: SGLang's envelope with, for the tensor, the segment's path, the bucket's size, the TP rank
    the entry is for and the device its maker stands on (`device`, where devices are modeled)."""
    metadata = metadata_of(layout)
    return [serialize_entry({"flattened_tensor": types.SimpleNamespace(
                sluice_shm=segment.path, nbytes=layout.nbytes, tp_rank=rank, device=device), "metadata": metadata})
            for rank in tp_ranks]


def serialize_entry(envelope: dict[str, Any]) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(envelope, output_str=True)`: ForkingPickler (torch's tensor
    reductions: CUDA IPC handles) then base64; a CUDA tensor names its device by UUID, as SGLang's patched
    reduction does, so a receiver whose CUDA_VISIBLE_DEVICES numbers the GPUs differently finds it."""
    from multiprocessing.reduction import ForkingPickler  # torch >= 2.11 no longer re-exports it

    import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_naming_device_uuid
    pickler.dump(envelope)
    return base64.b64encode(buf.getvalue()).decode()


def _reduce_naming_device_uuid(tensor: torch.Tensor) -> tuple[Any, tuple]:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[DEVICE_ARG], int):
        _check_device_arg(reductions.rebuild_cuda_tensor)
        args = (*args[:DEVICE_ARG], device_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1:])
    return rebuild, args


def _check_device_arg(rebuild: Any) -> None:
    names = [p.name for p in inspect.signature(rebuild).parameters.values() if p.kind != p.VAR_POSITIONAL]
    if names and (len(names) <= DEVICE_ARG or names[DEVICE_ARG] != "storage_device"):
        raise RuntimeError(f"torch {torch.__version__}'s rebuild_cuda_tensor no longer takes storage_device as "
                           f"argument {DEVICE_ARG} ({names}); weight_sync.ipc.DEVICE_ARG must follow it")


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


# ---- the engine's side
@dataclass
class Entry:
    """One entry as read: its bucket's layout and `flattened` (a CUDA tensor, or the CPU stand-in's namespace)."""

    layout: BucketLayout
    flattened: Any
    raw: bytes


def read_entries(entries: list[str], tp_size: int, devices: list[str | None] | None = None
                 ) -> tuple[BucketLayout, list[Any]]:
    """Engine side: `serialized_named_tensors` as an engine of `tp_size` ranks reads it, each entry checked as its
    rank would (`read_entry`): exactly one per rank, each its own serialization of the same bucket (a CPU stand-in
    names its rank and, with `devices` (each rank's modeled device), was made on that rank's device, as a CUDA IPC
    handle must be). Returns the layout and every rank's tensor (or stand-in); ValueError names the first fault."""
    if len(entries) != tp_size:
        raise ValueError(f"serialized_named_tensors has {len(entries)} entries; this engine has {tp_size} TP rank(s) "
                         f"and each reads entry [tp_rank]: send exactly {tp_size}")
    read = [read_entry(entry, index) for index, entry in enumerate(entries)]
    for index, entry in enumerate(read):
        if entry.layout.slots != read[0].layout.slots:
            raise ValueError(f"serialized_named_tensors[{index}] describes another bucket than entry [0]")
        if any(entry.raw == other.raw for other in read[:index]):
            raise ValueError(f"serialized_named_tensors[{index}] repeats an earlier entry: every TP rank deserializes "
                             "its own serialization (CUDA IPC counts references per serialization)")
        rank = getattr(entry.flattened, "tp_rank", index)
        if rank != index:
            raise ValueError(f"serialized_named_tensors[{index}] was made for TP rank {rank}")
        _check_device(entry.flattened, (devices or [None] * tp_size)[index], index)
    return read[0].layout, [entry.flattened for entry in read]


def _check_device(flattened: Any, device: str | None, index: int) -> None:
    """Where devices are modeled, an entry opens only on the device it was made on, as a CUDA IPC handle does."""
    made_on = getattr(flattened, "device", None)
    if device is not None and made_on != device:
        raise ValueError(f"serialized_named_tensors[{index}] was made on {made_on or 'an unmodeled device'}, but TP "
                         f"rank {index} stands on {device}: each engine rank must get the bucket copy of the trainer "
                         "rank on its own GPU (sync.transport ipc maps one source per GPU)")


def read_entry(entry: Any, index: int = 0) -> Entry:
    """One entry: base64, then a pickle naming only `ALLOWED_GLOBALS` (CUDA tensors rebuilt on the device their
    UUID names), holding exactly SGLang's envelope with metadata that describes a bucket packed back to back and a
    tensor (or stand-in) that holds it."""
    where = f"serialized_named_tensors[{index}]"
    if not isinstance(entry, str):
        raise ValueError(f"{where} must be a base64 string, got {type(entry).__name__}")
    try:
        raw = base64.b64decode(entry, validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where} is not base64 ({e})") from None
    try:
        envelope = EntryUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError,
            RuntimeError) as e:  # RuntimeError: a CUDA handle that does not open (its source closed it)
        raise ValueError(f"{where} does not unpickle as SGLang's SafeUnpickler would ({e}); SGLang's scheduler would "
                         "raise on it and the server exit") from None
    if not isinstance(envelope, dict) or sorted(envelope) != sorted(ENVELOPE_KEYS):
        keys = sorted(envelope) if isinstance(envelope, dict) else type(envelope).__name__
        raise ValueError(f"{where} must unpickle to a dict of exactly {list(ENVELOPE_KEYS)}, got {keys}")
    layout = _layout_of(envelope["metadata"], where)
    _check_flattened(envelope["flattened_tensor"], layout, where)
    return Entry(layout, envelope["flattened_tensor"], raw)


class EntryUnpickler(pickle.Unpickler):
    """SGLang's SafeUnpickler narrowed to `ALLOWED_GLOBALS`; a CUDA tensor's device UUID is mapped to this process's
    device index, as SGLang's patched rebuild does."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not one sluice sends (SGLang's SafeUnpickler "
                                         "admits only its allowlist)")
        if (module, name) == REBUILD_CUDA:
            return _rebuild_cuda_by_uuid
        return super().find_class(module, name)


def _rebuild_cuda_by_uuid(*args: Any) -> torch.Tensor:
    from torch.multiprocessing import reductions

    device = args[DEVICE_ARG]
    if isinstance(device, str):
        device = local_device_of(device)
    return reductions.rebuild_cuda_tensor(*args[:DEVICE_ARG], device, *args[DEVICE_ARG + 1:])


def local_device_of(uuid: str) -> int:
    """This process's index of the GPU whose UUID is `uuid`."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index in range(count):
        if device_uuid(index) == uuid:
            return index
    raise ValueError(f"the bucket lives on GPU {uuid}, which this process does not see ({count} visible, "
                     f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): a CUDA IPC handle opens "
                     "only on a GPU of the same node that the engine sees")


def _layout_of(metadata: Any, where: str) -> BucketLayout:
    if not isinstance(metadata, list) or not metadata:
        raise ValueError(f"{where}: metadata must be a non-empty list (FlattenedTensorBucket refuses an empty one)")
    for i, meta in enumerate(metadata):
        missing = [f for f in METADATA_FIELDS if not hasattr(meta, f)]
        if missing:
            raise ValueError(f"{where}: metadata[{i}] lacks attribute(s) {missing}; SGLang reads "
                             f"{list(METADATA_FIELDS)} by attribute (dicts fail there)")
        if not isinstance(meta.dtype, torch.dtype) or not isinstance(meta.shape, torch.Size):
            raise ValueError(f"{where}: metadata[{i}] needs a torch.dtype and a torch.Size, got "
                             f"{type(meta.dtype).__name__} and {type(meta.shape).__name__}")
    layout = BucketLayout.from_json(0, {"names": [m.name for m in metadata],
                                        "dtypes": [dtype_to_str(m.dtype) for m in metadata],
                                        "shapes": [list(m.shape) for m in metadata],
                                        "offsets": [m.start_idx for m in metadata]})
    for meta, slot in zip(metadata, layout.slots):
        if meta.end_idx - meta.start_idx != slot.nbytes or meta.numel != slot.nbytes:
            raise ValueError(f"{where}: {slot.name!r} spans bytes {meta.start_idx}-{meta.end_idx} (numel "
                             f"{meta.numel}), but {slot.dtype} {slot.shape} is {slot.nbytes} bytes")
    return layout


def _check_flattened(flattened: Any, layout: BucketLayout, where: str) -> None:
    if isinstance(flattened, torch.Tensor):
        if flattened.dtype != torch.uint8 or flattened.dim() != 1 or flattened.numel() < layout.nbytes:
            raise ValueError(f"{where}: flattened_tensor must be a flat uint8 tensor of >= {layout.nbytes} bytes, got "
                             f"{flattened.dtype} {tuple(flattened.shape)}")
        return
    if not isinstance(flattened, types.SimpleNamespace) or sorted(vars(flattened)) != sorted(STAND_IN_FIELDS):
        raise ValueError(f"{where}: flattened_tensor must be a tensor (a CUDA IPC handle) or sluice's CPU stand-in "
                         f"{list(STAND_IN_FIELDS)}, got {type(flattened).__name__}")
    path = os.path.realpath(str(flattened.sluice_shm))
    if os.path.dirname(path) != SHM_DIR:
        raise ValueError(f"{where}: segment {path!r} is not a file in {SHM_DIR}")
    if flattened.nbytes != layout.nbytes or not os.path.exists(path) or os.path.getsize(path) < layout.nbytes:
        raise ValueError(f"{where}: segment {path} does not hold the {layout.nbytes}-byte bucket")
    flattened.sluice_shm = path  # the checked path, links resolved: what the engine maps


class MappedSegments:
    """Engine side: the source's segments kept mapped across buckets and syncs. A fresh mapping faults every page
    in again on first touch: here, copying 221 MB out of a fresh mapping took 27 ms against 16 ms through a kept
    one. A mapping is dropped once its file is gone or replaced (the source closed or reopened its channel; an
    unlinked file's memory lives as long as someone maps it), when more than `keep` are held, and on `clear()`."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.maps: dict[str, tuple[tuple[int, int, int], torch.Tensor]] = {}  # path -> ((dev, inode, size), mapping)

    def open(self, path: str, nbytes: int) -> torch.Tensor:
        """A view of the segment's first `nbytes` through a kept mapping (mapped now if need be)."""
        self.prune()
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        identity = _identity(path)
        kept = self.maps.pop(path, None)
        if kept is None or kept[0] != identity or kept[1].numel() < nbytes:
            kept = (identity, torch.from_file(path, shared=True, size=identity[2], dtype=torch.uint8))
        self.maps[path] = kept  # newest last
        while len(self.maps) > self.keep:
            del self.maps[next(iter(self.maps))]
        return kept[1][:nbytes]

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
