"""Buckets: the one format every transport moves. HF-named tensors are packed back to back into flat uint8 buffers
of at most `bucket_bytes`, described by a small metadata list (names, dtypes, shapes, byte offsets) — the layout of
SGLang's `load_format="flattened_bucket"` — and carry a CRC-32 checksum that both ends compute.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024**2


def dtype_to_str(dtype: torch.dtype) -> str:
    """The name SGLang's request structs carry: `torch.bfloat16` -> "bfloat16"."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype_to_str expects a torch.dtype, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    """Inverse of `dtype_to_str` (SGLang resolves the string with `getattr(torch, name)`)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives inside its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its tensors in packing order and its total size in bytes."""

    index: int
    slots: tuple[TensorSlot, ...]

    @property
    def nbytes(self) -> int:
        return self.slots[-1].offset + self.slots[-1].nbytes if self.slots else 0

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def to_json(self) -> dict[str, Any]:
        """SGLang's `names` / `dtypes` / `shapes` lists plus the byte `offsets`."""
        return {"names": self.names, "dtypes": [s.dtype for s in self.slots],
                "shapes": [list(s.shape) for s in self.slots], "offsets": [s.offset for s in self.slots]}

    @classmethod
    def from_json(cls, index: int, meta: Mapping[str, Any]) -> "BucketLayout":
        """The layout announced by `meta` (offsets recomputed when absent, as SGLang's receiver does)."""
        names, dtypes, shapes = meta["names"], meta["dtypes"], meta["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"bucket {index}: names, dtypes and shapes must have one entry per tensor, got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")
        offsets = meta.get("offsets")
        slots, offset = [], 0
        for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
            nbytes = math.prod(shape) * str_to_dtype(dtype).itemsize
            at = offset if offsets is None else int(offsets[i])
            if at != offset:
                raise ValueError(f"bucket {index}: {name!r} announced at byte {at}, but packing puts it at {offset}")
            slots.append(TensorSlot(name, dtype, tuple(int(d) for d in shape), at, nbytes))
            offset += nbytes
        return cls(index, tuple(slots))


def plan_buckets(specs: Sequence[tuple[str, str, Sequence[int]]], bucket_bytes: int) -> list[BucketLayout]:
    """Group `(name, dtype, shape)` specs, in order, into buckets of at most `bucket_bytes`.

    A tensor larger than `bucket_bytes` travels alone in a bucket of its own size. A bucket is also closed early
    when the next tensor would start at an offset its dtype cannot be viewed from (SGLang's receiver refuses it).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[BucketLayout] = []
    current: list[TensorSlot] = []
    offset = 0
    for name, dtype, shape in specs:
        itemsize = str_to_dtype(dtype).itemsize
        nbytes = math.prod(shape) * itemsize
        if current and (offset + nbytes > bucket_bytes or offset % itemsize):
            buckets.append(BucketLayout(len(buckets), tuple(current)))
            current, offset = [], 0
        current.append(TensorSlot(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
        offset += nbytes
    if current:
        buckets.append(BucketLayout(len(buckets), tuple(current)))
    return buckets


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (0-dim and empty tensors included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(layout: BucketLayout, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into the preallocated uint8 buffer `out` (reused across syncs: fresh allocation
    is what makes copies slow); returns the `layout.nbytes`-long view that was filled."""
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < layout.nbytes:
        raise ValueError(f"pack_bucket needs a flat uint8 buffer of >= {layout.nbytes} bytes, got "
                         f"{out.dtype} {tuple(out.shape)}")
    for slot in layout.slots:
        tensor = tensors.get(slot.name)
        if tensor is None:
            raise KeyError(f"bucket {layout.index} expects tensor {slot.name!r}, which the source does not have; "
                           "the weight specs changed since the bridge connected")
        if tuple(tensor.shape) != slot.shape or dtype_to_str(tensor.dtype) != slot.dtype:
            raise ValueError(f"{slot.name}: planned as {slot.dtype} {slot.shape}, source has "
                             f"{dtype_to_str(tensor.dtype)} {tuple(tensor.shape)}")
        out[slot.offset: slot.offset + slot.nbytes].copy_(as_bytes(tensor))
    return out[: layout.nbytes]


def unpack_bucket(layout: BucketLayout, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views (no copies) of each tensor inside a received bucket, in packing order."""
    if flat.numel() < layout.nbytes:
        raise ValueError(f"bucket {layout.index} needs {layout.nbytes} bytes, the buffer has {flat.numel()}")
    return [(s.name, flat[s.offset: s.offset + s.nbytes].view(str_to_dtype(s.dtype)).reshape(s.shape))
            for s in layout.slots]


def checksum(flat: torch.Tensor, start: int = 0) -> str:
    """CRC-32 of a bucket's bytes as 8 hex digits (3+ GB/s here, and the GIL is released while it runs).
    Chainable: `checksum(b, start=int(checksum(a), 16)) == checksum(a ++ b)`, so a receiver that holds the tensors
    one by one (a safetensors file) gets the same value as one that holds the flat bucket."""
    data = flat if flat.device.type == "cpu" else flat.cpu()
    return f"{zlib.crc32(memoryview(as_bytes(data).numpy()), start) & 0xFFFFFFFF:08x}"


def checksum_tensors(tensors: Sequence[torch.Tensor]) -> str:
    """`checksum` of the bucket these tensors make, in this order, without packing them."""
    crc = 0
    for tensor in tensors:
        crc = int(checksum(tensor, crc), 16)
    return f"{crc:08x}"
