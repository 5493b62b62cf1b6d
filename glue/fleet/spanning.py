"""Engines that span nodes, as SGLang runs one: one server process per node, all started with `--nnodes N
--node-rank k --dist-init-addr <rank 0's node>:<port>`; node rank 0 serves the HTTP API (the router's worker, the
control and weight endpoints), the other ranks join it there and serve nothing. `SpanningEngine` holds the node
ranks of one engine behind the methods the fleet calls on a single engine process, so the fleet and its watch treat
the engine as one: it is dead when any of its ranks is, and a repair stops and restarts every rank."""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from glue.fleet.processes import free_port_block

DIST_INIT_HERE = "<dist-init-addr>"  # in an engine's args: replaced by the address of the node rank 0 starts on
DIST_INIT_PORTS = 8  # free ports from --dist-init-addr's on: SGLang's rank 0 derives its ZMQ and NCCL ports from it


def node_rank_args(nodes: int, rank: int, dist_init: str) -> list[str]:
    """SGLang's flags of node rank `rank` of an engine over `nodes` nodes whose rank 0 listens at `dist_init`."""
    return ["--nnodes", str(nodes), "--node-rank", str(rank), "--dist-init-addr", dist_init]


def resolve_dist_init(args: Sequence[str], host: str) -> list[str]:
    """`args` with DIST_INIT_HERE replaced by `host:port`: rank 0's node address and the first of DIST_INIT_PORTS
    ports free there (unchanged when it holds none)."""
    if DIST_INIT_HERE not in args:
        return list(args)
    port = free_port_block(DIST_INIT_PORTS, host)
    return [f"{host}:{port}" if a == DIST_INIT_HERE else a for a in args]


def dist_init_of(cmd: Sequence[str]) -> str:
    """The --dist-init-addr a started node rank 0 was given."""
    return cmd[list(cmd).index("--dist-init-addr") + 1]


class SpanningEngine:
    """The node ranks of one engine (rank 0 first), each a ManagedProcess or glue.fleet.engine_host.RemoteEngine.
    `url`, `pid`, `cmd`, `name` and `log_path` are rank 0's (the engine the router and the weight bridge talk to);
    `exited()` lists the ranks that are gone, so the fleet's line about a dead engine names each of them."""

    def __init__(self, ranks: list[Any]):
        assert len(ranks) > 1, f"an engine that spans nodes has a process per node; got {len(ranks)}"
        self.ranks = ranks
        first = ranks[0]
        self.url, self.pid, self.cmd = first.url, first.pid, first.cmd
        self.name, self.log_path = first.name, first.log_path

    @property
    def pids(self) -> list[int]:
        return [p for r in self.ranks for p in r.pids]

    def exited(self) -> list[Any]:
        """The node ranks that are no longer running."""
        return [r for r in self.ranks if r.exit_code() is not None]

    def exit_code(self) -> int | None:
        """The exit code of the lowest node rank that exited; None while every rank runs."""
        gone = self.exited()
        return gone[0].exit_code() if gone else None

    def check_alive(self) -> None:
        for rank in self.ranks:
            rank.check_alive()

    def log_tail(self, lines: int = 30) -> str:
        return (self.exited() or self.ranks)[0].log_tail(lines)

    def terminate(self) -> None:
        for rank in self.ranks:
            rank.terminate()

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for rank in self.ranks:
            rank.wait(max(0.0, deadline - time.monotonic()))

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()


def start_spanning(start_rank: Callable[[int, list[str]], Any], nodes: int) -> SpanningEngine:
    """Start the `nodes` node ranks of one engine: rank 0 first, `start_rank(0, flags)` with DIST_INIT_HERE for its
    address (the starter resolves it where rank 0 runs), then the others with the address rank 0 got. If a rank
    cannot be started, the ranks already started are stopped before the error rises."""
    ranks = [start_rank(0, node_rank_args(nodes, 0, DIST_INIT_HERE))]
    try:
        dist_init = dist_init_of(ranks[0].cmd)
        for k in range(1, nodes):
            ranks.append(start_rank(k, node_rank_args(nodes, k, dist_init)))
    except BaseException:
        for rank in ranks:
            rank.kill()
        raise
    return SpanningEngine(ranks)
