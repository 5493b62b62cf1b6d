"""Buckets: the one format every transport moves. HF-named tensors are packed back to back into flat uint8 buffers
of at most `bucket_bytes`, described by a small metadata list (names, dtypes, shapes, byte offsets) — the layout of
SGLang's `load_format="flattened_bucket"` — and carry a checksum (two wrapping sums of 64-bit words) that both
ends compute.
"""
from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024**2
# What one more bucket costs a pipelined sync, in bytes of wire time: ~2 ms (an HTTP round trip to the engine plus
# a collective's start-up, measured on loopback) at ~4 GB/s, a local gloo link's speed.
PIPELINE_OVERHEAD_BYTES = 8 * 1000**2


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


def spec_bytes(specs: Sequence[tuple[str, str, Sequence[int]]]) -> int:
    """Bytes of all `(name, dtype, shape)` specs together."""
    return sum(math.prod(shape) * str_to_dtype(dtype).itemsize for _, dtype, shape in specs)


def pipeline_bucket_bytes(total_bytes: int, cap: int, overhead_bytes: int = PIPELINE_OVERHEAD_BYTES) -> int:
    """The bucket size that makes a pipelined sync of `total_bytes` fastest, at most `cap`.

    With N buckets a two-stage pipeline takes about (1 + 1/N) times its slower stage (the first bucket is packed,
    the last one checked, with nothing beside them), and every bucket adds a fixed cost: the engine's HTTP request
    and the collective's start, worth `overhead_bytes` of wire time. (1 + 1/N) T + N c is least at
    N = sqrt(T / c), that is buckets of sqrt(total_bytes x overhead_bytes): 42 MB for 221 MB of weights, 90 MB for
    1 GB, 360 MB for 16 GB. Never below 1 MiB, where per-bucket costs dominate whatever the model."""
    best = int(math.sqrt(max(total_bytes, 1) * overhead_bytes))
    return max(1, min(cap, max(best, 1024**2)))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (0-dim and empty tensors included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def check_bucket_tensors(layout: BucketLayout, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The bucket's tensors from `tensors`, in packing order, each checked against its planned dtype and shape."""
    chosen = []
    for slot in layout.slots:
        tensor = tensors.get(slot.name)
        if tensor is None:
            raise KeyError(f"bucket {layout.index} expects tensor {slot.name!r}, which the source does not have; "
                           "the weight specs changed since the bridge connected")
        if tuple(tensor.shape) != slot.shape or dtype_to_str(tensor.dtype) != slot.dtype:
            raise ValueError(f"{slot.name}: planned as {slot.dtype} {slot.shape}, source has "
                             f"{dtype_to_str(tensor.dtype)} {tuple(tensor.shape)}")
        chosen.append(tensor)
    return chosen


def pack_bucket(layout: BucketLayout, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into the preallocated uint8 buffer `out` (reused across syncs: fresh allocation
    is what makes copies slow); returns the `layout.nbytes`-long view that was filled."""
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < layout.nbytes:
        raise ValueError(f"pack_bucket needs a flat uint8 buffer of >= {layout.nbytes} bytes, got "
                         f"{out.dtype} {tuple(out.shape)}")
    for slot, tensor in zip(layout.slots, check_bucket_tensors(layout, tensors)):
        place = out[slot.offset: slot.offset + slot.nbytes]
        if tensor.is_contiguous():
            place.copy_(as_bytes(tensor))
        else:  # a strided view (a split of a fused weight): copied in place, no contiguous temporary
            place.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return out[: layout.nbytes]


def unpack_bucket(layout: BucketLayout, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views (no copies) of each tensor inside a received bucket, in packing order."""
    if flat.numel() < layout.nbytes:
        raise ValueError(f"bucket {layout.index} needs {layout.nbytes} bytes, the buffer has {flat.numel()}")
    return [(s.name, flat[s.offset: s.offset + s.nbytes].view(str_to_dtype(s.dtype)).reshape(s.shape))
            for s in layout.slots]


# The bucket checksum: the bytes read as little-endian 64-bit words w_0, w_1, ... (the last one zero-padded), and the
# pair (sum of w_i, sum of (i + 1) * w_i), both mod 2**64. One flipped bit changes the first sum by a power of two, so
# it is always caught; moving content to another position (swapped tensors) changes the second. Integer sums wrap
# the same way whatever the summation order, so both ends agree exactly. torch computes them at memory speed: for
# 221 MB, 25 ms on one thread and 16-19 ms on two, against 65+ ms for zlib's CRC-32, which matters because the
# checksum shares the machine's cores with the broadcast it overlaps and, on the engine, follows it.
_ROW = 1024  # words per row of the 2-D view: word (r, k) has weight base + r * _ROW + k + 1
_CHUNK_ROWS = 128  # rows reduced per step (1 MB): the second reduction of a chunk reads it from cache
_MASK = (1 << 64) - 1
_pool: ThreadPoolExecutor | None = None


def _word_sums(words: torch.Tensor, first: int) -> tuple[int, int]:
    """(sum w, sum (first + i + 1) * w_i) over int64 words whose first one has absolute index `first`."""
    rows = words.numel() // _ROW
    plain = weighted = 0
    if rows:
        body = words[: rows * _ROW].view(rows, _ROW)
        cols = torch.zeros(_ROW, dtype=torch.int64, device=words.device)
        row_sums = []
        for r in range(0, rows, _CHUNK_ROWS):
            chunk = body[r: r + _CHUNK_ROWS]
            row_sums.append(chunk.sum(1))
            cols += chunk.sum(0)
        per_row = torch.cat(row_sums)
        total = int(per_row.sum())
        row_index = torch.arange(rows, dtype=torch.int64, device=words.device)
        col_index = torch.arange(_ROW, dtype=torch.int64, device=words.device)
        plain = total
        weighted = (first + 1) * total + _ROW * int((per_row * row_index).sum()) + int((cols * col_index).sum())
    tail = words[rows * _ROW:]
    if tail.numel():
        at = first + rows * _ROW + 1
        plain += int(tail.sum())
        weighted += int((tail * torch.arange(at, at + tail.numel(), dtype=torch.int64, device=words.device)).sum())
    return plain & _MASK, weighted & _MASK


def _byte_sums(data: torch.Tensor, start: int, parts: int = 1) -> tuple[int, int]:
    """The checksum's two sums for flat uint8 `data` that sits at byte `start` of the stream. Bytes outside whole
    aligned words (at most 7 at each end) are added one by one: byte b at position p adds b << 8 * (p % 8) to word
    p // 8. Data whose memory cannot be viewed as int64 is copied to an aligned buffer first (rare)."""
    n = data.numel()
    head = min((-start) % 8, n)
    words_len = (n - head) // 8 * 8
    loose = [(start + j, v) for j, v in enumerate(data[:head].tolist())]
    loose += [(start + j, v) for j, v in
              zip(range(head + words_len, n), data[head + words_len:].tolist())]
    plain = weighted = 0
    for pos, value in loose:
        word = value << (8 * (pos % 8))
        plain += word
        weighted += (pos // 8 + 1) * word
    if words_len:
        body = data[head: head + words_len]
        if body.data_ptr() % 8:
            body = body.clone()
        words, first = body.view(torch.int64), (start + head) // 8
        cuts = [0] + [words.numel() * i // parts // _ROW * _ROW for i in range(1, parts)] + [words.numel()]
        pieces = [(words[a:b], first + a) for a, b in zip(cuts, cuts[1:]) if b > a]
        if len(pieces) > 1:
            global _pool
            if _pool is None or _pool._max_workers < len(pieces):
                _pool = ThreadPoolExecutor(max_workers=len(pieces), thread_name_prefix="checksum")
            results = list(_pool.map(lambda piece: _word_sums(*piece), pieces))
        else:
            results = [_word_sums(*piece) for piece in pieces]
        plain += sum(r[0] for r in results)
        weighted += sum(r[1] for r in results)
    return plain & _MASK, weighted & _MASK


def _hex(sums: tuple[int, int]) -> str:
    return f"{sums[0]:016x}{sums[1]:016x}"


def checksum(flat: torch.Tensor, threads: int = 1) -> str:
    """A bucket's checksum (see above) as 32 hex digits. `threads` > 1 splits the work across Python threads (torch
    releases the GIL): for a process whose torch runs on one thread, like the embedded engine."""
    return _hex(_byte_sums(as_bytes(flat), 0, max(1, threads)))


def checksum_tensors(tensors: Sequence[torch.Tensor]) -> str:
    """`checksum` of the bucket these tensors make, in this order, without packing them (a receiver that holds
    the tensors one by one, such as a safetensors file, gets the value a flat bucket gives)."""
    plain = weighted = offset = 0
    for tensor in tensors:
        data = as_bytes(tensor)
        a, b = _byte_sums(data, offset)
        plain, weighted, offset = plain + a, weighted + b, offset + data.numel()
    return _hex((plain & _MASK, weighted & _MASK))


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor weights-checker hash on CPU: the first 8 bytes of SHA-256 of the bytes, as 16 hex digits
    (verify: full compares the source's and every engine's, tensor by tensor)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()[:16]
