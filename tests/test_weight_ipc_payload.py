"""The ipc transport's payload against SGLang 0.5.23's own reading code, taken from the pinned source and run here:
the tokenizer's base64 normalisation, the scheduler's SafeUnpickler (its allowlist) and the weight updater's
flattened-bucket loader load what sluice writes, bit for bit; SGLang reads the metadata by attribute, so dicts fail
there; then the engine-side reader's refusals, one per fault."""
from __future__ import annotations

import ast
import base64
import binascii
import io
import pickle
import types
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

from helpers.schema import class_fields
from weight_sync.buckets import pack_bucket, plan_buckets
from weight_sync.ipc import (ALLOWED_GLOBALS, DEVICE_ARG, ENVELOPE_KEYS, METADATA_FIELDS, SharedSegment,
                             encode_shm_entries, metadata_of, read_entries, read_entry, serialize_entry)


def sglang_code(path: Path, *names: str) -> dict:
    """The named functions and classes of an SGLang module (found at any depth, methods included), executed from
    the pinned source with the few globals they use; sglang itself is not importable here."""
    found = {node.name: node for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names}
    assert set(found) == set(names), f"{path.name} no longer defines {set(names) - set(found)}"
    namespace = {"pickle": pickle, "io": io, "torch": torch, "pybase64": base64, "binascii": binascii,
                 "dataclass": dataclass, "List": List, "Tuple": Tuple, "WeightUpdater": object}
    for name in names:  # in the order given: later ones may use earlier ones
        exec(compile(ast.unparse(found[name]), str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def sglang(sglang_srt) -> types.SimpleNamespace:
    """SGLang's path of one `/update_weights_from_tensor` entry: normalise (tokenizer), deserialize (the TP rank's
    SafeUnpickler), load (the weight updater's flattened-bucket branch), with FlattenedTensorBucket from the pinned
    tensor_bucket.py."""
    common = sglang_code(sglang_srt / "utils" / "common.py", "_looks_like_pickle_payload",
                         "normalize_serialized_named_tensor_payload", "_safe_load_torch_storage", "SafeUnpickler")
    bucket = sglang_code(sglang_srt / "weight_sync" / "tensor_bucket.py", "FlattenedTensorMetadata",
                         "FlattenedTensorBucket")
    updater = sglang_code(sglang_srt / "model_executor" / "model_runner_components" / "weight_updater.py",
                          "_update_weights_from_flattened_bucket")
    updater.update(FlattenedTensorMetadata=bucket["FlattenedTensorMetadata"],
                   FlattenedTensorBucket=bucket["FlattenedTensorBucket"])

    def load(entry: str) -> list[tuple[str, torch.Tensor]]:
        data = common["SafeUnpickler"](io.BytesIO(common["normalize_serialized_named_tensor_payload"](entry))).load()
        loaded = []
        model = types.SimpleNamespace(load_weights=loaded.extend)
        runner = types.SimpleNamespace(get_model=lambda: model)
        assert updater["_update_weights_from_flattened_bucket"](runner, data) == (True, "Success")
        return loaded

    def unpickle(entry: str):
        return common["SafeUnpickler"](io.BytesIO(common["normalize_serialized_named_tensor_payload"](entry))).load()

    return types.SimpleNamespace(load=load, unpickle=unpickle, allowed=common["SafeUnpickler"].ALLOWED_GLOBALS)


def bucket_of_three():
    gen = torch.Generator().manual_seed(3)
    tensors = {"model.embed_tokens.weight": torch.randn(16, 8, generator=gen),
               "model.norm.weight": torch.randn(8, generator=gen).bfloat16(),
               "lm_head.weight": torch.randn(16, 8, generator=gen).half()}
    [layout] = plan_buckets([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()],
                            1 << 20)
    return tensors, layout


def test_every_global_an_entry_may_name_is_on_sglangs_safe_unpickler_allowlist(sglang):
    assert len(sglang.allowed) > 100  # the real list, not an empty match
    assert ALLOWED_GLOBALS - sglang.allowed == set()


def test_sglangs_own_reading_code_loads_a_bucket_sluice_wrote_bit_identically(sglang):
    # sluice's envelope and metadata around a CPU tensor (plain pickle: CUDA IPC needs a GPU, tests/test_gpu_one_device)
    tensors, layout = bucket_of_three()
    flat = pack_bucket(layout, tensors, torch.empty(layout.nbytes, dtype=torch.uint8))
    entry = base64.b64encode(pickle.dumps({"flattened_tensor": flat, "metadata": metadata_of(layout)})).decode()
    loaded = sglang.load(entry)
    assert [name for name, _ in loaded] == list(tensors)
    for name, tensor in loaded:
        assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name]), name


