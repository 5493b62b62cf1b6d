"""The engine's side of SGLang's broadcast weight path: join the trainer's group, receive named tensors, load them.

Blocking calls (they wait on the trainer); the server runs them in worker threads so the HTTP loop keeps serving.
"""
from __future__ import annotations

import threading
from typing import Any

from glue.embedded_engine.model_runner import ModelRunner
from weight_sync.broadcast import receive_tensors, str_to_dtype
from weight_sync.process_group import WeightGroup, create_process_group, destroy_process_group


class WeightReceiver:
    """The weight groups this engine (TP=1, so one rank per engine) has joined, by name."""

    def __init__(self, runner: ModelRunner, *, timeout_s: float = 300.0):
        self.runner = runner
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self._lock = threading.Lock()  # one group change or one receive at a time

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> tuple[bool, str]:
        """`/init_weights_update_group`: join as rank `rank_offset` (rank 0 is the trainer)."""
        with self._lock:
            if group_name in self.groups:
                return False, f"weight group {group_name!r} already exists; destroy it first or use another name"
            try:
                group = create_process_group(master_address=master_address, master_port=master_port, rank=rank_offset,
                                             world_size=world_size, group_name=group_name, backend=backend,
                                             timeout_s=self.timeout_s)
            except (RuntimeError, ValueError) as e:  # answered to the caller as SGLang does: success false + message
                return False, f"Failed to initialize custom process group: {e}"
            self.groups[group_name] = group
            return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        with self._lock:
            group = self.groups.pop(group_name, None)
            if group is None:
                return False, "The group to be destroyed does not exist."
            destroy_process_group(group)
            return True, "Succeeded to destroy custom process group."

    def update_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                                weight_version: str | None) -> tuple[bool, str]:
        """`/update_weights_from_distributed`: receive every announced tensor (so the trainer's broadcasts always
        complete), then load them all or, if any name or shape does not fit the model, none."""
        with self._lock:
            group = self.groups.get(group_name)
            if group is None:
                return False, (f"Group {group_name} not in {sorted(self.groups)}. "
                               "Please call `init_weights_update_group` first.")
            named = receive_tensors(group, names, dtypes, shapes, src=0)
        return self.runner.load_weights(named, weight_version)

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group(name)


def check_update_payload(body: Any) -> str | None:
    """The first problem with an `/update_weights_from_distributed` body, or None."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    for name in ("names", "dtypes", "shapes"):
        if not isinstance(body.get(name), list):
            return f"{name} must be a list (one entry per tensor)"
    if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
        return (f"names, dtypes and shapes must have the same length, got {len(body['names'])}, "
                f"{len(body['dtypes'])} and {len(body['shapes'])}")
    for shape in body["shapes"]:
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            return f"shapes must be lists of non-negative integers, got {shape!r}"
    for dtype in body["dtypes"]:
        try:
            str_to_dtype(dtype)
        except ValueError as e:
            return f"dtypes: {e}"
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        return f"weight_version must be a string like SGLang's, got {version!r}"
    if body.get("load_format") not in (None, "auto"):
        return f"load_format {body['load_format']!r} is not supported by the embedded engine (first form: one tensor per broadcast)"
    return None
