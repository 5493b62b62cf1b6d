"""Engines on their bundles: what an engine process is told of its devices, where its host actor sits, and the start
of a fleet beside the policy's (`teacher:`, `judge:`) on the bundles the plan gave it (launch.plan.fleets), with the
devices of those bundles only. The fleets beside are watched with the policy's (glue.fleet.watch.FleetWatch
`beside`)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from glue.fleet.engine_client import EngineClient
from glue.fleet.fleet import RolloutFleet
from launch.config import SluiceConfig
from launch.plan.run_plan import RunPlan
from launch.run.cluster import ClusterError, check_paths
from weight_sync.process_group import PLANNED_DEVICES


def planned_devices_env(plan: RunPlan, bundles: list[int]) -> dict[str, str]:
    """Where the plan models devices (strict engines on CPU bundles that stand for GPUs), the environment that tells
    a trainer rank or an engine the devices of its weight-group members (weight_sync.process_group); {} elsewhere."""
    if not plan.models_devices:
        return {}
    return {PLANNED_DEVICES: ",".join(plan.device_of(b) for b in bundles)}


def engine_env(plan: RunPlan, placement, engine) -> dict[str, str]:
    """An engine's environment: the GPUs of its bundles, or the devices its bundles stand for."""
    return {**placement.engine_env(engine), **planned_devices_env(plan, engine.bundles)}


def engine_host_options(placement, engine, rank: int = 0) -> dict:
    """An engine's host actor (node rank `rank`'s, of an engine that spans nodes) sits on its first bundle and
    reserves nothing: the engine process uses the bundle's devices through CUDA_VISIBLE_DEVICES, and in colocated
    placement the trainer rank holds the bundle's GPU."""
    return placement.actor_options(engine.rank_bundles(rank)[0], num_cpus=0)


def check_whole_nodes(placement, engines, name: str = "") -> None:
    """Every node rank of an engine that spans nodes got bundles of one node, a node of its own (Ray's grant, sorted
    by node address, need not match the plan's node after node where the run leaves GPUs free); else ClusterError
    naming the engine, its rank and the nodes. CPU bundles (a rehearsal) stand for nodes wherever Ray puts them."""
    for e in engines:
        if not e.node_ranks or e.node_ranks[0].devices is None:
            continue
        nodes = [sorted({placement.node_ip[b] for b in r.bundles}) for r in e.node_ranks]
        for r, on in zip(e.node_ranks, nodes):
            if len(on) > 1 or sum(o == on for o in nodes) > 1:
                raise ClusterError(f"{name}engine {e.index} node rank {r.rank}'s bundles {r.bundles[0]}-"
                                   f"{r.bundles[-1]} were granted on {', '.join(on)}, not on a node of their own: an "
                                   "engine that spans nodes needs whole nodes; give the run every GPU of its nodes "
                                   "(cluster.num_nodes x gpus_per_node bundles) or lower cluster.num_nodes")


def node_rank_options(placement, engines, nodes: int) -> dict:
    """RolloutFleet's arguments for engines that span `nodes` nodes: `engine_nodes`, and per engine the host actor
    options and environment (its GPUs) of node ranks 1 and on; rank 0 keeps the engine's own (`engine_env` also
    carries the devices of every bundle where the plan models them: a strict rank 0 stands in for every TP rank)."""
    if nodes == 1:
        return {}
    return {"engine_nodes": nodes,
            "rank_hosts": [[engine_host_options(placement, e, r.rank) for r in e.node_ranks[1:]] for e in engines],
            "rank_env": [[placement.engine_env(e, r.rank) for r in e.node_ranks[1:]] for e in engines]}


@dataclass
class SideFleetRun:
    """A started fleet beside the policy's and the client that reaches it (its retries count in the watch's
    metrics)."""

    fleet: RolloutFleet
    client: EngineClient


def start_side_fleet(cfg: SluiceConfig, plan: RunPlan, placement, name: str, *, model_path: str, run_dir: Path,
                     stack: contextlib.ExitStack, loop, api_key: str, admin_api_key: str | None,
                     startup_timeout_s: float, router_args: Sequence[str], started: list[SideFleetRun],
                     on_phase=None) -> SideFleetRun:
    """Start the fleet of section `name` on its plan bundles (each engine by a host actor on its first bundle, with
    the devices of its own bundles only), behind its own sgl-router; stopped with `stack`, appended to `started`."""
    side = plan.side_fleet(name)
    check_whole_nodes(placement, side.engines, f"{name} ")
    check_paths(placement, {f"the {name} model directory": model_path})  # its engines may sit on any node
    fleet = RolloutFleet(model_path=model_path, num_engines=len(side.engines), router_policy=cfg.rollout.router_policy,
                         engine_startup_timeout_s=startup_timeout_s, log_dir=run_dir / "logs" / name,
                         engine_command=plan.engine_command, engine_args=side.engine_args, router_args=router_args,
                         engine_env=[engine_env(plan, placement, e) for e in side.engines],
                         engine_hosts=[engine_host_options(placement, e) for e in side.engines],
                         **node_rank_options(placement, side.engines, side.nodes),
                         engine_bind="127.0.0.1" if cfg.cluster.num_nodes == 1 else None,  # one node: loopback only
                         api_key=api_key, admin_api_key=admin_api_key, seed=side.seed, name=name)
    stack.callback(fleet.stop)
    fleet.start(on_phase=on_phase)
    client = EngineClient(fleet.router_url, fleet.serving_urls, api_key=api_key, admin_api_key=admin_api_key)
    stack.callback(lambda: loop.run_until_complete(client.close()))
    run = SideFleetRun(fleet=fleet, client=client)
    started.append(run)
    return run