def test_sglangs_loader_reads_metadata_by_attribute_so_dicts_fail_there_and_the_engine_refuses_them(sglang):
    tensors, layout = bucket_of_three()
    flat = pack_bucket(layout, tensors, torch.empty(layout.nbytes, dtype=torch.uint8))
    as_dicts = [vars(m) for m in metadata_of(layout)]
    entry = base64.b64encode(pickle.dumps({"flattened_tensor": flat, "metadata": as_dicts})).decode()
    with pytest.raises(AttributeError, match="'dict' object has no attribute 'name'"):
        sglang.load(entry)
    stand_in = types.SimpleNamespace(sluice_shm="/dev/shm/x", nbytes=layout.nbytes, tp_rank=0)
    with pytest.raises(ValueError, match=r"metadata\[0\] lacks attribute\(s\) \['name', 'shape', 'dtype'"):
        read_entry(serialize_entry({"flattened_tensor": stand_in, "metadata": as_dicts}))


def test_the_envelope_and_metadata_are_exactly_what_sglang_reads(sglang_srt):
    fields = class_fields(sglang_srt / "weight_sync" / "tensor_bucket.py")["FlattenedTensorMetadata"]
    assert fields == set(METADATA_FIELDS)
    updater = sglang_srt / "model_executor" / "model_runner_components" / "weight_updater.py"
    [loader] = [n for n in ast.walk(ast.parse(updater.read_text()))
                if isinstance(n, ast.FunctionDef) and n.name == "_update_weights_from_flattened_bucket"]
    keys = {n.slice.value for n in ast.walk(loader) if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)}
    read = {n.attr for n in ast.walk(loader) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "meta"}
    assert keys == set(ENVELOPE_KEYS) and read == set(METADATA_FIELDS)


def test_each_tp_rank_reads_its_own_entry_with_cuda_devices_named_by_uuid(sglang_srt):
    import inspect

    from torch.multiprocessing import reductions

    assert "serialized_named_tensors[get_parallel().tp_rank]" in (sglang_srt / "managers" / "tp_worker.py").read_text()
    patch = (sglang_srt / "utils" / "patch_torch.py").read_text()
    assert f"_REDUCE_TENSOR_ARG_DEVICE_INDEX = {DEVICE_ARG}" in patch
    assert "str(torch.cuda.get_device_properties(device).uuid)" in patch  # what weight_sync.ipc.device_uuid sends
    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)[DEVICE_ARG] == "storage_device"
    # the payload the tokenizer hands on: base64 strings decoded, one entry per rank, in the request's order
    io_struct = (sglang_srt / "managers" / "io_struct.py").read_text()
    assert "serialized_named_tensors: Annotated[List[bytes], Base64Bytes()]" in io_struct


def test_the_cpu_stand_in_entries_pass_sglangs_unpickler_one_per_rank_each_naming_its_rank(sglang):
    tensors, layout = bucket_of_three()
    segment = SharedSegment(f"sluice-payload-test-{id(layout)}", layout.nbytes)
    try:
        pack_bucket(layout, tensors, segment.buffer)
        entries = encode_shm_entries(segment, layout, range(3))
        assert len(set(entries)) == 3
        for rank, entry in enumerate(entries):
            data = sglang.unpickle(entry)  # every global admitted; SGLang would then fail to slice the stand-in
            assert sorted(data) == sorted(ENVELOPE_KEYS) and data["flattened_tensor"].tp_rank == rank
            assert [m.name for m in data["metadata"]] == list(tensors)
        read, (stand_in, *_) = read_entries(entries, 3)
        assert read.slots == layout.slots and stand_in.sluice_shm == segment.path and stand_in.nbytes == layout.nbytes
    finally:
        segment.close()
    with pytest.raises(ValueError, match="does not hold the"):  # the source closed its segment
        read_entries(entries, 3)


