"""Ray for a run: start a local cluster or attach to one (`ray start` on every node), reserve the plan's single
placement group, and map its bundles to nodes and devices in a stable order (node address, then GPU id), so plan
bundle b is the same node/GPU on every run. Trainer ranks are scheduled into their bundles; each engine is started
on its bundle's node by a host actor (glue.engine_host) and gets the CUDA_VISIBLE_DEVICES of its bundles.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from launch.plan import EngineLaunch, RunPlan


def start_ray(*, address: str | None, num_cpus: int, num_gpus: int | None = None,
              stack: contextlib.ExitStack) -> None:
    """Attach to `address` ("auto" or host:port of a `ray start --head` cluster), or start a local cluster with
    `num_cpus` logical CPUs (more than the real ones, so a placement group cannot starve other actors)."""
    import ray

    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user cluster
    ray.init(address=address, num_cpus=None if address else num_cpus, num_gpus=None if address else num_gpus,
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    stack.callback(ray.shutdown)


@dataclass
class Placement:
    """A ready placement group and, for each plan bundle, its Ray bundle index, node address and GPU id."""

    group: Any
    ray_bundle: list[int]  # plan bundle -> placement-group bundle index
    node_ip: list[str]
    gpu_id: list[int | None]

    def actor_options(self, bundle: int, *, num_cpus: float, num_gpus: float = 0) -> dict[str, Any]:
        """Ray `.options(...)` that pin an actor to plan bundle `bundle`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": num_cpus, "num_gpus": num_gpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self.ray_bundle[bundle])}

    def engine_env(self, engine: EngineLaunch) -> dict[str, str]:
        """Environment of an engine process: the GPUs of its bundles (nothing on CPU)."""
        ids = [self.gpu_id[b] for b in engine.bundles]
        return {} if None in ids else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


def reserve(plan: RunPlan, stack: contextlib.ExitStack, timeout_s: float = 120) -> Placement:
    """Create the plan's placement group, wait until Ray grants it, and sort its bundles by (node, GPU)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    strategy = "STRICT_PACK" if plan.num_nodes == 1 else "PACK"
    group = placement_group(plan.bundles, strategy=strategy, name=f"sluice-{os.getpid()}")
    stack.callback(remove_placement_group, group)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        raise TimeoutError(f"Ray did not grant the placement group ({len(plan.bundles)} bundles of "
                           f"{plan.bundles[0]}) within {timeout_s:g} s; cluster resources: "
                           f"{ray.available_resources()}; check cluster.num_nodes / gpus_per_node against the nodes "
                           "that joined (`ray status`)")
    probe = ray.remote(_probe_fn)
    found = ray.get([probe.options(**_probe_options(group, b, plan)).remote() for b in range(len(plan.bundles))])
    here = ray.util.get_node_ip_address()  # the driver's node sorts first: the router's engines are near it
    order = sorted(range(len(found)), key=lambda b: (found[b][0] != here, found[b][0],
                                                     found[b][1] if found[b][1] is not None else b, b))
    return Placement(group=group, ray_bundle=order, node_ip=[found[b][0] for b in order],
                     gpu_id=[found[b][1] for b in order])


def _probe_options(group: Any, bundle: int, plan: RunPlan) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": 0, "num_gpus": 1 if plan.device == "gpu" else 0, "scheduling_strategy":
            PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)}


def _probe_fn() -> tuple[str, int | None]:
    """Where this bundle is: the node's address and the GPU Ray gave it (None for a CPU bundle)."""
    import ray

    gpus = ray.get_gpu_ids()
    return ray.util.get_node_ip_address(), int(gpus[0]) if gpus else None

