"""Engines on any node: each engine started by a Ray actor pinned to its placement-group bundle (real Ray, CPU
bundles, real embedded engines behind the real sgl-router); stop() and a dead actor leave no engine running."""
from __future__ import annotations

import asyncio
import os
import re
import sys
import time

import pytest

from glue.fleet.engine_client import EngineClient
from conftest import is_gone
from glue.fleet.fleet import RolloutFleet


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def bundles():
    """A local Ray cluster and a placement group of two CPU bundles; yields actor options for each bundle."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    group = placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=60)
        yield [{"num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=b)} for b in range(2)]
    finally:
        remove_placement_group(group)
        ray.shutdown()


def test_engines_started_by_bundle_actors_serve_generates_through_the_router_and_stop_leaves_no_engine(
        bundles, tiny_model_dir, tmp_path):
    fleet = RolloutFleet(model_path=tiny_model_dir, num_engines=2, engine_args=["--num-threads", "1"],
                         log_dir=tmp_path, engine_hosts=bundles,
                         engine_env=[{"SLUICE_BUNDLE": "0"}, {"SLUICE_BUNDLE": "1"}])
    try:
        fleet.start()
        engine_pids = fleet.started_pids[:2]
        for i, pid in enumerate(engine_pids):
            assert parent_pid(pid) != os.getpid()  # a child of its host actor, not of this driver
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            assert f"SLUICE_BUNDLE={i}".encode() in environ
        assert fleet.registered_workers() == {url: True for url in fleet.engine_urls}

        async def generate():
            client = EngineClient(fleet.router_url, fleet.engine_urls)
            try:
                return await asyncio.gather(*(client.generate([0, 4, 5], {"max_new_tokens": 4, "ignore_eos": True})
                                              for _ in range(6)))
            finally:
                await client.aclose()

        outputs = asyncio.run(generate())
        assert [len(o["output_ids"]) for o in outputs] == [4] * 6
    finally:
        fleet.stop()
    assert all(is_gone(p) for p in fleet.started_pids)


def test_an_engine_that_never_answers_health_on_its_bundle_raises_timeout_with_its_log_and_is_stopped(
        bundles, tmp_path):
    sleeper = [sys.executable, "-c", "import sys, time; print('loading', sys.argv[1:3], flush=True); time.sleep(600)"]
    fleet = RolloutFleet(model_path="/nonexistent", num_engines=2, engine_command=sleeper, log_dir=tmp_path,
                         engine_startup_timeout_s=2, engine_hosts=bundles)
    with pytest.raises(TimeoutError) as err:
        fleet.start()
    assert re.search(r"engine at http://[\d.]+:\d+ did not answer GET /health within engine_startup_timeout_s=2 s",
                     str(err.value))
    assert "loading ['--model-path', '/nonexistent']" in str(err.value)
    assert len(fleet.started_pids) == 2 and all(is_gone(p) for p in fleet.started_pids)


def test_killing_an_engines_host_actor_ends_the_engine(bundles, tmp_path):
    import ray

    from glue.fleet.engine_host import RemoteEngine

    engine = RemoteEngine("engine 0", command=[sys.executable, "-c", "import time; time.sleep(600)"],
                          model_path="unused", args=[], env=None, log_path=tmp_path / "e.log",
                          actor_options=bundles[0])
    assert not is_gone(engine.pid)
    ray.kill(engine._actor)  # the actor's process dies without running any cleanup
    deadline = time.monotonic() + 20
    while not is_gone(engine.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert is_gone(engine.pid)
    engine.kill()  # the actor is gone: nothing left to do, and no error


def test_a_host_whose_bundle_never_comes_gives_up_after_its_placement_timeout_naming_the_engine(bundles, tmp_path):
    """A lost node's bundle that no other node has room for: here a resource no node has. The host is not left
    waiting, and the engine is named (the watch then asks the run to stop with its checkpoint)."""
    from glue.fleet.engine_host import NotPlaced, RemoteEngine

    started = time.monotonic()
    with pytest.raises(NotPlaced, match=r"^engine 1 did not start on its placement-group bundle within 2 s \(is its "
                                        r"node gone, with no other node that has room for it\?\)$"):
        RemoteEngine("engine 1", command=[sys.executable, "-c", "import time; time.sleep(600)"], model_path="unused",
                     args=[], env=None, log_path=tmp_path / "e.log", placement_timeout_s=2,
                     actor_options={"num_cpus": 0, "resources": {"a_node_that_is_gone": 1}})
    assert time.monotonic() - started < 20
