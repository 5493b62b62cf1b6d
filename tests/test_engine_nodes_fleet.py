"""Engines that span nodes, started for real on loopback (issue 48 item 4): strict engines stand in for SGLang's one
server per node. Node rank 0 serves only once node rank 1's process has joined it at --dist-init-addr, the router
gets rank 0's url alone, when rank 1 dies the fleet reports the engine dead as one and the watch restarts both of its
processes, and a weight sync reaches every TP rank of the engine."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import free_port, is_alive
from glue.fleet.fleet import RolloutFleet
from glue.fleet.watch import FleetWatch
from glue.loop.config import SyncConfig
from helpers.engines import call
from helpers.weights import hf_model, max_logprob_diff, source_of
from weight_sync.bridge import make_bridge

STRICT = ["--sglang-strict", "--tp-size", "2", "--num-threads", "1"]


def generate(url: str) -> dict:
    body = json.dumps({"input_ids": [0, 4, 5], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}).encode()
    request = urllib.request.Request(f"{url}/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status
    except OSError:
        return 0


def test_node_rank_0_gets_a_dist_init_address_whose_next_ports_sglang_derives_are_free_too():
    import socket

    from glue.fleet.spanning import DIST_INIT_HERE, DIST_INIT_PORTS, resolve_dist_init

    args = resolve_dist_init(["--nnodes", "2", "--dist-init-addr", DIST_INIT_HERE], "127.0.0.1")
    host, port = args[-1].rsplit(":", 1)
    socks = [socket.socket() for _ in range(DIST_INIT_PORTS)]
    try:
        for k, sock in enumerate(socks):  # rank 0 binds the port and derives the next ones from it
            sock.bind((host, int(port) + k))
    finally:
        for sock in socks:
            sock.close()
    assert resolve_dist_init(["--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000"], "127.0.0.1")[-1] == "10.0.0.1:5000"


@pytest.mark.slow
def test_node_rank_0_serves_only_once_rank_1_joined_and_rank_1_exits_when_rank_0_goes(tiny_model_dir, tmp_path):
    port, dist = free_port(), f"127.0.0.1:{free_port()}"
    engine = [sys.executable, "-m", "glue.embedded_engine", "--model-path", tiny_model_dir, "--host", "127.0.0.1",
              *STRICT, "--nnodes", "2", "--dist-init-addr", dist]
    rank0 = subprocess.Popen([*engine, "--port", str(port), "--node-rank", "0"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    rank1 = None
    try:
        time.sleep(4)  # long enough for rank 0 alone to load its model and serve, were it not waiting
        assert rank0.poll() is None and health(f"http://127.0.0.1:{port}") == 0
        rank1 = subprocess.Popen([*engine, "--port", str(free_port()), "--node-rank", "1"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while health(f"http://127.0.0.1:{port}") != 200:
            assert time.monotonic() < deadline and rank0.poll() is None
            time.sleep(0.2)
        assert len(generate(f"http://127.0.0.1:{port}")["output_ids"]) == 3
        info = call(f"http://127.0.0.1:{port}", "/get_server_info", method="GET")[1]
        assert (info["nnodes"], info["node_rank"], info["dist_init_addr"], info["tp_size"]) == (2, 0, dist, 2)
        rank0.kill()
        assert rank1.wait(timeout=30) == 1  # a node rank without its rank 0 has nothing to serve
        assert f"node rank 0 at {dist} is gone" in rank1.stdout.read()
    finally:
        for proc in (rank0, rank1):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_a_two_node_engine_behind_the_router_is_reported_and_restarted_as_one_when_its_rank_1_dies(tiny_model_dir,
                                                                                                  tmp_path,
                                                                                                  tmp_path_factory):
    with RolloutFleet(model_path=tiny_model_dir, num_engines=2, engine_args=STRICT, engine_nodes=2,
                      log_dir=tmp_path / "logs") as fleet:
        assert fleet.registered_workers() == {url: True for url in fleet.engine_urls}  # node ranks 0 alone
        assert len(fleet.pids) == 2 * 2 + 1 and all(map(is_alive, fleet.pids))
        assert len(generate(fleet.router_url)["output_ids"]) == 3
        rank0, rank1 = fleet.node_pids(1)
        old_url = fleet.engine_urls[1]
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while fleet.dead_engines() != [1]:  # engine 1 is dead as one; engine 0 serves on
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert f"engine 1 node rank 1 (127.0.0.1) exited with code -9; its log: {tmp_path}/logs/engine_1_node_1.log" \
            in fleet.engine_exit(1)
        watch = FleetWatch(fleet, repair=lambda index: fleet.replace_engine(index), poll_s=0.2)

        async def scenario() -> None:
            async def until_repaired() -> None:
                while fleet.restarts < 1 or fleet.engine_urls[1] not in fleet.serving_urls:
                    await asyncio.sleep(0.1)

            await asyncio.wait_for(watch.run(asyncio.ensure_future(until_repaired())), timeout=120)

        asyncio.run(scenario())
        assert watch.restarts == fleet.restarts == 1
        new0, new1 = fleet.node_pids(1)
        assert {new0, new1}.isdisjoint({rank0, rank1}) and is_alive(new0) and is_alive(new1)
        assert not is_alive(rank0)  # the whole engine was restarted, not its dead rank alone
        assert fleet.engine_urls[1] != old_url and fleet.registered_workers() == {u: True for u in fleet.engine_urls}
        assert [len(generate(fleet.router_url)["output_ids"]) for _ in range(4)] == [3] * 4
        assert fleet.dead_engines() == []
        # a sync reaches every TP rank of both engines, the restarted one included: 1 + 2 x 2 members
        model, _ = hf_model(tmp_path_factory, seed=5)
        bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=40_000), source=source_of(model),
                             engine_urls=fleet.engine_urls, engine_tp_size=2)
        try:
            bridge.sync(7)
        finally:
            bridge.close()
        for url in fleet.engine_urls:
            assert call(url, "/model_info", method="GET")[1]["weight_version"] == "7"
            assert len(call(url, "/weights_checker", {"action": "checksum"})[1]["ranks"]) == 2
            assert max_logprob_diff(url, model) < 1e-4


@pytest.mark.slow
@pytest.mark.long  # 40-80 s on a shared CPU; the fleet tests above keep the two-node engine in `make test`
def test_a_cpu_run_with_a_two_node_strict_engine_trains_and_syncs_every_tp_rank(tmp_path, capsys):
    from glue.metrics.logger import read_metrics
    from launch.cli import main

    argv = ["--config", "examples/configs/demo.yaml", "cluster.engine=sglang_strict",
            "cluster.engine_tensor_parallel_size=2", "cluster.engine_nodes=2", "rollout.num_engines=1",
            "run.num_steps=2", "rollout.prompts_per_step=4", f"run.output_dir={tmp_path}", "run.name=mn"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "engine 0, engine 0 node rank 1, trainer rank 0" in capsys.readouterr().out  # the placement line
    records = read_metrics(tmp_path / "mn" / "metrics.jsonl")
    assert [r["weights/version"] for r in records] == [1, 2]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3  # the engine holds the weights
    assert "node rank 1 joined node rank 0" in (tmp_path / "mn" / "logs" / "engine_0_node_1.log").read_text()
