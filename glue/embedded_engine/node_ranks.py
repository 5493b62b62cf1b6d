"""The strict engine standing in for an SGLang engine that spans nodes (`--nnodes N --node-rank k --dist-init-addr
host:port`). Node rank 0 listens at --dist-init-addr and serves only once every other node rank's process has joined
it there, as SGLang's rank 0 serves once the TP ranks of every node have joined its process group; when one of them
goes, rank 0 stops, as SGLang's scheduler does when a collective loses a peer. A node rank > 0 loads no model and
serves no HTTP: it joins rank 0 and lives until rank 0 goes, as SGLang's follower nodes do. (The TP ranks such a
node stands for are simulated on the weight path by rank 0's process: glue.embedded_engine.weight_update.)"""
from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time

JOIN_TIMEOUT_S = 600.0  # how long node ranks wait for each other at start (SGLang's dist init waits as long)


def _address(dist_init: str) -> tuple[str, int]:
    host, _, port = dist_init.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr {dist_init!r} must be host:port (node rank 0's address and a free port)")
    return host, int(port)


def gather_node_ranks(dist_init: str, nnodes: int, timeout_s: float = JOIN_TIMEOUT_S) -> dict[int, socket.socket]:
    """Node rank 0: listen at `dist_init` until node ranks 1..nnodes-1 have each joined; their connections by rank.
    TimeoutError naming the ranks missing after `timeout_s`."""
    server = socket.create_server(_address(dist_init))
    joined: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    with server:
        while len(joined) < nnodes - 1:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except socket.timeout:
                missing = sorted(set(range(1, nnodes)) - set(joined))
                raise TimeoutError(f"node ranks {missing} did not join at --dist-init-addr {dist_init} within "
                                   f"{timeout_s:g} s; start them with the same command and their --node-rank") from None
            conn.settimeout(30)
            words = conn.makefile("r").readline().split()
            rank = int(words[1]) if len(words) == 2 and words[0] == "node_rank" and words[1].isdigit() else -1
            if not 0 < rank < nnodes or rank in joined:
                conn.close()  # not a node rank of this engine, or a second one of a rank
                continue
            conn.sendall(b"joined\n")
            conn.settimeout(None)
            joined[rank] = conn
    return joined


def stop_when_a_rank_leaves(joined: dict[int, socket.socket]) -> threading.Thread:
    """Node rank 0: a daemon thread that ends this process (exit code 1, with a line saying which rank left) once
    a node rank's connection closes."""
    def watch() -> None:
        ranks = {conn: rank for rank, conn in joined.items()}
        while True:
            ready, _, _ = select.select(list(ranks), [], [])
            for conn in ready:
                if not conn.recv(1):
                    print(f"embedded engine: node rank {ranks[conn]} left (its connection at --dist-init-addr "
                          "closed): an engine that spans nodes cannot serve without every node rank; exiting",
                          file=sys.stderr, flush=True)
                    os._exit(1)  # as SGLang's server goes when its scheduler dies: no graceful drain

    thread = threading.Thread(target=watch, daemon=True, name="node ranks")
    thread.start()
    return thread


def follow(dist_init: str, node_rank: int, timeout_s: float = JOIN_TIMEOUT_S) -> int:
    """Node rank > 0: join rank 0 at `dist_init` (retrying until it listens, up to `timeout_s`), then wait until it
    goes; returns the exit code (1: rank 0 went, so this rank has nothing left to serve)."""
    address, deadline = _address(dist_init), time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection(address, timeout=5)
            break
        except OSError as err:
            if time.monotonic() > deadline:
                print(f"embedded engine: node rank {node_rank} could not reach node rank 0 at --dist-init-addr "
                      f"{dist_init} within {timeout_s:g} s ({err})", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
    with conn:
        conn.sendall(f"node_rank {node_rank}\n".encode())
        if conn.makefile("r").readline().strip() != "joined":
            print(f"embedded engine: node rank 0 at {dist_init} refused node rank {node_rank}", file=sys.stderr,
                  flush=True)
            return 1
        print(f"embedded engine: node rank {node_rank} joined node rank 0 at {dist_init}; serving no HTTP",
              flush=True)
        conn.settimeout(None)
        while conn.recv(1 << 10):
            pass
    print(f"embedded engine: node rank 0 at {dist_init} is gone; node rank {node_rank} exits", file=sys.stderr,
          flush=True)
    return 1
