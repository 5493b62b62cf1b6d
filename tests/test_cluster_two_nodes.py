"""A run on a Ray cluster someone else started: two raylets started here (a head and a worker node, one CPU each, on
their own loopback addresses), stopped by their pids. RAY_ADDRESS (what `ray job submit` sets for its job) attaches
the run to that cluster, and a placement group no node has room for fails after cluster.placement_timeout_s in one
line with what is free. Starting the two nodes takes 10-45 s, so these are `long`; tests/test_cluster_attach.py keeps
the same behaviours in `make test` on a private Ray."""
import contextlib
import os
import re
from pathlib import Path

import pytest

from conftest import free_port
from helpers.cli import run_error
from helpers.processes import live_children
from helpers.ray_nodes import RayNode
from launch.config import load_config
from launch.plan.run_plan import resolve

DEMO = str(Path(__file__).resolve().parents[1] / "examples/configs/demo.yaml")
HEAD_IP, WORKER_IP = "127.0.0.4", "127.0.0.5"


@pytest.fixture(scope="module")
def cluster_nodes():
    """A head (1 CPU) and a worker node (1 CPU) joined to it: 2 CPUs free, but never 2 on one node. Yields (the
    head's address, head, worker)."""
    port = free_port()
    head = RayNode(num_cpus=1, port=port, node_ip=HEAD_IP)
    worker = None
    try:
        head.up()
        worker = RayNode(num_cpus=1, head=f"{HEAD_IP}:{port}", node_ip=WORKER_IP).up()
        yield f"{HEAD_IP}:{port}", head, worker
    finally:
        # the worker first: one whose head is gone waits a minute or more for it; a Ray process still there after
        # SIGTERM is SIGKILLed by pid
        left = (worker.stop() if worker else []) + head.stop()
        assert not left, f"Ray processes outlived SIGTERM: {left}"


@pytest.fixture
def cluster(cluster_nodes):
    return cluster_nodes[0]


@pytest.mark.long  # the two nodes start in 10-45 s; the dry run's RAY_ADDRESS test stays in CI
def test_with_ray_address_set_a_run_attaches_to_that_cluster_and_says_so_with_its_absolute_folder(
        cluster, monkeypatch, tmp_path):
    import ray

    from launch.run.cluster import start_cluster

    monkeypatch.setenv("RAY_ADDRESS", cluster)  # as `ray job submit` sets it for its job
    monkeypatch.chdir(tmp_path)  # a relative run.output_dir lands in the working directory: the line says where
    cfg, plan = resolve(load_config(DEMO, ["run.output_dir=runs", "rollout.num_engines=1", "cluster.cpus_per_bundle=0.5",
                                           "trainer.num_cpus_per_worker=0.5", f"cluster.node_ip={HEAD_IP}"]))
    with contextlib.ExitStack() as stack:
        said = []
        placement = start_cluster(cfg, plan, stack, lambda phase, detail: said.append((phase, detail)))
        assert ray.get_runtime_context().gcs_address == cluster  # the cluster's own GCS, none started here
        assert sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) == [HEAD_IP, WORKER_IP]
        assert not [p for p in live_children(os.getpid()) if "gcs_server" in p or "raylet" in p]
        assert len(placement.node_ip) == 2 and len(set(placement.node_ip)) == 1  # one node of that cluster
    assert said == [("ray", f"attached to the Ray cluster at {cluster} (RAY_ADDRESS={cluster}); run folder "
                            f"{tmp_path.resolve()}/runs/demo")]


@pytest.mark.long  # shares the two nodes above; the private-Ray placement tests stay in CI
def test_a_placement_group_no_node_has_room_for_fails_after_its_timeout_with_one_line_and_the_free_resources(
        cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", cluster)
    # 2 CPU bundles on one node (STRICT_PACK): the cluster has 2 CPUs free, 1 on each node
    error, took = run_error(capsys, [f"run.output_dir={tmp_path}", "rollout.num_engines=1",
                                     f"cluster.node_ip={HEAD_IP}", "cluster.placement_timeout_s=2"])
    assert error == ("sluice: error: the cluster did not grant the placement group within "
                     "cluster.placement_timeout_s=2 s: it needs 2 CPU in 2 bundles (STRICT_PACK: all on one node); "
                     "free now: 2 CPU, 0 GPU; free some, add nodes (check cluster.num_nodes / gpus_per_node against "
                     "`ray status`), or set cluster.placement_timeout_s=0 to wait until it fits")
    assert took < 30, took


@pytest.mark.long  # last: it kills the worker node (the fixture then stops what is left of it by pid)
def test_a_trainer_rank_on_a_node_that_dies_is_named_with_that_node_and_stopping_the_rest_raises_nothing(
        cluster_nodes, tiny_model_dir, tmp_path):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from glue.fleet.fleet import ProcessDied
    from glue.trainer.config import TrainerConfig
    from glue.trainer.group import TrainerGroup
    from launch.run.cluster import start_ray
    from loss import LossConfig

    address, _, worker = cluster_nodes
    with contextlib.ExitStack() as stack:
        start_ray(address=address, num_cpus=0, node_ip=HEAD_IP, stack=stack)
        node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == WORKER_IP)
        on_worker = {"num_cpus": 1, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
        group = TrainerGroup(tiny_model_dir, TrainerConfig(), LossConfig(), actor_options=[on_worker],
                             log_dir=tmp_path)
        stack.callback(group.shutdown)
        assert group.nodes == [WORKER_IP]
        assert "sluice: trainer rank 0 of 1, pid" in (tmp_path / "trainer_0.log").read_text()  # a shared folder
        worker.die()  # the node is gone: raylet, workers, the trainer rank, all at once
        with pytest.raises(ProcessDied) as died:
            group.hf_weight_specs()
        # Ray cannot reach it (ActorUnavailableError) or has seen the node die (ActorDiedError), by timing
        assert re.match(rf"trainer rank 0 on node {re.escape(WORKER_IP)} (stopped answering|died) \(", str(died.value)), \
            str(died.value)
        assert str(died.value).endswith(f"; its log: {tmp_path / 'trainer_0.log'}"), str(died.value)
        print(died.value)
        group.close_weight_channel("disk")  # the shutdown path on a dead node's rank raises nothing
