"""Engines that span nodes, as SGLang runs one: one server process per node, all started with `--nnodes N
--node-rank k --dist-init-addr <rank 0's node>:<port>`; node rank 0 serves the HTTP API (the router's worker, the
control and weight endpoints), the other ranks join it there and serve nothing. `SpanningEngine` holds the node
ranks of one engine behind the methods the fleet calls on a single engine process, so the fleet and its watch treat
the engine as one: it is dead when any of its ranks is, and a repair stops and restarts every rank."""
from __future__ import annotations

from typing import Sequence

DIST_INIT_HERE = "<dist-init-addr>"  # in an engine's args: replaced by the address of the node rank 0 starts on


def node_rank_args(nodes: int, rank: int, dist_init: str) -> list[str]:
    """SGLang's flags of node rank `rank` of an engine over `nodes` nodes whose rank 0 listens at `dist_init`."""
    return ["--nnodes", str(nodes), "--node-rank", str(rank), "--dist-init-addr", dist_init]


def resolve_dist_init(args: Sequence[str], host: str, port: int) -> list[str]:
    """`args` with DIST_INIT_HERE replaced by `host:port` (rank 0's node address and a port free there)."""
    return [f"{host}:{port}" if a == DIST_INIT_HERE else a for a in args]


def dist_init_of(cmd: Sequence[str]) -> str:
    """The --dist-init-addr a started node rank 0 was given."""
    return cmd[list(cmd).index("--dist-init-addr") + 1]
