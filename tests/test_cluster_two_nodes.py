"""A run on a Ray cluster someone else started: two raylets started here (a head and a worker node, one CPU each, on
their own loopback addresses), stopped by their pids. RAY_ADDRESS (what `ray job submit` sets for its job) attaches
the run to that cluster, and a placement group no node has room for fails after cluster.placement_timeout_s in one
line with what is free. Starting the two nodes takes 10-45 s, so these are `long`; tests/test_cluster_attach.py keeps
the same behaviours in `make test` on a private Ray."""
import contextlib
import os
import time
from pathlib import Path

import pytest

from conftest import free_port
from helpers.processes import live_children
from helpers.ray_nodes import RayNode
from launch.cli import main
from launch.config import load_config
from launch.plan.run_plan import resolve

DEMO = str(Path(__file__).resolve().parents[1] / "examples/configs/demo.yaml")
HEAD_IP, WORKER_IP = "127.0.0.4", "127.0.0.5"


@pytest.fixture(scope="module")
def cluster():
    """A head (1 CPU) and a worker node (1 CPU) joined to it: 2 CPUs free, but never 2 on one node."""
    port = free_port()
    head = RayNode(num_cpus=1, port=port, node_ip=HEAD_IP)
    worker = None
    try:
        head.up()
        worker = RayNode(num_cpus=1, head=f"{HEAD_IP}:{port}", node_ip=WORKER_IP).up()
        yield f"{HEAD_IP}:{port}"
    finally:
        # the worker first: one whose head is gone waits a minute or more for it
        assert (worker.stop() if worker else []) == [] and head.stop() == [], "a Ray process outlived SIGTERM"


@pytest.mark.long  # the two nodes start in 10-45 s; the dry run's RAY_ADDRESS test stays in CI
def test_with_ray_address_set_a_run_attaches_to_that_cluster_and_says_so_with_its_absolute_folder(
        cluster, monkeypatch, tmp_path, capsys):
    import ray

    from launch.run.cluster import start_cluster

    monkeypatch.setenv("RAY_ADDRESS", cluster)  # as `ray job submit` sets it for its job
    monkeypatch.chdir(tmp_path)  # a relative run.output_dir lands in the working directory: the line says where
    cfg, plan = resolve(load_config(DEMO, ["run.output_dir=runs", "rollout.num_engines=1", "cluster.cpus_per_bundle=0.5",
                                           "trainer.num_cpus_per_worker=0.5", f"cluster.node_ip={HEAD_IP}"]))
    with contextlib.ExitStack() as stack:
        placement = start_cluster(cfg, plan, stack)
        assert ray.get_runtime_context().gcs_address == cluster  # the cluster's own GCS, none started here
        assert sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) == [HEAD_IP, WORKER_IP]
        assert not [p for p in live_children(os.getpid()) if "gcs_server" in p or "raylet" in p]
        assert len(placement.node_ip) == 2 and len(set(placement.node_ip)) == 1  # one node of that cluster
    out = capsys.readouterr().out
    assert f"sluice: attached to the Ray cluster at {cluster} (RAY_ADDRESS={cluster}); run folder " \
           f"{tmp_path.resolve()}/runs/demo\n" in out


@pytest.mark.long  # shares the two nodes above; the private-Ray placement tests stay in CI
def test_a_placement_group_no_node_has_room_for_fails_after_its_timeout_with_one_line_and_the_free_resources(
        cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", cluster)
    # 2 CPU bundles on one node (STRICT_PACK): the cluster has 2 CPUs free, 1 on each node
    started = time.monotonic()
    code = main(["--config", DEMO, f"run.output_dir={tmp_path}", "rollout.num_engines=1",
                 f"cluster.node_ip={HEAD_IP}", "cluster.placement_timeout_s=2"])
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("sluice: error:")]
    assert errors == ["sluice: error: the cluster did not grant the placement group within "
                      "cluster.placement_timeout_s=2 s: it needs 2 CPU in 2 bundles (STRICT_PACK: all on one node); "
                      "free now: 2 CPU, 0 GPU; free some, add nodes (check cluster.num_nodes / gpus_per_node against "
                      "`ray status`), or set cluster.placement_timeout_s=0 to wait until it fits"], err
    assert "Traceback" not in err
    assert took < 30, took
