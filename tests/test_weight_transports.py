"""The bridge for real: every transport moves a state dict in several buckets into running embedded engines, which
then generate exactly like that model; the version lands with the last bucket, not before it and not in a later call;
full verification catches weights changed behind the bridge's back; a late engine is brought to the current version
first; 500 IPC syncs leave shared memory as it was."""
from __future__ import annotations

import os
import time

import pytest

from glue.loop.config import SyncConfig
from helpers.engines import call
from weight_sync.bridge import WeightSyncError, make_bridge
from weight_sync.transports import Transfer
from weight_sync.verify import check_bucket_checksums
from helpers.weights import hf_model, max_logprob_diff, source_of


@pytest.fixture(scope="module")
def engines(engine_processes, tiny_model_dir) -> list[str]:
    """Two engines that start with the seed-0 weights; each test loads a model of its own into them."""
    return [engine_processes.start(tiny_model_dir), engine_processes.start(tiny_model_dir)]


@pytest.mark.parametrize("transport,seed", [("broadcast", 1), ("ipc", 2), ("disk", 3)])
def test_each_transport_brings_every_engine_to_the_sources_weights_in_several_buckets(
        engines, tmp_path_factory, tmp_path, transport, seed):
    model, _ = hf_model(tmp_path_factory, seed)
    cfg = SyncConfig(transport=transport, bucket_bytes=40_000, verify="full", disk_dir=str(tmp_path / "ckpt"))
    bridge = make_bridge(cfg, source=source_of(model), engine_urls=engines)
    try:
        assert len(bridge.layouts) >= 8  # ~313 kB of weights in buckets of <= 40 kB (lm_head alone is 8 kB)
        assert all(b.nbytes <= 40_000 for b in bridge.layouts)
        timings = bridge.sync(5)
        assert timings["bytes"] == sum(p.numel() * 4 for p in model.parameters())
        for url in engines:
            assert call(url, "/model_info")[1]["weight_version"] == "5"
            diff = max_logprob_diff(url, model)
            print(f"{transport}: max |engine - model| logprob = {diff:.2e}")
            assert diff < 1e-5
    finally:
        bridge.close()
    if transport == "disk":
        assert os.listdir(tmp_path / "ckpt") == []  # the bridge cleans its checkpoints up


@pytest.mark.parametrize("transport,version", [("broadcast", "41"), ("ipc", "42"), ("disk", "43")])
def test_the_last_buckets_request_tags_the_version_so_engines_report_the_old_one_until_every_bucket_landed(
        engines, tmp_path_factory, tmp_path, transport, version):
    model, _ = hf_model(tmp_path_factory, 8)
    source = source_of(model)
    cfg = SyncConfig(transport=transport, bucket_bytes=40_000, disk_dir=str(tmp_path / "ckpt"))
    bridge = make_bridge(cfg, source=source, engine_urls=engines)
    old = [call(url, "/model_info")[1]["weight_version"] for url in engines]
    assert version not in old
    between: list[list[str]] = []  # every engine's version as the source is about to send buckets 1, 2, ...
    send = source.send_weight_bucket

    def look_then_send(channel: str, index: int) -> dict:
        if index > 0:
            between.append([call(url, "/model_info")[1]["weight_version"] for url in engines])
        return send(channel, index)

    source.send_weight_bucket = look_then_send
    try:
        source.stage_weights()
        transfer = bridge.transport.transfer(engines, version)  # the transport alone: no /update_weight_version
        check_bucket_checksums(transfer, [b.names for b in bridge.layouts])
        assert between == [old] * (len(bridge.layouts) - 1) and len(between) >= 7
        for url in engines:
            assert call(url, "/model_info")[1]["weight_version"] == version
            assert max_logprob_diff(url, model) < 1e-5
    finally:
        bridge.close()


