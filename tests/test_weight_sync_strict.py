"""The weight bridge against SGLang-strict engines (the embedded engine answering exactly as SGLang 0.5.23 does):
syncs run inside SGLang's update session, verification is settled from what the engines offer (versions only
here), engine TP ranks join the weight group as rank_offset + tp_rank, and a refusal surfaces at once with the
engine's own message instead of a collective timeout."""
from __future__ import annotations

import time

import pytest

from glue.loop.config import SyncConfig
from helpers.engines import call
from helpers.weights import hf_model, max_logprob_diff, source_of
from weight_sync.bridge import WeightSyncError, make_bridge
from weight_sync.transports import BroadcastTransport


@pytest.fixture(scope="module")
def strict_engines(engine_processes, tiny_model_dir) -> dict[str, str]:
    """Two strict engines at TP 1 and one at TP 2 (simulated ranks on the weight path)."""
    return {"tp1": engine_processes.start(tiny_model_dir, "--sglang-strict"),
            "tp1b": engine_processes.start(tiny_model_dir, "--sglang-strict"),
            "tp2": engine_processes.start(tiny_model_dir, "--sglang-strict", "--tp-size", "2")}


def sglang_checksums(model, tp_size: int) -> list[dict[str, str]]:
    """What SGLang's /weights_checker should report for `model`'s weights: per TP rank, SGLang-named shards."""
    from glue.embedded_engine.sglang_layout import checker_ranks

    return [rank["checksums"] for rank in checker_ranks(model, tp_size)]


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_sync_into_strict_engines_lands_every_weight_on_every_tp_rank(strict_engines, tmp_path_factory, tp,
                                                                       transport):
    # ipc: SGLang's /update_weights_from_tensor payload, one entry per TP rank (shared-memory stand-ins on CPU)
    engine = strict_engines[f"tp{tp}"]
    status, info = call(engine, "/get_server_info", method="GET")
    assert status == 200 and "sluice_capabilities" not in info  # the strict face offers no extras
    model, _ = hf_model(tmp_path_factory, seed=10 + tp)
    cfg = SyncConfig(transport=transport, bucket_bytes=40_000)  # verify: auto
    bridge = make_bridge(cfg, source=source_of(model), engine_urls=[engine], engine_tp_size=tp)
    try:
        assert bridge.verify == "off"  # no bucket checksums to compare: versions are checked after the sync
        bridge.sync(7)
    finally:
        bridge.close()
    assert call(engine, "/model_info", method="GET")[1]["weight_version"] == "7"
    status, checked = call(engine, "/weights_checker", {"action": "checksum"})
    assert status == 200 and [r["checksums"] for r in checked["ranks"]] == sglang_checksums(model, tp)
    assert max_logprob_diff(engine, model) < 1e-4


def test_verify_checksum_against_a_strict_engine_is_refused_before_any_weight_moves(strict_engines,
                                                                                     tmp_path_factory):
    model, _ = hf_model(tmp_path_factory, seed=20)
    before = call(strict_engines["tp1"], "/model_info", method="GET")[1]["weight_version"]
    with pytest.raises(WeightSyncError, match="sync.verify: checksum needs engines that report per-bucket"):
        make_bridge(SyncConfig(transport="broadcast", verify="checksum"), source=source_of(model),
                    engine_urls=[strict_engines["tp1"]])
    assert call(strict_engines["tp1"], "/model_info", method="GET")[1]["weight_version"] == before


def test_an_update_outside_the_session_is_refused_at_once_with_sglangs_message(strict_engines, tmp_path_factory):
    """What today's main did against SGLang: no /begin_weight_update. The engine refuses without joining the
    broadcast; the source, already inside it, leaves (abort key) and the engine's own message is raised, well
    inside the 60 s the collective would otherwise wait."""
    model, _ = hf_model(tmp_path_factory, seed=21)
    source = source_of(model)
    engine = strict_engines["tp1"]
    from weight_sync.buckets import plan_buckets

    layouts = plan_buckets(source.hf_weight_specs(), 40_000)
    transport = BroadcastTransport(source, layouts, backend="gloo", master_address=None, with_checksum=False,
                                   timeout_s=60)
    try:
        transport.connect([engine])
        source.stage_weights()
        t0 = time.perf_counter()
        with pytest.raises(WeightSyncError, match="must run between begin_weight_update"):
            transport.transfer([engine], "3")
        assert time.perf_counter() - t0 < 15
        assert transport.groups == {}  # the broken group was dropped, its source side closed
        assert source._sender.channels == {}
    finally:
        transport.close()
    assert call(engine, "/model_info", method="GET")[1]["weight_version"] != "3"


def test_of_two_engines_one_refusing_the_other_leaves_the_broadcast_too(strict_engines, tmp_path_factory):
    """Engine tp1 has no session open (refuses without joining); engine tp1b has one and waits inside the
    broadcast: both answer within seconds and the sync fails with the refusal."""
    model, _ = hf_model(tmp_path_factory, seed=22)
    source = source_of(model)
    from weight_sync.buckets import plan_buckets

    urls = [strict_engines["tp1"], strict_engines["tp1b"]]
    layouts = plan_buckets(source.hf_weight_specs(), 40_000)
    transport = BroadcastTransport(source, layouts, backend="gloo", master_address=None, with_checksum=False,
                                   timeout_s=60)
    assert call(urls[1], "/begin_weight_update", {})[0] == 200
    try:
        transport.connect(urls)
        source.stage_weights()
        t0 = time.perf_counter()
        with pytest.raises(WeightSyncError, match="must run between begin_weight_update"):
            transport.transfer(urls, "4")
        assert time.perf_counter() - t0 < 15
    finally:
        transport.close()
        assert call(urls[1], "/end_weight_update", {})[0] == 200
    # the engine that was inside the broadcast is free again: a later full sync reaches it
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=40_000), source=source_of(model),
                         engine_urls=[urls[1]])
    try:
        bridge.sync(9)
    finally:
        bridge.close()
    assert call(urls[1], "/model_info", method="GET")[1]["weight_version"] == "9"
