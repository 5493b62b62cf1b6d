"""A late engine joins a running fleet: the bridge brings it to the current version first, and only then does the
real sgl-router get it (POST /workers). One whose catch-up fails is stopped and never routed to."""
from __future__ import annotations

import os

import pytest
import torch

from glue.config import SyncConfig
from glue.fleet import RolloutFleet
from test_embedded_engine import call
from weight_sync.bridge import WeightSyncError, make_bridge
from weight_sync.source import LocalWeightSource


def test_a_late_engine_is_synced_to_the_current_version_before_the_router_sees_it(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "seed9", seed=9), dtype=torch.float32)
    source = LocalWeightSource({n: p.detach().clone() for n, p in model.named_parameters()})
    fleet = RolloutFleet(model_path=tiny_model_dir, num_engines=1, log_dir=tmp_path / "logs",
                         engine_args=["--num-threads", "1"])
    fleet.start()
    bridge = None
    try:
        bridge = make_bridge(SyncConfig(transport="broadcast", verify="full"), source=source,
                             engine_urls=list(fleet.engine_urls))
        bridge.sync(7)
        seen_by_router_during_catch_up: dict = {}

        def catch_up(url: str) -> None:
            bridge.add_engine(url)
            seen_by_router_during_catch_up.update(fleet.registered_workers())

        late = fleet.add_engine(prepare=catch_up)
        assert late not in seen_by_router_during_catch_up and len(seen_by_router_during_catch_up) == 1
        assert fleet.registered_workers().get(late) is True
        assert call(late, "/model_info")[1]["weight_version"] == "7"
        bridge.sync(8)  # the late engine is in every later sync
        assert [call(u, "/model_info")[1]["weight_version"] for u in fleet.engine_urls] == ["8", "8"]

        def failing_catch_up(url: str) -> None:
            raise WeightSyncError(f"engine {url} failed /update_weights_from_distributed: test")

        with pytest.raises(WeightSyncError, match="test"):
            fleet.add_engine(prepare=failing_catch_up)
        assert len(fleet.engine_urls) == 2 and len(fleet.registered_workers()) == 2
        assert len(fleet.started_pids) == 4  # engine, router, late engine, the failed one: stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(fleet.started_pids[-1], 0)
    finally:
        if bridge is not None:
            bridge.close()
        fleet.stop()