def test_full_verification_fails_when_an_engines_weights_changed_behind_the_bridge(
        engines, tmp_path_factory, tiny_model_dir):
    model, _ = hf_model(tmp_path_factory, 4)
    bridge = make_bridge(SyncConfig(transport="ipc", verify="full"), source=source_of(model), engine_urls=engines[:1])
    try:
        bridge.sync(1)
        status, answer = call(engines[0], "/update_weights_from_disk", {"model_path": tiny_model_dir})
        assert status == 200 and answer["success"], answer
        # 27 tensors, of which the 5 norms (ones) and 6 qkv biases (zeros) are the same in every random tiny model
        with pytest.raises(WeightSyncError, match=r"weights differ from the trainer's: 16 tensor\(s\) differ"):
            from weight_sync.verify import check_full

            check_full(engines[0], bridge.source.stage_weights(True), timeout_s=30)
        bridge.sync(2)  # a sync repairs it, and verifies that it did
        assert max_logprob_diff(engines[0], model) < 1e-5
    finally:
        bridge.close()


def test_a_bucket_checksum_that_differs_on_any_engine_raises_naming_engine_and_bucket():
    transfer = Transfer(source=["0a0a0a0a", "1b1b1b1b"], engines={"http://e0": ["0a0a0a0a", "1b1b1b1b"],
                                                                  "http://e1": ["0a0a0a0a", "ffffffff"]})
    with pytest.raises(WeightSyncError, match=r"http://e1 bucket 1 \(1 tensors from 'b'\): source 1b1b1b1b, engine ffffffff"):
        check_bucket_checksums(transfer, [["a"], ["b"]])
    check_bucket_checksums(Transfer(source=["0a"], engines={"http://e0": ["0a"]}), [["a"]])  # equal: silent
    with pytest.raises(WeightSyncError, match="reports no bucket checksums"):
        check_bucket_checksums(Transfer(source=["0a"], engines={"http://e0": [None]}), [["a"]])


def test_a_late_engine_receives_the_current_version_before_it_joins_the_broadcast_group(
        engine_processes, engines, tiny_model_dir, tmp_path_factory):
    model5, _ = hf_model(tmp_path_factory, 5)
    model6, _ = hf_model(tmp_path_factory, 6)
    source = source_of(model5)
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=100_000), source=source,
                         engine_urls=engines[:1])
    try:
        bridge.sync(3)
        late = engine_processes.start(tiny_model_dir)  # starts with the seed-0 weights and version "0"
        bridge.add_engine(late)
        assert call(late, "/model_info")[1]["weight_version"] == "3"
        assert max_logprob_diff(late, model5) < 1e-5
        source.tensors = {n: p.detach().clone() for n, p in model6.named_parameters()}
        bridge.sync(4)  # one group, both engines
        for url in (engines[0], late):
            assert call(url, "/model_info")[1]["weight_version"] == "4"
            assert max_logprob_diff(url, model6) < 1e-5
    finally:
        bridge.close()


def _sluice_segments() -> dict[str, int]:
    return {f: os.path.getsize(f"/dev/shm/{f}") for f in os.listdir("/dev/shm") if f.startswith("sluice-")}


