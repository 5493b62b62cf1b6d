"""Engines that span nodes, planned: how many nodes each policy engine takes (an SGLang engine's --tp-size, which
holds its DP-attention and EP ranks too, over cluster.gpus_per_node, on whole nodes; cluster.engine_nodes on CPU,
where strict engines rehearse it) and each engine's node ranks on its bundles, with the command line each server
process gets (glue.fleet.spanning's SGLang flags). Pure: `launch.plan.run_plan` plans with it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glue.fleet.spanning import node_rank_args

DIST_INIT = "RANK0_HOST:DIST_PORT"  # placeholder: node rank 0's node address and a port free there, at start-up


@dataclass
class NodeRank:
    """One server process of an engine that spans nodes: its --node-rank, the node and bundles it runs on, the GPUs
    of those bundles (None on CPU) and its command line (with HOST / PORT / DIST_INIT placeholders)."""

    rank: int
    node: int | None
    bundles: list[int]
    devices: list[int] | None
    command: list[str]


def engine_nodes(cluster: Any) -> int:
    """Nodes each policy engine spans (a launch.config.ClusterConfig): 1 while its TP fits a node; on GPUs
    engine_tensor_parallel_size / gpus_per_node beyond that (whole nodes only); on CPU cluster.engine_nodes, which
    strict engines alone rehearse. ValueError naming the figures and the fix."""
    c, tp = cluster, cluster.engine_tensor_parallel_size
    if c.uses_gpus:
        nodes = gpu_nodes(tp, c.gpus_per_node, "cluster.engine_tensor_parallel_size")
        if c.engine_nodes is not None and c.engine_nodes != nodes:
            raise ValueError(f"cluster.engine_nodes={c.engine_nodes} but an engine of engine_tensor_parallel_size="
                             f"{tp} on {c.gpus_per_node}-GPU nodes spans {nodes}; leave cluster.engine_nodes null on "
                             "GPUs (it follows from them)")
        return nodes
    nodes = c.engine_nodes or 1
    if nodes > 1 and c.engine != "sglang_strict":
        raise ValueError(f"cluster.engine_nodes={nodes} on CPU: only strict engines rehearse an engine that spans "
                         "nodes (a CPU process per node rank); set cluster.engine=sglang_strict, or "
                         "cluster.engine_nodes=1")
    if tp % nodes:
        raise ValueError(f"cluster.engine_tensor_parallel_size={tp} is not a multiple of cluster.engine_nodes="
                         f"{nodes}: every node rank of an engine holds the same number of its TP ranks")
    return nodes


def gpu_nodes(tp: int, per_node: int, key: str) -> int:
    """Nodes an engine of TP `tp` (config key `key`) spans on `per_node`-GPU nodes: 1 for a divisor of per_node,
    tp / per_node for a multiple; ValueError naming the sizes that fit otherwise."""
    if tp <= per_node and per_node % tp:
        raise ValueError(f"{key}={tp} does not divide cluster.gpus_per_node={per_node}: an engine would span two "
                         f"nodes; make it a divisor of {per_node}, or a multiple (an engine on whole nodes)")
    if tp > per_node and tp % per_node:
        raise ValueError(f"{key}={tp} takes more GPUs than one node's cluster.gpus_per_node={per_node} but is not a "
                         f"multiple of it: an engine that spans nodes takes whole nodes (one SGLang server per node); "
                         f"make it {tp // per_node * per_node} or {(tp // per_node + 1) * per_node}")
    return max(1, tp // per_node)


def plan_node_ranks(bundles: list[int], command: list[str], nodes: int,
                    slots: list[tuple[int | None, int | None]], uses_gpus: bool) -> list[NodeRank]:
    """The node ranks of an engine on `bundles` (consecutive, whole nodes on GPUs: rank k takes the k-th
    len(bundles) / nodes of them), each with `command` and its SGLang flags; [] for an engine on one node."""
    if nodes == 1:
        return []
    per_node = len(bundles) // nodes
    ranks = []
    for k in range(nodes):
        mine = bundles[k * per_node:(k + 1) * per_node]
        on = {slots[b][0] for b in mine}
        assert not uses_gpus or len(on) == 1, f"node rank {k}'s bundles {mine} are on nodes {sorted(on)}"
        ranks.append(NodeRank(rank=k, node=slots[mine[0]][0], bundles=mine,
                              devices=[slots[b][1] for b in mine] if uses_gpus else None,
                              command=[*command, *node_rank_args(nodes, k, DIST_INIT)]))
    return ranks


def node_rank_lines(ranks: list[NodeRank], where) -> list[str]:
    """`--dry-run`'s lines of an engine's node ranks; `where(bundles)` names their devices."""
    roles = {0: "serves HTTP: the router's worker, control and weight endpoints"}
    joins = "joins node rank 0 at --dist-init-addr, serves no HTTP"
    if ranks[0].devices is None:  # strict engines on CPU
        joins += (" (strict engine: a process node rank 0 waits for at start and stops serving without; rank 0's "
                  "process stands in for its TP ranks on the weight path)")
    return [f"node rank {r.rank} on {where(r.bundles)}: {roles.get(r.rank, joins)}" for r in ranks]
