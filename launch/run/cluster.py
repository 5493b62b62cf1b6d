"""Ray for a run: start a local cluster or attach to one (`ray start` on every node), reserve the plan's single
placement group, and map its bundles to nodes and devices in a stable order (node address, then GPU id), so plan
bundle b is the same node/GPU on every run. Trainer ranks are scheduled into their bundles; each engine is started
on its bundle's node by a host actor (glue.fleet.engine_host) and gets the CUDA_VISIBLE_DEVICES of its bundles.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from launch.config import SluiceConfig
from launch.plan.run_plan import EngineLaunch, RunPlan

GCS_CONNECT_TIMEOUT_S = 10.0  # a head that does not accept a TCP connection within this is taken as not there
PLACEMENT_REPORT_S = 60.0  # a placement group still waiting says so this often
STRATEGY_MEANS = {"STRICT_PACK": "all on one node", "PACK": "filling node after node", "SPREAD": "over the nodes"}


class ClusterError(RuntimeError):
    """The cluster cannot run the plan (nodes missing, a path a node cannot see); the message names what and where,
    and the CLI prints it as one line."""


def start_ray(*, address: str | None, num_cpus: int, num_gpus: int | None = None, node_ip: str | None = None,
              stack: contextlib.ExitStack, source: str = "run.ray_address") -> str:
    """Attach to `address` ("auto" or host:port of a `ray start --head` cluster; `source` names the setting it came
    from), or start a private local cluster with `num_cpus` logical CPUs (more than the real ones, so a placement
    group cannot starve other actors). `node_ip` is this node's address in the cluster (the `--node-ip-address` its
    raylet was started with), for machines where Ray's own pick is another network's. Returns what it did, e.g.
    `attached to the Ray cluster at 10.0.0.1:6379 (RAY_ADDRESS=10.0.0.1:6379)`."""
    import ray

    # Ray replaces builtins.print in the driver (ray.experimental.tqdm_ray) the first time it prints a message a
    # worker or raylet pushed to it, e.g. when an actor dies; sluice's own lines stay plain prints
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, single-user cluster
        # "local": a new cluster even when a `ray start` one runs on this machine (ray.init() alone would join it)
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, _node_ip_address=node_ip)
        stack.callback(ray.shutdown)
        return f"started a private local Ray ({num_cpus} CPUs; run.ray_address and RAY_ADDRESS are unset)"
    gcs = reachable_gcs(address, source)
    # Something answers there; Ray asks it for its cluster id for ~35 s a try, 20 tries by default: one try (unless
    # the operator set RAY_gcs_server_port_wait_time_s), so a port that is not a Ray head fails within a minute.
    with _env_default("RAY_gcs_server_port_wait_time_s", "1"):
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     _node_ip_address=node_ip, runtime_env=job_runtime_env())
        except ConnectionError:  # Ray's "Failed to connect to Ray cluster at ...", after its one try
            raise ClusterError(f"{gcs} ({source}={address}) accepts connections but no Ray head answers there: "
                               "give the head's GCS port (`ray start --head --port`, 6379 by default)") from None
    stack.callback(ray.shutdown)
    return f"attached to the Ray cluster at {gcs} ({source}={address})"


@contextlib.contextmanager
def _env_default(name: str, value: str):
    """`name` is `value` inside the block unless it was set already; as it was afterwards."""
    was = os.environ.get(name)
    os.environ.setdefault(name, value)
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(name, None)


def job_runtime_env() -> dict[str, Any] | None:
    """An attached cluster's workers were started by `ray start`, not by this process: they get its PYTHONPATH (the
    user's folders, launch.run.user_code; the folders must exist on every node too) through the job's runtime env.
    Inside a `ray job submit` job whose runtime env sets PYTHONPATH already, that one stands (Ray refuses two)."""
    python_path = os.environ.get("PYTHONPATH")
    job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    submitted = (job_config.get("runtime_env") or {}).get("env_vars") or {}
    if not python_path or "PYTHONPATH" in submitted:
        return None
    return {"env_vars": {"PYTHONPATH": python_path}}


def reachable_gcs(address: str, source: str, timeout_s: float = GCS_CONNECT_TIMEOUT_S) -> str:
    """The host:port of the Ray head (GCS) `address` names, once a TCP connection to it succeeded within
    `timeout_s`; ClusterError naming the address otherwise. Ray itself retries a wrong address for ten minutes and
    more, saying only `Failed to get cluster ID from GCS server`."""
    from ray._private.services import canonicalize_bootstrap_address

    if address.startswith(("http://", "https://")):
        raise ClusterError(f"{source}={address} is a Ray dashboard address (what `ray job submit` talks to); sluice "
                           "attaches to the head's GCS port: give host:port of `ray start --head --port` (6379 by "
                           "default), or auto on a node of the cluster")
    try:
        gcs = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as err:  # "auto" with no cluster on this machine; not host:port
        raise ClusterError(f"{source}={address}: {str(err).splitlines()[0]}") from None
    host, _, port = gcs.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ClusterError(f"no Ray cluster answers at {gcs} ({source}={address}): {err.strerror or err}; check the "
                           "address and port (`ray start --head --port`, 6379 by default) and that the head is up "
                           "(`ray status --address ...` on a node of the cluster)") from None
    return gcs


def wait_for_nodes(num_nodes: int, wait_s: float, *, poll_s: float = 5.0, say=None) -> list[str]:
    """Wait until `num_nodes` nodes are alive in the attached cluster, saying `k/n nodes joined: <addresses>` every
    `poll_s`; returns their addresses, or raises ClusterError naming the ones that joined after `wait_s`."""
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


def reserve(plan: RunPlan, stack: contextlib.ExitStack, timeout_s: float = 120, say=None) -> Placement:
    """Create the plan's placement group, wait until Ray grants it (`timeout_s`, 0: until it fits; see
    `wait_for_placement`), and sort its bundles by (node, GPU)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    # One node: all on it. GPU nodes: fill node after node. CPU bundles on several nodes: spread, so every node
    # gets some (a CPU cluster's nodes are interchangeable; this is how the multi-node path runs without GPUs).
    strategy = "STRICT_PACK" if plan.num_nodes == 1 else "PACK" if plan.device == "gpu" else "SPREAD"
    group = placement_group(plan.bundles, strategy=strategy, name=f"sluice-{os.getpid()}")
    stack.callback(remove_placement_group, group)
    wait_for_placement(group, plan.bundles, strategy, timeout_s, say=say)
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


