"""Which Ray a run uses and what it says when the cluster is wrong or full, on a private Ray (fast; the same on a
cluster of two raylets started by the test is tests/test_cluster_two_nodes.py): RAY_ADDRESS, which `ray job submit`
sets for its job, is the cluster a run attaches to; an address where no Ray head answers fails in seconds with one
line naming it; a placement group with no room fails after cluster.placement_timeout_s with what is free, or waits
(0) saying what for until it fits."""
import contextlib
import re
import threading
import time
from pathlib import Path

import pytest

from helpers.cli import run_error
from launch.config import load_config
from launch.plan.run_plan import resolve

DEMO = str(Path(__file__).resolve().parents[1] / "examples/configs/demo.yaml")


def test_ray_address_in_the_environment_is_the_cluster_a_run_plans_for(monkeypatch):
    from launch.run.preflight import check_placement

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg, plan = resolve(load_config(DEMO, []))
    assert cfg.run.cluster_address == "10.0.0.1:6379"
    assert check_placement(cfg, plan, here=False) == ("placement: 3 bundles, 3 CPUs, reserved on the cluster at "
                                                      "10.0.0.1:6379 (RAY_ADDRESS) at start-up")
    monkeypatch.setenv("RAY_ADDRESS", "local")  # Ray's own word for "start one here"
    assert load_config(DEMO, []).run.cluster_address is None
    # run.ray_address, when set, is the one
    assert load_config(DEMO, ["run.ray_address=auto"]).run.cluster_address == "auto"


def test_an_address_where_no_ray_head_answers_fails_in_seconds_with_one_line_naming_it(tmp_path, capsys):
    error, took = run_error(capsys, ["run.ray_address=127.0.0.3:1", f"run.output_dir={tmp_path}"])
    assert error == ("sluice: error: no Ray cluster answers at 127.0.0.3:1 (run.ray_address=127.0.0.3:1): Connection "
                     "refused; check the address and port (`ray start --head --port`, 6379 by default) and that the "
                     "head is up (`ray status --address ...` on a node of the cluster)")
    assert took < 30, took


def test_a_dashboard_address_in_ray_address_is_refused_naming_the_port_to_give(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # what `ray job submit` is pointed at
    assert run_error(capsys, [f"run.output_dir={tmp_path}"])[0] == (
        "sluice: error: RAY_ADDRESS=http://127.0.0.1:8265 is a Ray dashboard address (what `ray job submit` talks "
        "to); sluice attaches to the head's GCS port: give host:port of `ray start --head --port` (6379 by default), "
        "or auto on a node of the cluster")


@pytest.fixture(scope="module")
def private_ray():
    """A private Ray of 2 CPUs in this process."""
    from launch.run.cluster import start_ray

    with contextlib.ExitStack() as stack:
        start_ray(address=None, num_cpus=2, stack=stack)
        yield


def test_a_placement_group_without_room_fails_after_its_timeout_with_one_line_and_the_free_resources(private_ray):
    from launch.run.cluster import ClusterError, reserve

    _, plan = resolve(load_config(DEMO, ["cluster.cpus_per_bundle=2", "trainer.num_cpus_per_worker=2",
                                         "run.ray_num_cpus=8"]))  # 3 bundles of 2 CPUs; this Ray has 2
    started = time.monotonic()
    with pytest.raises(ClusterError) as err, contextlib.ExitStack() as stack:
        reserve(plan, stack, timeout_s=2)
    assert 2 <= time.monotonic() - started < 20
    assert str(err.value) == (
        "the cluster did not grant the placement group within cluster.placement_timeout_s=2 s: it needs 6 CPU in 3 "
        "bundles (STRICT_PACK: all on one node); free now: 2 CPU, 0 GPU; free some, add nodes (check "
        "cluster.num_nodes / gpus_per_node against `ray status`), or set cluster.placement_timeout_s=0 to wait until "
        "it fits")


def test_with_placement_timeout_0_a_run_waits_for_room_saying_what_it_waits_for_and_goes_on_once_it_fits(
        private_ray):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from launch.run.cluster import wait_for_placement

    said: list[str] = []
    other_job = placement_group([{"CPU": 2}], strategy="STRICT_PACK")  # every CPU there is
    ray.get(other_job.ready(), timeout=60)
    ours = placement_group([{"CPU": 1}], strategy="STRICT_PACK")
    try:
        threading.Timer(2.0, remove_placement_group, [other_job]).start()  # the other job ends
        started = time.monotonic()
        wait_for_placement(ours, [{"CPU": 1}], "STRICT_PACK", 0, say=said.append, report_s=0.5)
        assert 1.5 < time.monotonic() - started < 30
    finally:
        remove_placement_group(ours)
    assert len(said) >= 2, said
    assert re.fullmatch(r"sluice: waited \d+ s for the placement group: it needs 1 CPU in 1 bundles \(STRICT_PACK: "
                        r"all on one node\); free now: 0 CPU, 0 GPU; waiting until it fits "
                        r"\(cluster.placement_timeout_s=0\)", said[0]), said


def test_an_attached_run_hands_its_pythonpath_to_the_cluster_unless_the_submitted_job_sets_one(monkeypatch):
    from launch.run.cluster import job_runtime_env

    monkeypatch.setenv("PYTHONPATH", "/shared/my_tasks")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert job_runtime_env() == {"env_vars": {"PYTHONPATH": "/shared/my_tasks"}}
    # inside `ray job submit --runtime-env-json '{"env_vars": {"PYTHONPATH": ...}}'` Ray would refuse a second one
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR",
                       '{"runtime_env": {"env_vars": {"PYTHONPATH": "/shared/my_tasks"}}, "metadata": {}}')
    assert job_runtime_env() is None
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"pip": ["x"]}, "metadata": {}}')
    assert job_runtime_env() == {"env_vars": {"PYTHONPATH": "/shared/my_tasks"}}
