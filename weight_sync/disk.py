"""The disk transport's files: one HF safetensors shard per bucket plus `model.safetensors.index.json`, written into
a staging directory and renamed into place (atomic: an engine never sees half a checkpoint), then loaded by
`/update_weights_from_disk`. The slow reference path.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Mapping

import torch

from weight_sync.buckets import BucketLayout, checksum_tensors

INDEX_FILE = "model.safetensors.index.json"


def shard_name(index: int, count: int) -> str:
    """HF's shard naming: model-00001-of-00003.safetensors."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class CheckpointWriter:
    """Writes one checkpoint per sync under `root` (`weights-<n>`); keeps only the newest committed one."""

    def __init__(self, root: str, layouts: list[BucketLayout]):
        self.root, self.layouts = root, layouts
        self.committed: str | None = None
        self._count = 0
        os.makedirs(root, exist_ok=True)
        self._staging = os.path.join(root, f".staging-{os.getpid()}")

    def write_bucket(self, index: int, tensors: Mapping[str, torch.Tensor]) -> str:
        """Write bucket `index` as its shard (the first bucket starts a fresh staging directory); returns the
        bucket's checksum, computed over the same bytes in the same order as the other transports'."""
        from safetensors.torch import save_file

        layout = self.layouts[index]
        if index == 0:
            shutil.rmtree(self._staging, ignore_errors=True)
            os.makedirs(self._staging)
        part = {name: tensors[name].detach().contiguous().cpu() for name in layout.names}
        path = os.path.join(self._staging, shard_name(index, len(self.layouts)))
        save_file(part, path, metadata={"format": "pt"})
        fsync_path(path)
        return checksum_tensors([part[n] for n in layout.names])

    def commit(self) -> str:
        """Write the index (its weight_map lists names in bucket order), rename the staging directory into place
        and delete the previous checkpoint; returns the new directory."""
        count = len(self.layouts)
        weight_map = {name: shard_name(b.index, count) for b in self.layouts for name in b.names}
        total = sum(b.nbytes for b in self.layouts)
        index_path = os.path.join(self._staging, INDEX_FILE)
        with open(index_path, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        fsync_path(index_path)
        self._count += 1
        final = os.path.join(self.root, f"weights-{os.getpid()}-{self._count}")
        os.rename(self._staging, final)
        fsync_path(self.root)
        previous, self.committed = self.committed, final
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        return final

    def close(self) -> None:
        shutil.rmtree(self._staging, ignore_errors=True)
        if self.committed is not None:
            shutil.rmtree(self.committed, ignore_errors=True)
            self.committed = None


def fsync_path(path: str) -> None:
    """Flush a file's or a folder's entry to disk (a rename is durable once its folder is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(model_path: str, with_checksums: bool = True) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Engine side: every tensor of an HF safetensors directory, and one checksum per shard, computed in the order
    the index lists the shard's names (the bucket order for checkpoints `CheckpointWriter` wrote); none without
    `with_checksums`."""
    from safetensors.torch import load_file

    index_path = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
    else:
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_path} has no *.safetensors files and no {INDEX_FILE}")
        shards = {f: None for f in files}  # type: ignore[misc]
    named: list[tuple[str, torch.Tensor]] = []
    checksums: list[str] = []
    for shard, names in shards.items():
        tensors = load_file(os.path.join(model_path, shard))
        order = names if names is not None else list(tensors)
        named.extend((n, tensors[n]) for n in order)
        if with_checksums:
            checksums.append(checksum_tensors([tensors[n] for n in order]))
    return named, checksums
