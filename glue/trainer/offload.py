"""Colocated placement: a trainer rank gives its device to the engines during rollout. Parameters and optimizer
state are copied to host memory (a separate storage, also when the device is the CPU) and their device copies
freed; onload brings them back into the same Parameter and state objects."""
from __future__ import annotations

from typing import Any

import torch


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[dict[str, Any], str]]:
    """(state dict, key) of every optimizer state tensor with data (AdamW's exp_avg, exp_avg_sq)."""
    return [(state, k) for state in optimizer.state.values() for k, v in state.items()
            if torch.is_tensor(v) and v.dim() > 0]


def state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Bytes the parameters, their gradients and the optimizer state hold right now (0 while offloaded)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for p in params for t in (p.data, p.grad) if t is not None and t.numel()}
    storages.update({state[k].untyped_storage().data_ptr(): state[k].untyped_storage().nbytes()
                     for state, k in optimizer_tensors(optimizer)})
    return sum(storages.values())


@torch.no_grad()
def to_host(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
    """Host copies of `params` and the optimizer state; the device copies are replaced by empty tensors."""
    saved: dict[Any, torch.Tensor] = {}
    for p in params:
        saved[p] = p.data.to("cpu", copy=True)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    for state, k in optimizer_tensors(optimizer):
        saved[(id(state), k)] = state[k].to("cpu", copy=True)
        state[k] = torch.empty(0, dtype=state[k].dtype, device=state[k].device)
    return saved


@torch.no_grad()
def to_device(saved: dict[Any, torch.Tensor], params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
              device: torch.device) -> None:
    """Inverse of `to_host`."""
    for p in params:
        p.data = saved[p].to(device)
    for state in optimizer.state.values():
        for k in list(state):
            if (id(state), k) in saved:
                state[k] = saved[(id(state), k)].to(device)