def wait_for_placement(group: Any, bundles: list[dict[str, float]], strategy: str, timeout_s: float, *,
                       say=None, report_s: float = PLACEMENT_REPORT_S) -> None:
    """Wait until Ray grants `group`, saying every `report_s` what it waits for and what is free; after `timeout_s`
    (0: never) raise ClusterError with the group's needs and the cluster's free resources."""
    import ray

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    started = time.monotonic()
    ready = group.ready()
    while True:
        left = timeout_s - (time.monotonic() - started) if timeout_s else report_s
        step = min(report_s, max(0.0, left))
        if ray.wait([ready], timeout=step)[0]:
            return
        waited = time.monotonic() - started
        needs = f"{group_needs(bundles)} in {len(bundles)} bundles ({strategy}: {STRATEGY_MEANS[strategy]})"
        if step < report_s or (timeout_s and waited >= timeout_s):  # this wait ran to the deadline
            raise ClusterError(f"the cluster did not grant the placement group within cluster.placement_timeout_s="
                               f"{timeout_s:g} s: it needs {needs}; free now: {free_resources()}; free some, add "
                               "nodes (check cluster.num_nodes / gpus_per_node against `ray status`), or set "
                               "cluster.placement_timeout_s=0 to wait until it fits")
        until = "until it fits (cluster.placement_timeout_s=0)" if not timeout_s else \
            f"up to {timeout_s - waited:.0f} s more (cluster.placement_timeout_s={timeout_s:g})"
        say(f"sluice: waited {waited:.0f} s for the placement group: it needs {needs}; free now: "
            f"{free_resources()}; waiting {until}")


def group_needs(bundles: list[dict[str, float]]) -> str:
    """E.g. `4 CPU, 2 GPU`: what the bundles ask for together."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for kind, amount in bundle.items():
            total[kind] = total.get(kind, 0) + amount
    return ", ".join(f"{amount:g} {kind}" for kind, amount in total.items())


def free_resources() -> str:
    """The cluster's free CPUs, GPUs and custom resources (not memory, nodes' own or placement groups' shares),
    e.g. `1 CPU, 0 GPU`, from ray.available_resources()."""
    import ray

    free = ray.available_resources()
    shown = {kind: amount for kind, amount in free.items()
             if kind not in ("memory", "object_store_memory") and not kind.startswith("node:") and "_group_" not in kind}
    shown.setdefault("CPU", 0)
    shown.setdefault("GPU", 0)
    return ", ".join(f"{amount:g} {kind}" for kind, amount in sorted(shown.items()))


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


def start_cluster(cfg: SluiceConfig, plan: RunPlan, stack: contextlib.ExitStack, clock=lambda phase, detail: None):
    """Start or attach to Ray, saying which on the `ray` start-up line with the run folder's absolute path (under `ray
    job submit` a relative run.output_dir is inside the job's working directory), and reserve the plan's placement
    group (a launch.run.cluster.Placement)."""
    address = cfg.run.cluster_address
    how = start_ray(address=address, num_cpus=cfg.run.ray_num_cpus, node_ip=cfg.cluster.node_ip, stack=stack,
                    source=cfg.run.cluster_address_source)
    clock("ray", f"{how}; run folder {cfg.run_dir.resolve()}")
    if address is not None and cfg.cluster.num_nodes > 1:
        nodes = wait_for_nodes(cfg.cluster.num_nodes, cfg.cluster.node_wait_s)
        print(f"sluice: {len(nodes)}/{cfg.cluster.num_nodes} nodes joined: {', '.join(nodes)}", flush=True)
    return reserve(plan, stack, cfg.cluster.placement_timeout_s)


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