@pytest.fixture
def segment():
    tensors, layout = bucket_of_three()
    shared = SharedSegment(f"sluice-payload-test-{id(tensors)}", layout.nbytes)
    pack_bucket(layout, tensors, shared.buffer)
    yield shared
    shared.close()


def test_the_reader_refuses_each_fault_with_a_message_naming_it(segment):
    _, layout = bucket_of_three()
    meta = metadata_of(layout)

    def entry(flattened=None, metadata=meta, **extra) -> str:
        flattened = flattened or types.SimpleNamespace(sluice_shm=segment.path, nbytes=layout.nbytes, tp_rank=0,
                                                   device=None)
        return serialize_entry({"flattened_tensor": flattened, "metadata": metadata, **extra})

    cases = [
        ([entry()], 2, r"has 1 entries; this engine has 2 TP rank\(s\) .* send exactly 2"),
        (["not base64!"], 1, r"serialized_named_tensors\[0\] is not base64"),
        ([7], 1, r"serialized_named_tensors\[0\] must be a base64 string, got int"),
        ([base64.b64encode(pickle.dumps(print)).decode()], 1, "global builtins.print is not one sluice sends"),
        ([base64.b64encode(pickle.dumps(torch.zeros(2))).decode()], 1, "_rebuild_tensor_v2 is not one sluice sends"),
        ([entry(extra=1)], 1, "must unpickle to a dict of exactly"),
        ([entry(metadata=[])], 1, "metadata must be a non-empty list"),
        ([entry(metadata=meta[::-1])], 1, "announced at byte 528, but packing puts it at 0"),
        ([entry(metadata=[types.SimpleNamespace(**{**vars(meta[0]), "numel": 1}), *meta[1:]])], 1,
         r"spans bytes 0-512 \(numel 1\)"),
        ([entry(metadata=[types.SimpleNamespace(**{**vars(meta[0]), "dtype": "float32"}), *meta[1:]])], 1,
         "needs a torch.dtype and a torch.Size"),
        ([entry(types.SimpleNamespace(sluice_shm="/etc/passwd", nbytes=layout.nbytes, tp_rank=0,
                                     device=None))], 1,
         "is not a file in /dev/shm"),
        ([entry(types.SimpleNamespace(sluice_shm=segment.path, nbytes=layout.nbytes))], 1,
         "must be a tensor .* or sluice's CPU stand-in"),
        ([entry(), entry()], 2, r"serialized_named_tensors\[1\] repeats an earlier entry"),
        ([entry(), entry(types.SimpleNamespace(sluice_shm=segment.path, nbytes=meta[0].numel, tp_rank=1,
                                                         device=None), meta[:1])],
         2, r"serialized_named_tensors\[1\] describes another bucket"),
        (list(reversed(encode_shm_entries(segment, layout, range(2)))), 2, r"serialized_named_tensors\[0\] was made for TP "
                                                                    "rank 1"),
    ]
    for entries, tp_size, says in cases:
        with pytest.raises(ValueError, match=says):
            read_entries(entries, tp_size)
    # where devices are modeled, an entry opens only on the device it was made on, as a CUDA IPC handle does
    made_on_1 = encode_shm_entries(segment, layout, range(2), device="cpu bundle 1")
    with pytest.raises(ValueError, match=r"serialized_named_tensors\[0\] was made on cpu bundle 1, but TP rank 0 "
                                         "stands on cpu bundle 0: each engine rank must get the bucket copy"):
        read_entries(made_on_1, 2, ["cpu bundle 0", "cpu bundle 1"])
    with pytest.raises(ValueError, match=r"\[1\] was made on an unmodeled device, but TP rank 1 stands on gpu 1"):
        read_entries(encode_shm_entries(segment, layout, range(2)), 2, [None, "gpu 1"])
    assert read_entries(encode_shm_entries(segment, layout, range(2)), 2)[0].slots == layout.slots


def test_serializing_an_entry_leaves_torchs_own_reductions_as_they_were():
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401
    from torch.multiprocessing import reductions

    serialize_entry({"flattened_tensor": None, "metadata": []})
    assert ForkingPickler._extra_reducers[torch.Tensor] is reductions.reduce_tensor  # the UUID reducer is per pickler
