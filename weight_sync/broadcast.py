"""Moving named tensors through a weight group: the trainer's `send_tensors` meets the engine's `receive_tensors`.

First form: one broadcast per tensor, issued together and awaited together (the order of names is the contract:
both sides must list the same names, dtypes and shapes in the same order, as SGLang's
`/update_weights_from_distributed` does).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from weight_sync.process_group import WeightGroup


def dtype_to_str(dtype: torch.dtype) -> str:
    """The name SGLang's `UpdateWeightsFromDistributedReqInput.dtypes` carries: `torch.bfloat16` -> "bfloat16"."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype_to_str expects a torch.dtype, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    """Inverse of `dtype_to_str` (SGLang resolves the string with `getattr(torch, name)`)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


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
