"""The weight-update process group: trainer rank 0 and every engine rank meet here before weights are broadcast.

Built from a TCPStore and a backend object directly, so it never touches the default process group (the trainer
already has one for Megatron) and several groups can live in one process.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]

# torch's `_new_process_group_helper`, which SGLang's `init_custom_process_group` calls, stores a backend's keys
# under "<device>/" inside "<group_name>/" inside SGLang's own "<group_name>" prefix. Using the same layout lets a
# real SGLang engine and this module meet in one store.
_DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda"}
# Set by the launcher where CPU bundles stand for the GPUs of an SGLang run (strict engines, `make rehearse`): the
# device each of this process's weight-group members stands on, comma-separated (an engine: one per TP rank).
PLANNED_DEVICES = "SLUICE_PLANNED_DEVICES"


def planned_device(index: int = 0) -> str | None:
    """The device this process's `index`-th weight-group member stands on (`PLANNED_DEVICES`; an engine's TP rank
    `index`), or None where devices are not modeled."""
    devices = [d for d in os.environ.get(PLANNED_DEVICES, "").split(",") if d]
    if not devices:
        return None
    assert index < len(devices), f"{PLANNED_DEVICES}={os.environ[PLANNED_DEVICES]!r} names no device {index}"
    return devices[index]


@dataclass(eq=False)
class WeightGroup:
    """A process group for weight broadcasts: `backend` does the collectives, `store` must stay alive with it."""

    name: str
    rank: int
    world_size: int
    backend_name: Backend
    backend: Any  # ProcessGroupGloo or ProcessGroupNCCL
    store: Any = field(repr=False)  # the TCPStore; rank 0 hosts it, so it must outlive the group

    @property
    def device(self) -> torch.device:
        """Where tensors must live to be broadcast in this group."""
        return torch.device(_DEVICE_OF_BACKEND[self.backend_name])


def create_process_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: Backend = "gloo",
    timeout_s: float = 120.0,
    device: str | None = None,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) the weight group; blocks until all `world_size` ranks have joined.

    The layout of keys in the store is the one SGLang's `/init_weights_update_group` uses, so a trainer can create
    rank 0 with this function while real SGLang engines (or the embedded engine) join as ranks 1..world_size-1.
    `device`: the device this member stands on where devices are modeled (`planned_device`); the group is then
    refused, on every member that models its device, when two members stand on one (`_check_devices`).
    """
    if backend not in _DEVICE_OF_BACKEND:
        raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"weight group {group_name!r}: rank {rank} is outside world_size {world_size}")
    if not group_name:
        raise ValueError("weight group name must be a non-empty string (SGLang's default is 'weight_update_group')")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError("weight group backend 'nccl' needs CUDA and an NCCL build of torch; use 'gloo' on CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            master_address, int(master_port), world_size, rank == 0, timeout=timeout, multi_tenant=True
        )
    except Exception as e:  # re-raised with the address and the usual causes
        role = "host" if rank == 0 else "reach"
        raise RuntimeError(
            f"weight group {group_name!r}: rank {rank} could not {role} the store at {master_address}:{master_port} "
            f"within {timeout_s:.0f} s ({e}). Check that the port is free on rank 0, that every rank uses the same "
            f"address, port and world_size ({world_size}), and that all ranks start within the timeout."
        ) from e
    backend_store = dist.PrefixStore(
        f"{_DEVICE_OF_BACKEND[backend]}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    )
    pg = _make_backend(backend, backend_store, rank, world_size, timeout)
    pg._set_sequence_number_for_group()  # torch's helper does this too; the other side waits for the key
    try:
        _check_devices(store, group_name, rank, world_size, device, timeout)
    except BaseException:
        getattr(pg, "shutdown", lambda: None)()
        raise
    return WeightGroup(name=group_name, rank=rank, world_size=world_size, backend_name=backend, backend=pg, store=store)


def _check_devices(store: Any, group_name: str, rank: int, world_size: int, device: str | None,
                   timeout: datetime.timedelta) -> None:
    """NCCL's device rule, modeled where devices are planned rather than real (gloo lets ranks share a device; NCCL
    refuses the communicator, "Duplicate GPU detected", on every rank). Every member posts the device it stands on
    ('' when it models none, so no member waits on one that does not post); a member that models its device reads
    every member's and refuses the group when two ranks share one, naming both."""
    prefix = f"sluice_device/{group_name}/"
    store.set(prefix + str(rank), device or "")
    if device is None:
        return
    keys = [prefix + str(r) for r in range(world_size)]
    store.wait(keys, timeout)
    devices = [store.get(key).decode() for key in keys]
    store.add(prefix + "read", 1)
    first_on: dict[str, int] = {}
    for other, where in enumerate(devices):
        if where and where in first_on:
            if rank == 0:  # the host's store goes with it: let every modeling member read the devices first
                deadline = time.monotonic() + min(timeout.total_seconds(), 10.0)
                while store.add(prefix + "read", 0) < sum(map(bool, devices)) and time.monotonic() < deadline:
                    time.sleep(0.01)
            raise RuntimeError(f"weight group {group_name!r}: Duplicate GPU detected: rank {first_on[where]} and rank "
                               f"{other} both on {where} (NCCL refuses a communicator with two ranks on one device; "
                               "modeled from the devices the plan gave each rank)")
        first_on.setdefault(where, other)


def _make_backend(backend: Backend, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def destroy_process_group(group: WeightGroup) -> None:
    """Release the group's connections; the group must not be used afterwards."""
    shutdown = getattr(group.backend, "shutdown", None)
    if shutdown is not None:
        shutdown()
    group.backend = None
    group.store = None
