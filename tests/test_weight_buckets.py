"""Buckets by hand: sizes, order, the alignment rule SGLang's receiver enforces, bit-exact pack/unpack, and the
checksum (wrapping sums of 64-bit words) that chains across tensors the way a flat bucket does."""
from __future__ import annotations

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


def test_strided_views_pack_like_their_contiguous_copies():
    """Splits of fused weights (one head group's q rows, a transposed matrix) are strided views; they pack in
    place, bit-exactly as their contiguous copies do."""
    fused = torch.randn(4, 3, 8)
    views = {"q": fused[:, :2].reshape(-1, 8)[::2], "t": torch.randn(6, 5).t(), "k": fused[:, 2],
             "h": torch.randn(4, 4).to(torch.bfloat16)[:, 1:3]}
    assert not any(v.is_contiguous() for v in views.values())
    specs = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in views.items()]
    (layout,) = plan_buckets(specs, bucket_bytes=1 << 20)
    packed = pack_bucket(layout, views, torch.empty(layout.nbytes, dtype=torch.uint8))
    reference = pack_bucket(layout, {n: v.contiguous() for n, v in views.items()},
                            torch.empty(layout.nbytes, dtype=torch.uint8))
    assert torch.equal(packed, reference)
    assert checksum(packed) == checksum_tensors([v.contiguous() for v in views.values()])


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


def _reference_checksum(raw: bytes) -> str:
    """The checksum's definition, word by word in plain Python."""
    raw += bytes(-len(raw) % 8)
    words = [int.from_bytes(raw[i: i + 8], "little") for i in range(0, len(raw), 8)]
    mask = (1 << 64) - 1
    return f"{sum(words) & mask:016x}{sum((i + 1) * w for i, w in enumerate(words)) & mask:016x}"


def test_checksum_by_hand_for_two_words_and_a_padded_tail():
    raw = (1).to_bytes(8, "little") + (2).to_bytes(8, "little") + bytes([3])
    # words 1, 2, 3 -> sum 6; weighted 1*1 + 2*2 + 3*3 = 14
    assert checksum(torch.frombuffer(bytearray(raw), dtype=torch.uint8)) == f"{6:016x}{14:016x}"


def test_checksum_matches_its_definition_and_chains_over_tensors_like_the_flat_bucket():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3 * 1024 + 5, generator=gen)  # several 1024-word rows and a partial one
    b = torch.tensor([1, 2, 3], dtype=torch.int16)  # 6 bytes: what follows starts misaligned
    c = torch.randn(2051, generator=gen).to(torch.bfloat16)
    raw = a.numpy().tobytes() + b.numpy().tobytes() + c.view(torch.int16).numpy().tobytes()
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    assert checksum(flat) == _reference_checksum(raw)
    assert checksum(flat, threads=3) == checksum(flat)
    assert checksum_tensors([a, b, c]) == checksum(flat)
    assert checksum(flat[1:]) == _reference_checksum(raw[1:])  # memory that is not 8-byte aligned


def test_checksum_catches_one_flipped_bit_anywhere_and_swapped_tensors():
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen) for n in (4096, 16, 16, 4096)]
    flat = torch.cat([t.view(torch.uint8) for t in tensors])
    reference = checksum(flat)
    for position in (0, 7, 8, 100, flat.numel() // 2, flat.numel() - 1):
        for bit in (0, 7):
            flipped = flat.clone()
            flipped[position] ^= 1 << bit
            assert checksum(flipped) != reference, (position, bit)
    # two adjacent 64-byte tensors exchanged (a name mix-up), and the two big ones exchanged
    assert checksum_tensors([tensors[0], tensors[2], tensors[1], tensors[3]]) != reference
    assert checksum_tensors([tensors[3], tensors[1], tensors[2], tensors[0]]) != reference
    assert checksum_tensors(tensors) == reference


def test_dtype_names_resolve_like_sglangs():
    assert str_to_dtype("bfloat16") is torch.bfloat16


def test_the_cuda_ipc_encoder_imports_on_this_torch_and_refuses_a_bucket_outside_cuda():
    # torch 2.11 dropped torch.multiprocessing.reductions.ForkingPickler; the encoder must still import its pickler
    # (here, with no CUDA, it reaches the device check and names the device)
    from weight_sync.ipc import encode_cuda_entries, serialize_entry

    with pytest.raises(ValueError, match="this bucket is on cpu"):
        encode_cuda_entries(torch.zeros(8, dtype=torch.uint8), BucketLayout(index=0, slots=()), [0])
    assert serialize_entry({"flattened_tensor": None, "metadata": []})  # the pickler imports on this torch
