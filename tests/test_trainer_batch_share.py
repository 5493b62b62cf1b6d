"""The driver serialises a training batch once per step, whatever the trainer's world size: every rank reads the
same copy from Ray's object store (the driver funnel: world-size copies of every batch through one process)."""
from __future__ import annotations


import pytest

from helpers.trainer import make_batch, serialised_bytes


@pytest.fixture(scope="module")
def ray_cluster():
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def group_of(ray, world_size: int):
    from glue.trainer.group import TrainerGroup

    class RowCounter:  # defined here so Ray ships it by value to its workers
        """Stands in for a trainer rank at the seam under test (what a rank receives): answers with its rows."""

        def train_step(self, batch):
            return {"weights/version": 1.0, "rows": float(batch.tokens.shape[0])}

    group = TrainerGroup.__new__(TrainerGroup)  # the real driver side, over light actors
    group.version, group._actors = 0, [ray.remote(RowCounter).remote() for _ in range(world_size)]
    return group


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_step_serialises_the_batch_once_not_once_per_rank(ray_cluster, world_size):
    from ray._private.worker import global_worker

    batch = make_batch()
    batch_bytes = global_worker.get_serialization_context().serialize(batch).total_bytes
    group = group_of(ray_cluster, world_size)
    with serialised_bytes() as counted:
        metrics = group.train_step(batch)
    assert metrics["rows"] == batch.tokens.shape[0] and group.version == 1
    assert sum(counted) / batch_bytes <= 1.5, f"{sum(counted)} bytes serialised for a {batch_bytes}-byte batch"
