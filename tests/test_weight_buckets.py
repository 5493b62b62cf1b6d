"""Buckets by hand: sizes, order, the alignment rule SGLang's receiver enforces, bit-exact pack/unpack, and the
CRC-32 checksum (zlib's) that chains across tensors the way a flat bucket does."""
from __future__ import annotations

import zlib

import pytest
import torch

from weight_sync.buckets import (BucketLayout, checksum, checksum_tensors, pack_bucket, plan_buckets, str_to_dtype,
                                 unpack_bucket)


def test_buckets_hold_at_most_bucket_bytes_in_order_and_an_oversized_tensor_travels_alone():
    specs = [("a", "float32", (10,)), ("b", "float32", (5,)), ("c", "float32", (30,)), ("d", "float32", (2,))]
    buckets = plan_buckets(specs, bucket_bytes=64)  # a=40 B, b=20 B, c=120 B, d=8 B
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.nbytes for b in buckets] == [60, 120, 8]
    assert [s.offset for s in buckets[0].slots] == [0, 40]
    assert [b.index for b in buckets] == [0, 1, 2]


def test_a_tensor_that_would_start_misaligned_for_its_dtype_opens_a_new_bucket():
    # 3 bytes of uint8, then float32 would start at byte 3 (not a multiple of 4): SGLang refuses such offsets
    buckets = plan_buckets([("m", "uint8", (3,)), ("w", "float32", (2,)), ("h", "bfloat16", (2,))], bucket_bytes=1024)
    assert [b.names for b in buckets] == [["m"], ["w", "h"]]
    assert [s.offset for s in buckets[1].slots] == [0, 8]


def test_pack_then_unpack_gives_every_tensor_back_bit_exactly_with_mixed_dtypes():
    tensors = {"w": torch.randn(3, 4), "i": torch.tensor([[7, -1]]), "s": torch.tensor(2.5),
               "h": torch.randn(5).to(torch.bfloat16)}
    specs = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    (layout,) = plan_buckets(specs, bucket_bytes=1 << 20)
    assert layout.nbytes == 48 + 16 + 4 + 10
    buffer = torch.full((256,), 0xAB, dtype=torch.uint8)  # reused buffer, larger than the bucket
    flat = pack_bucket(layout, tensors, buffer)
    assert flat.numel() == layout.nbytes and flat.data_ptr() == buffer.data_ptr()
    for name, view in unpack_bucket(layout, flat.clone()):
        assert view.dtype == tensors[name].dtype and torch.equal(view, tensors[name]), name


def test_layout_json_round_trips_and_wrong_offsets_are_refused():
    (layout,) = plan_buckets([("a", "float32", (2, 2)), ("b", "int64", (1,))], bucket_bytes=100)
    meta = layout.to_json()
    assert meta == {"names": ["a", "b"], "dtypes": ["float32", "int64"], "shapes": [[2, 2], [1]], "offsets": [0, 16]}
    assert BucketLayout.from_json(0, meta) == layout
    assert BucketLayout.from_json(0, {k: v for k, v in meta.items() if k != "offsets"}) == layout
    with pytest.raises(ValueError, match="'b' announced at byte 8, but packing puts it at 16"):
        BucketLayout.from_json(0, {**meta, "offsets": [0, 8]})


def test_pack_names_the_tensor_that_does_not_match_its_plan():
    (layout,) = plan_buckets([("a", "float32", (2,))], bucket_bytes=100)
    with pytest.raises(ValueError, match=r"a: planned as float32 \(2,\), source has float32 \(3,\)"):
        pack_bucket(layout, {"a": torch.zeros(3)}, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(KeyError, match="expects tensor 'a'"):
        pack_bucket(layout, {}, torch.empty(100, dtype=torch.uint8))


def test_checksum_is_zlibs_crc32_and_chains_over_tensors_like_the_flat_bucket():
    a, b = torch.arange(6, dtype=torch.float32), torch.tensor([1, 2, 3], dtype=torch.int16)
    raw = a.numpy().tobytes() + b.numpy().tobytes()
    assert checksum(torch.frombuffer(bytearray(raw), dtype=torch.uint8)) == f"{zlib.crc32(raw):08x}"
    assert checksum_tensors([a, b]) == f"{zlib.crc32(raw):08x}"
    flipped = bytearray(raw)
    flipped[5] ^= 1  # one bit anywhere changes it
    assert checksum(torch.frombuffer(flipped, dtype=torch.uint8)) != checksum_tensors([a, b])
    assert str_to_dtype("bfloat16") is torch.bfloat16
