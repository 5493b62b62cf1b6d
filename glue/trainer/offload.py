"""Colocated placement: a trainer rank gives its device to the engines during rollout. Every storage of the
training state (the weights, megatron's gradient and parameter buffers, the main weights, the Adam moments) is copied
to host memory (a separate copy, also when the device is the CPU) and resized to 0 bytes; onload resizes it back and
copies the bytes in. Resizing the storage, not replacing the tensors, keeps every view of it valid: the parameters,
`main_grad` and the buffers' bucket views all point at the same storage again afterwards (megatron offloads its
gradient buffers the same way)."""
from __future__ import annotations

from typing import Any

import torch


def distinct_storages(tensors: list[torch.Tensor]) -> list[Any]:
    """The untyped storages behind `tensors`, each once (views share their base's storage), empty ones left out."""
    seen: dict[int, Any] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def state_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes the storages behind `tensors` hold right now (0 while offloaded)."""
    return sum(s.nbytes() for s in distinct_storages(tensors))


@torch.no_grad()
def to_host(tensors: list[torch.Tensor]) -> list[tuple[Any, Any]]:
    """(storage, host copy) for every storage behind `tensors`; the storages are left holding 0 bytes."""
    saved = []
    for storage in distinct_storages(tensors):
        host = storage.clone() if storage.device.type == "cpu" else storage.cpu()
        storage.resize_(0)
        saved.append((storage, host))
    return saved


@torch.no_grad()
def to_device(saved: list[tuple[Any, Any]]) -> None:
    """Inverse of `to_host`: every storage back at its size and bytes, on its device."""
    for storage, host in saved:
        storage.resize_(host.nbytes())
        storage.copy_(host)
