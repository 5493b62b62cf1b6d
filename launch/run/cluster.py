"""Ray for a run: start a local cluster or attach to one (`ray start` on every node), reserve the plan's single
placement group, and map its bundles to nodes and devices in a stable order (node address, then GPU id), so plan
bundle b is the same node/GPU on every run. Trainer ranks are scheduled into their bundles; each engine is started
on its bundle's node by a host actor (glue.fleet.engine_host) and gets the CUDA_VISIBLE_DEVICES of its bundles.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from launch.config import SluiceConfig
from launch.plan.run_plan import EngineLaunch, RunPlan


class ClusterError(RuntimeError):
    """The cluster cannot run the plan (nodes missing, a path a node cannot see); the message names what and where,
    and the CLI prints it as one line."""


def start_ray(*, address: str | None, num_cpus: int, num_gpus: int | None = None, node_ip: str | None = None,
              stack: contextlib.ExitStack) -> None:
    """Attach to `address` ("auto" or host:port of a `ray start --head` cluster), or start a local cluster with
    `num_cpus` logical CPUs (more than the real ones, so a placement group cannot starve other actors). `node_ip` is
    this node's address in the cluster (the `--node-ip-address` its raylet was started with), for machines where
    Ray's own pick is another network's."""
    import ray

    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user cluster
    # A local cluster's workers inherit this process's PYTHONPATH (the user's folders, launch.run.user_code); an attached
    # cluster's workers were started by `ray start`, so the job hands it to them (the folders must exist there too).
    python_path = os.environ.get("PYTHONPATH")
    runtime_env = {"env_vars": {"PYTHONPATH": python_path}} if address and python_path else None
    # "local": a new cluster even when a `ray start` one runs on this machine (ray.init() alone would join it)
    ray.init(address=address or "local", num_cpus=None if address else num_cpus, num_gpus=None if address else num_gpus,
             include_dashboard=False, log_to_driver=False, configure_logging=False, _node_ip_address=node_ip,
             runtime_env=runtime_env)
    stack.callback(ray.shutdown)


def wait_for_nodes(num_nodes: int, wait_s: float, *, poll_s: float = 5.0, say=None) -> list[str]:
    """Wait until `num_nodes` nodes are alive in the attached cluster, saying `k/n nodes joined: <addresses>` every
    `poll_s`; returns their addresses, or raises ClusterError naming the ones that joined after `wait_s`."""
    import time

    import ray

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    deadline = time.monotonic() + wait_s
    while True:
        joined = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        if len(joined) >= num_nodes:
            return joined
        if time.monotonic() >= deadline:
            raise ClusterError(f"only {len(joined)}/{num_nodes} nodes joined the Ray cluster within "
                               f"cluster.node_wait_s={wait_s:g} s (joined: {', '.join(joined) or 'none'}); start "
                               "the others with `ROLE=worker HEAD_IP=<head address> launch/scripts/multi_node.sh`, "
                               "or lower cluster.num_nodes")
        say(f"sluice: {len(joined)}/{num_nodes} nodes joined: {', '.join(joined)}; waiting up to "
            f"{max(0.0, deadline - time.monotonic()):.0f} s more")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


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

    def engine_env(self, engine: EngineLaunch, rank: int = 0) -> dict[str, str]:
        """Environment of an engine process (node rank `rank`'s of an engine that spans nodes): the GPUs of its
        bundles (nothing on CPU)."""
        ids = [self.gpu_id[b] for b in engine.rank_bundles(rank)]
        return {} if None in ids else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


def reserve(plan: RunPlan, stack: contextlib.ExitStack, timeout_s: float = 120) -> Placement:
    """Create the plan's placement group, wait until Ray grants it, and sort its bundles by (node, GPU)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    # One node: all on it. GPU nodes: fill node after node. CPU bundles on several nodes: spread, so every node
    # gets some (a CPU cluster's nodes are interchangeable; this is how the multi-node path runs without GPUs).
    strategy = "STRICT_PACK" if plan.num_nodes == 1 else "PACK" if plan.device == "gpu" else "SPREAD"
    group = placement_group(plan.bundles, strategy=strategy, name=f"sluice-{os.getpid()}")
    stack.callback(remove_placement_group, group)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        raise TimeoutError(f"Ray did not grant the placement group ({len(plan.bundles)} bundles of "
                           f"{plan.bundles[0]}) within {timeout_s:g} s; cluster resources: "
                           f"{ray.available_resources()}; check cluster.num_nodes / gpus_per_node against the nodes "
                           "that joined (`ray status`)")
    here = ray.util.get_node_ip_address()  # the driver's node sorts first: the router's engines are near it
    if plan.num_nodes == 1 and plan.device == "cpu":  # STRICT_PACK on one node, no GPU ids: nothing to ask
        found = [(here, None)] * len(plan.bundles)  # (a probe task per bundle costs a worker process start each)
    else:
        probe = ray.remote(_probe_fn)
        found = ray.get([probe.options(**_probe_options(group, b, plan)).remote() for b in range(len(plan.bundles))])
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



def check_paths(placement: Placement, paths: dict[str, str]) -> None:
    """Every node of the placement must see each of `paths` (what -> absolute path) at that path: engines and trainer
    ranks load the model there. Raises ClusterError naming the node, the path and what needs it."""
    import ray

    look = ray.remote(_missing_paths)
    nodes = sorted(set(placement.node_ip))
    first_bundle = {ip: placement.node_ip.index(ip) for ip in nodes}
    found = ray.get([look.options(**placement.actor_options(first_bundle[ip], num_cpus=0)).remote(paths)
                     for ip in nodes])
    for ip, missing in zip(nodes, found):
        if missing:
            what, path = missing[0]
            raise ClusterError(f"node {ip} cannot see {what} {path} (engines and trainer ranks placed there load it "
                               "from that path): put it on a file system every node mounts at the same path, or "
                               "copy it there")


def _missing_paths(paths: dict[str, str]) -> list[tuple[str, str]]:
    return [(what, path) for what, path in paths.items() if not os.path.exists(path)]


def start_cluster(cfg: SluiceConfig, plan: RunPlan, stack: contextlib.ExitStack):
    """Start or attach to Ray and reserve the plan's placement group (a launch.run.cluster.Placement)."""
    start_ray(address=cfg.run.ray_address, num_cpus=cfg.run.ray_num_cpus, node_ip=cfg.cluster.node_ip,
                      stack=stack)
    if cfg.run.ray_address is not None and cfg.cluster.num_nodes > 1:
        nodes = wait_for_nodes(cfg.cluster.num_nodes, cfg.cluster.node_wait_s)
        print(f"sluice: {len(nodes)}/{cfg.cluster.num_nodes} nodes joined: {', '.join(nodes)}", flush=True)
    return reserve(plan, stack)


def describe_placement(plan: RunPlan, placement) -> str:
    """Which engines and trainer ranks landed on which node, e.g. `10.0.0.1: engine 0, engine 1; 10.0.0.2: trainer
    rank 0, teacher engine 0`."""
    by_node: dict[str, list[str]] = {}
    for e in plan.engines:
        by_node.setdefault(placement.node_ip[e.bundles[0]], []).append(f"engine {e.index}")
        for r in e.node_ranks[1:]:
            by_node.setdefault(placement.node_ip[r.bundles[0]], []).append(f"engine {e.index} node rank {r.rank}")
    for r in plan.trainer:
        by_node.setdefault(placement.node_ip[r.bundle], []).append(f"trainer rank {r.rank}")
    for fleet in plan.side_fleets:
        for e in fleet.engines:
            by_node.setdefault(placement.node_ip[e.bundles[0]], []).append(f"{fleet.name} engine {e.index}")
            for r in e.node_ranks[1:]:
                by_node.setdefault(placement.node_ip[r.bundles[0]], []).append(
                    f"{fleet.name} engine {e.index} node rank {r.rank}")
    return "; ".join(f"{ip}: {', '.join(items)}" for ip, items in by_node.items())
