"""A late engine joins a running fleet: the bridge brings it to the current version first, and only then does the
real sgl-router get it (POST /workers). One whose catch-up fails is stopped and never routed to."""
from __future__ import annotations

import os

import pytest
import torch

from glue.loop.config import SyncConfig
from glue.fleet.fleet import RolloutFleet
from helpers.engines import call
from weight_sync.bridge import WeightSyncError, make_bridge
from weight_sync.engine_calls import weight_checksums
from weight_sync.buckets import tensor_checksum
from weight_sync.sender import LocalWeightSource


def source_sums(source: LocalWeightSource) -> dict[str, str]:
    return {name: tensor_checksum(tensor) for name, tensor in source.tensors.items()}


def seed9_source(tmp_path) -> LocalWeightSource:
    """The weights of another tiny model (seed 9) than the engines start with, as a trainer's."""
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "seed9", seed=9), dtype=torch.float32)
    return LocalWeightSource({n: p.detach().clone() for n, p in model.named_parameters()})


def one_engine_fleet(model_dir: str, tmp_path) -> RolloutFleet:
    """A started fleet of one embedded engine behind the router (the test stops it)."""
    fleet = RolloutFleet(model_path=model_dir, num_engines=1, log_dir=tmp_path / "logs",
                         engine_args=["--num-threads", "1"])
    fleet.start()
    return fleet


def test_a_late_engine_is_synced_to_the_current_version_before_the_router_sees_it(tiny_model_dir, tmp_path):
    source, fleet = seed9_source(tmp_path), one_engine_fleet(tiny_model_dir, tmp_path)
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
        assert weight_checksums(late, 30) == source_sums(source)
        with torch.no_grad():  # the trainer steps: the next sync carries weights no engine holds yet
            for tensor in source.tensors.values():
                tensor.add_(0.125)
        bridge.sync(8)  # the late engine is in every later sync
        assert [call(u, "/model_info")[1]["weight_version"] for u in fleet.engine_urls] == ["8", "8"]
        assert [weight_checksums(u, 30) for u in fleet.engine_urls] == [source_sums(source)] * 2

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


def test_a_late_engine_that_joins_after_the_trainer_moved_past_the_last_sync_gets_no_newer_weights_under_an_old_tag(
        tiny_model_dir, tmp_path):
    """sync.interval > 1: between syncs the trainer's live weights are newer than the fleet's. A replacement must not
    get them under the fleet's tag (issue 26 item 2): the whole fleet is brought to the trainer's version."""
    source, fleet = seed9_source(tmp_path), one_engine_fleet(tiny_model_dir, tmp_path)
    bridge = None
    try:
        bridge = make_bridge(SyncConfig(transport="broadcast", verify="full"), source=source,
                             engine_urls=list(fleet.engine_urls))
        source.version = 4
        bridge.sync(4)
        with torch.no_grad():  # one train step past the sync, no sync yet (interval 2)
            for tensor in source.tensors.values():
                tensor.mul_(0.5)
        source.version = 5
        late = fleet.add_engine(prepare=bridge.add_engine)
        versions = [call(u, "/model_info")[1]["weight_version"] for u in fleet.engine_urls]
        assert versions == ["5", "5"] and bridge.version == 5
        assert [weight_checksums(u, 30) for u in (fleet.engine_urls[0], late)] == [source_sums(source)] * 2
    finally:
        if bridge is not None:
            bridge.close()
        fleet.stop()


@pytest.mark.long  # a fleet and two syncs; tests/test_colocated_ipc_plan.py checks slot_sources' answer in CI
def test_a_late_engine_past_the_planned_colocated_ones_gets_the_weights_by_disk_beside_the_ipc_ones(
        tiny_model_dir, tmp_path):
    """ipc with the plan's sources (launch.plan.ipc_sources.slot_sources): an engine added past the plan stands on
    no planned GPU, so it is synced by disk while the planned engine keeps reading ipc handles."""
    from launch.plan.ipc_sources import slot_sources
    from weight_sync.ipc_transport import IpcOrDisk

    source, fleet = seed9_source(tmp_path), one_engine_fleet(tiny_model_dir, tmp_path)
    bridge = None
    try:
        bridge = make_bridge(SyncConfig(transport="ipc", verify="full"), source=source,
                             engine_urls=fleet.engine_urls, disk_dir=str(tmp_path / "weights"),
                             ipc_sources=slot_sources([[0]], fleet.engine_urls))
        assert isinstance(bridge.transport, IpcOrDisk)
        bridge.sync(3)
        late = fleet.add_engine(prepare=bridge.add_engine)
        assert bridge.transport.sources_of(late) is None and bridge.transport.sources_of(fleet.engine_urls[0]) == [0]
        with torch.no_grad():
            for tensor in source.tensors.values():
                tensor.add_(0.25)
        source.version = 4
        bridge.sync(4)
        assert [call(u, "/model_info")[1]["weight_version"] for u in fleet.engine_urls] == ["4", "4"]
        assert [weight_checksums(u, 30) for u in fleet.engine_urls] == [source_sums(source)] * 2
        assert any((tmp_path / "weights").iterdir())  # the late engine's weights went by disk
    finally:
        if bridge is not None:
            bridge.close()
        fleet.stop()
