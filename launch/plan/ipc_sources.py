"""Where the ipc transport's buckets come from: every engine TP rank reads the bucket copy of the trainer rank on its
own device (one source per GPU; weight_sync.ipc_transport.IpcTransport), planned here from the placement's bundles. An
engine with a rank on a device no trainer rank holds cannot be reached by a CUDA IPC handle: it alone gets disk.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from launch.plan.run_plan import RunPlan


def ipc_sources(trainer_bundles: list[int], engine_bundles: list[list[int]], devices_matter: bool
                ) -> list[list[int] | None]:
    """Per engine, the trainer rank on the bundle of each of its TP ranks; None for an engine with a rank on a
    bundle without one, where `devices_matter` (GPUs, or CPU bundles standing for them: a handle opens only on the
    device it was made on). Elsewhere shared memory reaches any process, and trainer rank 0 serves such a rank."""
    on = {bundle: rank for rank, bundle in enumerate(trainer_bundles)}
    sources = []
    for bundles in engine_bundles:
        ranks = [on.get(b, None if devices_matter else 0) for b in bundles]
        sources.append(None if None in ranks else ranks)
    return sources


def plan_sources(plan: RunPlan) -> list[list[int] | None]:
    """`ipc_sources` of the plan's trainer ranks and engines."""
    return ipc_sources([r.bundle for r in plan.trainer], [e.bundles for e in plan.engines],
                       plan.device == "gpu" or plan.models_devices)


def slot_sources(sources: list[list[int] | None], engine_urls: list[str]) -> Callable[[str], list[int] | None]:
    """ipc: the trainer rank on each TP rank's GPU of the engine at `url`, by its slot in the live `engine_urls` (a
    replacement takes its slot's url). An engine added past the plan (RolloutFleet.add_engine) stands on no planned
    GPU, so no handle is known to reach it: None, the weights go to it by disk."""
    def sources_of(url: str) -> list[int] | None:
        slot = engine_urls.index(url)
        return sources[slot] if slot < len(sources) else None
    return sources_of


def settle_ipc(cfg: Any, plan: RunPlan) -> tuple[Any, RunPlan]:
    """ipc where it reaches; where some engine stands on devices without a trainer rank, that engine alone gets the
    weights by disk (weight_sync.ipc_transport.IpcOrDisk), said in the plan's `transport_reason`."""
    if cfg.sync.transport != "ipc" or not plan.engines:
        return cfg, plan
    unreached = [e.index for e, ranks in zip(plan.engines, plan_sources(plan)) if ranks is None]
    if not unreached:
        return cfg, plan
    reason = (f"ipc, and disk for engine(s) {', '.join(map(str, unreached))}: they stand on devices without a trainer "
              f"rank (trainer {len(plan.trainer)} ranks, engines {sum(len(e.bundles) for e in plan.engines)} GPUs), "
              "which no CUDA IPC handle reaches")
    return cfg, dataclasses.replace(plan, transport_reason=reason)


def describe_sources(plan: RunPlan) -> list[str]:
    """`--dry-run`'s line per engine: `engine 0: TP rank 0 <- trainer rank 0 (node 0 gpu 0), ...`, or `engine 2: by
    disk (no trainer rank on node 0 gpu 4, node 0 gpu 5)`."""
    lines = []
    for engine, ranks in zip(plan.engines, plan_sources(plan)):
        if ranks is None:
            where = ", ".join(plan.device_of(b) for b in engine.bundles)
            lines.append(f"engine {engine.index}: by disk (no trainer rank on {where})")
            continue
        pairs = [f"TP rank {t} <- trainer rank {r} ({plan.device_of(b)})"
                 for t, (r, b) in enumerate(zip(ranks, engine.bundles))]
        lines.append(f"engine {engine.index}: " + ", ".join(pairs))
    return lines


def copy_ranks(plan: RunPlan) -> list[int]:
    """The trainer ranks that hold a bucket copy while it is read: those serving an engine rank, and rank 0, which
    gathers each bucket and broadcasts it to them."""
    return sorted({0, *(r for ranks in plan_sources(plan) for r in ranks or [])})
