"""The pipelined weight sync for real (a source in this process, an embedded engine over gloo): it delivers the same
bytes as the serial path in the same bucket order, packs only into its two preallocated buffers, and a failure in
the middle of a transfer surfaces as one exception without leaving a thread or an engine stuck in a collective."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import weight_sync.channels
from glue.loop.config import SyncConfig
from helpers.engines import call
from weight_sync.bridge import make_bridge
from weight_sync.buckets import pipeline_bucket_bytes
from weight_sync.sender import LocalWeightSource
from weight_sync.verify import check_full


@pytest.fixture(scope="module")
def engine(engine_processes, tiny_model_dir) -> str:
    return engine_processes.start(tiny_model_dir)


def random_source(tiny_model_dir: str, seed: int) -> LocalWeightSource:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    return LocalWeightSource({n: torch.randn(t.shape, generator=gen)
                              for n, t in load_file(f"{tiny_model_dir}/model.safetensors").items()})


def sent_buckets(monkeypatch) -> list[tuple[int, int]]:
    """(data pointer, bytes) of every bucket the source broadcasts, in order."""
    seen: list[tuple[int, int]] = []
    broadcast = weight_sync.channels.broadcast_bucket

    def recording(group, flat, src=0, wait=True):
        if group.rank == 0:
            seen.append((flat.data_ptr(), flat.numel()))
        return broadcast(group, flat, src, wait)

    monkeypatch.setattr(weight_sync.channels, "broadcast_bucket", recording)
    return seen


def test_pipelined_and_serial_syncs_deliver_bit_identical_buckets_in_the_same_order(engine, tiny_model_dir,
                                                                                     monkeypatch):
    source = random_source(tiny_model_dir, 11)
    checksums = {}
    for pipeline in (False, True):
        bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=40_000, verify="full"), source=source,
                             engine_urls=[engine], pipeline=pipeline)
        try:
            assert len(bridge.layouts) >= 8
            source.stage_weights()
            transfer = bridge.transport.transfer([engine], str(20 + pipeline))
            checksums[pipeline] = transfer.source
            assert transfer.engines[engine] == transfer.source  # the engine got every bucket, in order
            check_full(engine, source.stage_weights(True), timeout_s=30)  # every engine tensor is the source's
        finally:
            bridge.close()
    assert checksums[True] == checksums[False] and len(set(checksums[True])) == len(checksums[True])


def test_a_pipelined_sync_packs_only_into_its_two_preallocated_buffers_bucket_after_bucket(engine, tiny_model_dir,
                                                                                          monkeypatch):
    source = random_source(tiny_model_dir, 12)
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=40_000), source=source, engine_urls=[engine],
                         pipeline=True)
    try:
        (channel,) = source._sender.channels.values()
        buffers = [b.data_ptr() for b in channel.buffers]
        seen = sent_buckets(monkeypatch)
        for version in (1, 2, 3):
            metrics = bridge.sync(version)
        assert [b.data_ptr() for b in channel.buffers] == buffers and len(buffers) == 2
        # Bucket k goes out of buffer k % 2, every sync, with the planned sizes in the planned order.
        expected = [(buffers[b.index % 2], b.nbytes) for b in bridge.layouts] * 3
        assert seen == expected
        assert metrics["pack_s"] > 0 and metrics["wire_s"] > 0 and metrics["copy_in_s"] > 0
        assert metrics["gb_per_s"] == pytest.approx(metrics["bytes"] / metrics["total_s"] / 1e9)
    finally:
        bridge.close()


def test_a_streamed_broadcast_channel_keeps_one_buffer_even_when_pipelined(monkeypatch):
    """A streaming source (the trainer's) brings each bucket's tensors with its send, and the broadcast ends before
    the send returns, so a second buffer would never be used: the channel holds one, and every bucket goes out of
    it. A weight group of the source alone (world size 1) stands in for the engines."""
    from helpers.trainer import _free_port
    from weight_sync.buckets import plan_buckets
    from weight_sync.sender import BucketSender

    tensors = {f"w{i}": torch.full((1000,), float(i)) for i in range(4)}
    layouts = plan_buckets([(n, "float32", (1000,)) for n in tensors], 4000)
    spec = {"kind": "broadcast", "layouts": [b.to_json() for b in layouts], "pipeline": True,
            "master_address": "127.0.0.1", "master_port": _free_port(), "world_size": 1, "group_name": "streamed",
            "backend": "gloo", "timeout_s": 30}
    seen = sent_buckets(monkeypatch)
    source = BucketSender()
    try:
        source.open_channel("streamed", spec, streamed=True)
        channel = source.channels["streamed"]
        buffers = [b.data_ptr() for b in channel.buffers]
        for layout in layouts:
            source.send_bucket("streamed", layout.index, {n: tensors[n] for n in layout.names})
    finally:
        source.close()
    assert len(layouts) == 4 and len(buffers) == 1
    assert seen == [(buffers[0], 4000)] * 4


def test_a_packing_failure_mid_pipeline_raises_once_and_leaves_no_thread_or_engine_stuck(engine, tiny_model_dir,
                                                                                       monkeypatch):
    source = random_source(tiny_model_dir, 13)
    pack = weight_sync.channels.pack_bucket

    def failing_at_bucket_3(layout, tensors, out):
        if layout.index == 3:
            raise RuntimeError("packing bucket 3 failed (injected)")
        return pack(layout, tensors, out)

    threads_before = set(threading.enumerate())
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=40_000, timeout_s=60), source=source,
                         engine_urls=[engine], pipeline=True)
    try:
        bridge.sync(1)
        monkeypatch.setattr(weight_sync.channels, "pack_bucket", failing_at_bucket_3)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^packing bucket 3 failed \(injected\)$"):
            bridge.sync(2)
        assert time.monotonic() - t0 < 20  # surfaced at once, not after a collective's 60 s timeout
        assert call(engine, "/model_info")[1]["weight_version"] == "1"  # the failed sync tagged nothing
        monkeypatch.setattr(weight_sync.channels, "pack_bucket", pack)
        bridge.sync(3)  # the same group carries the next sync: nobody was left inside a collective
        assert call(engine, "/model_info")[1]["weight_version"] == "3"
    finally:
        bridge.close()
    lingering = [t for t in set(threading.enumerate()) - threads_before
                 if t.name.startswith("bucket-packer") and t.is_alive()]
    assert lingering == []


def test_the_pipeline_bucket_size_grows_with_the_square_root_of_the_model_and_respects_the_cap():
    mb = 1000**2
    assert pipeline_bucket_bytes(221 * mb, 512 * 1024**2) == pytest.approx(42 * mb, rel=0.01)
    assert pipeline_bucket_bytes(1000 * mb, 512 * 1024**2) == pytest.approx(89.4 * mb, rel=0.01)
    assert pipeline_bucket_bytes(1000 * mb, 40_000) == 40_000  # bucket_bytes stays an upper bound
    assert pipeline_bucket_bytes(10_000, 512 * 1024**2) == 1024**2  # tiny models: one bucket, no pipeline to fill


def test_the_pipeline_is_on_by_default_with_nccl_and_off_with_gloo_unless_the_config_says():
    from weight_sync.bridge import WeightBridge

    made = []

    def fake_init(self, *args, pipeline, **kwargs):  # what make_bridge chose, without connecting anything
        made.append(pipeline)
        raise RuntimeError("stop here")

    for cfg, expected in [(SyncConfig(), False), (SyncConfig(backend="nccl"), True),
                          (SyncConfig(pipeline=True), True), (SyncConfig(backend="nccl", pipeline=False), False)]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(WeightBridge, "__init__", fake_init)
            with pytest.raises(RuntimeError, match="stop here"):
                make_bridge(cfg, source=None, engine_urls=[])
        assert made[-1] is expected, cfg