def _mapped_segments(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("/dev/shm/sluice-" in line for line in f)


def test_five_hundred_ipc_syncs_leave_shared_memory_flat(engine_processes, engines, tmp_path_factory):
    model, _ = hf_model(tmp_path_factory, 7)
    engine_pids = [p.pid for p in engine_processes.procs[:2]]
    before_files, before_used = _sluice_segments(), _shm_used()
    bridge = make_bridge(SyncConfig(transport="ipc", bucket_bytes=100_000, pipeline=True), source=source_of(model),
                         engine_urls=engines)
    try:
        bridge.sync(1)
        after_first, used_first = _sluice_segments(), _shm_used()
        assert len(after_first) == len(before_files) + 2  # two preallocated segments (pipelined), the largest bucket's size
        for version in range(2, 501):
            bridge.sync(version)
        after_500, used_500 = _sluice_segments(), _shm_used()
        print(f"/dev/shm used: before {before_used} B, after 1 sync {used_first} B, after 500 syncs {used_500} B; "
              f"sluice segments {after_first} -> {after_500}")
        assert after_500 == after_first
        # each engine keeps the two segments mapped between buckets and syncs, and maps nothing more
        assert [_mapped_segments(pid) for pid in engine_pids] == [2, 2]
        assert call(engines[1], "/model_info")[1]["weight_version"] == "500"
    finally:
        bridge.close()
    assert _sluice_segments() == before_files  # closing the bridge unlinks the segments
    deadline = time.monotonic() + 10  # ... and the engines unmap them (their memory is freed) within seconds
    while any(_mapped_segments(pid) for pid in engine_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [_mapped_segments(pid) for pid in engine_pids] == [0, 0]


def _shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_broadcast_group_of_twenty_engines_forms_although_the_pool_starts_at_sixteen():
    """Forming a group is a collective: the source and all 20 engines must be inside it at once. Each fake engine
    answers /init_weights_update_group only when all 21 have arrived, as a real group's rendezvous does."""
    import threading

    from conftest import fake_engine_server
    from weight_sync.transports import BroadcastTransport

    n = 20
    everyone = threading.Barrier(n + 1, timeout=20)

    class Source:
        def open_weight_channel(self, name, spec):
            assert spec["world_size"] == n + 1
            everyone.wait()

    transport = BroadcastTransport(Source(), [], backend="gloo", master_address="127.0.0.1", with_checksum=False,
                                   timeout_s=30)
    with fake_engine_server(lambda body: everyone.wait()) as base:
        try:
            urls = [f"{base}/engine{i}" for i in range(n)]
            transport.connect(urls)
            assert list(transport.groups) == [tuple(urls)]
        finally:
            transport._pool.shutdown(wait=False)


def test_engines_with_two_tensor_parallel_ranks_each_get_disjoint_ranks_in_the_weight_group():
    """SGLang joins every TP rank of an engine at rank_offset + tp_rank: with --tp-size 2, engine i must start at
    1 + 2i and the group must count 1 + 2N members, or the ranks of neighbouring engines collide."""
    import json

    from conftest import fake_engine_server
    from weight_sync.transports import BroadcastTransport

    class Source:
        def open_weight_channel(self, name, spec):
            self.world_size = spec["world_size"]

        def close_weight_channel(self, name):
            pass

    joined = []
    source = Source()
    transport = BroadcastTransport(source, [], backend="gloo", master_address="127.0.0.1", with_checksum=False,
                                   timeout_s=30, ranks_per_engine=2)
    with fake_engine_server(lambda body: joined.append(json.loads(body))) as base:
        try:
            transport.connect([f"{base}/engine{i}" for i in range(3)])
        finally:
            transport.close()
    joined = [j for j in joined if "rank_offset" in j]  # the joins, not the /destroy_weights_update_group at close
    engine_ranks = sorted(j["rank_offset"] + tp_rank for j in joined for tp_rank in range(2))
    assert source.world_size == 7 and {j["world_size"] for j in joined} == {7}
    assert engine_ranks == [1, 2, 3, 4, 5, 6]  # every member rank once, the source being rank 0


class BucketsOnCuda:
    """A weight source whose bucket copies stand on CUDA (what the ipc channel reports there), for the transport's
    own reach check on a machine without CUDA: every entry a handle string, no engine ever reads it."""

    def __init__(self):
        self.channels: list[dict] = []

    def open_weight_channel(self, name, spec):
        self.channels.append(spec)

    def close_weight_channel(self, name):
        pass

    def send_weight_bucket(self, name, index):
        entries = [f"handle {index}.{n}" for n in range(len(self.channels[-1]["serve"][0]))]
        return {"device": "cuda", "handles": entries, "handles_by_rank": {0: entries}, "checksum": None}


@pytest.mark.parametrize("planned", [False, True])
def test_on_cuda_one_source_serves_two_engine_ranks_only_where_the_plan_put_them_on_its_gpu(planned):
    from weight_sync.buckets import BucketLayout
    from weight_sync.ipc_transport import IpcTransport

    dead = [f"http://127.0.0.1:{port}" for port in (9, 13)]  # nothing listens: a planned transfer reaches its call
    transport = IpcTransport(BucketsOnCuda(), [BucketLayout(index=0, slots=())], with_checksum=False, timeout_s=2,
                             sources_of=(lambda url: [0]) if planned else None)
    with pytest.raises(WeightSyncError) as raised:
        transport.transfer(dead, "1")
    shared = "a source rank would serve 2 engine ranks from one GPU's buffer" in str(raised.value)
    assert shared != planned, raised.value  # the plan's mapping (two engines beside rank 0) vouches for the devices
