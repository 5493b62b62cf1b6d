"""Collectives of the broadcast transport: one flat bucket per broadcast (`broadcast_bucket`, what the bridge uses),
and the per-tensor form (`send_tensors` / `receive_tensors`, SGLang's default load format). Both sides must list the
same names, dtypes and shapes in the same order, as SGLang's `/update_weights_from_distributed` does.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from weight_sync.buckets import dtype_to_str, str_to_dtype  # noqa: F401  (re-exported: the names SGLang speaks)
from weight_sync.process_group import WeightGroup


def _broadcast_all(group: WeightGroup, tensors: Sequence[torch.Tensor], src: int) -> None:
    if group.backend is None:
        raise RuntimeError(f"weight group {group.name!r} was destroyed; create it again before broadcasting")
    works = []
    for tensor in tensors:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        works.append(group.backend.broadcast([tensor], opts))
    for work in works:
        work.wait()


def send_tensors(group: WeightGroup, named_tensors: list[tuple[str, torch.Tensor]], src: int = 0) -> None:
    """Broadcast each tensor from rank `src` (this rank) to every other rank of `group`, in list order."""
    if group.rank != src:
        raise ValueError(f"send_tensors runs on the source rank {src}, but this is rank {group.rank} of {group.name!r}")
    device = group.device
    tensors = [t.detach().to(device).contiguous() for _, t in named_tensors]
    _broadcast_all(group, tensors, src)


def receive_tensors(
    group: WeightGroup,
    names: Sequence[str],
    dtypes: Sequence[str | torch.dtype],
    shapes: Sequence[Sequence[int]],
    src: int = 0,
) -> list[tuple[str, torch.Tensor]]:
    """Receive the tensors rank `src` broadcasts, allocated from the announced dtypes and shapes, in order."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"receive_tensors: names, dtypes and shapes must have one entry per tensor, "
            f"got {len(names)}, {len(dtypes)} and {len(shapes)}"
        )
    if group.rank == src:
        raise ValueError(f"receive_tensors runs on ranks other than the source {src} of {group.name!r}")
    named = [
        (name, torch.empty(tuple(shape), dtype=d if isinstance(d, torch.dtype) else str_to_dtype(d), device=group.device))
        for name, d, shape in zip(names, dtypes, shapes)
    ]
    _broadcast_all(group, [t for _, t in named], src)
    return named


def abort_key(group_name: str) -> str:
    """The key in a weight group's store that tells its members to stop waiting in the current broadcast: set by
    the driver when a member failed or refused (an engine answered before joining), so nobody waits out the
    collective's timeout for it. A group whose key is set is finished: its members close it."""
    return f"sluice_abort/{group_name}"


class BroadcastAborted(RuntimeError):
    """This member left a broadcast because another member failed (the group's abort key was set)."""


def wait_unless_aborted(group: WeightGroup, work: Any, poll_s: float = 0.005) -> None:
    """Wait for a broadcast, but leave it once the group's abort key appears (`abort_key`)."""
    key = abort_key(group.name)
    while not work.is_completed():
        if group.store is not None and group.store.check([key]):
            raise BroadcastAborted(f"weight group {group.name!r}: another member failed, left the broadcast")
        time.sleep(poll_s)
    work.wait()  # raises the collective's own error, if it had one


def broadcast_bucket(group: WeightGroup, flat: torch.Tensor, src: int = 0, wait: bool = True) -> Any:
    """One collective for a whole bucket: the source sends `flat`, every other rank receives into its own `flat`
    (a preallocated uint8 buffer of the bucket's size, on `group.device`). With `wait=False` returns the work
    handle, so the caller can read `flat` (checksum it) while it is on the wire, then `wait_unless_aborted`."""
    if flat.device.type != group.device.type:
        raise ValueError(f"weight group {group.name!r} ({group.backend_name}) broadcasts {group.device.type} tensors, "
                         f"the bucket is on {flat.device}")
    if group.backend is None:
        raise RuntimeError(f"weight group {group.name!r} was destroyed; create it again before broadcasting")
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    work = group.backend.broadcast([flat], opts)
    if wait:
        wait_unless_aborted(group, work)
        return None
    return work
