"""`make bench` scale section: what grows with the run's size, measured here, written to bench-results/scale.json
one key per test (a test rewrites only its own key): `driver_ratio` (bytes the driver serialises per training step
over the batch's bytes, per trainer world size) and `health_sweep_s` with its engines and timeout (one deep health
sweep over many stand-in engines, some hung)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.bench
OUT = REPO_ROOT / "bench-results" / "scale.json"


def write_section(values: dict[str, Any], out: Path = OUT) -> None:
    """Merge `values` into scale.json (the other sections stay as an earlier run wrote them)."""
    out.parent.mkdir(exist_ok=True)
    current = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**current, **values}, indent=2) + "\n")


def test_driver_ratio_per_world_size(tmp_path_factory):
    """A real TrainerGroup (tiny Qwen2, DP = world size) trains one step; every byte the driver hands to Ray's
    serializer during it is counted."""
    import ray
    from ray._private.worker import global_worker

    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.trainer.config import TrainerConfig
    from glue.trainer.group import TrainerGroup
    from loss import LossConfig
    from test_trainer_batch_share import serialised_bytes
    from test_trainer_megatron import make_batch

    model = save_tiny_model(str(tmp_path_factory.mktemp("tiny")), family="qwen2", seed=0)
    batch = make_batch(response_len=64)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    ratios = {}
    try:
        batch_bytes = global_worker.get_serialization_context().serialize(batch).total_bytes
        for world in (1, 2, 4):
            cfg = TrainerConfig(data_parallel_size=world, micro_batch_size=2, num_cpus_per_worker=1)
            group = TrainerGroup(model, cfg, LossConfig())
            try:
                with serialised_bytes() as counted:
                    group.train_step(batch)
                ratios[str(world)] = round(sum(counted) / batch_bytes, 3)
            finally:
                group.shutdown()
    finally:
        ray.shutdown()
    write_section({"driver_ratio": ratios, "driver_ratio_batch_bytes": batch_bytes})
    assert all(r <= 1.5 for r in ratios.values()), ratios
