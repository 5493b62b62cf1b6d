"""Issue 49, rehearsed on CPU as on GPUs: colocated strict engines of TP 2 synced by ipc from megatron-core trainers
(Ray actors on gloo), each engine TP rank handed the shared-memory bucket copy of the trainer rank on its own modeled
device (`SLUICE_PLANNED_DEVICES`, as the launcher sets it for `make rehearse`): bit-identical on every engine rank;
a mapping that would hand a rank another GPU's handle is refused by the engine, as CUDA would; 200 syncs leave the
sources' buffers, the entries they make and the engines' mappings flat.

In `make test`, smaller than the issue's 4 engines from TP 2 x DP 4 (that one is marked long: 16 processes on 2
shared cores): 2 engines of TP 2 from TP 2 x DP 2 prove per-GPU sourcing (four sources, three of them receiving
copies), and 1 engine of TP 2 from PP 2 and from EP 2 trainers the same over the other layouts."""
from __future__ import annotations

import os

import pytest
import torch

from glue.loop.config import SyncConfig
from glue.trainer.config import TrainerConfig
from helpers.engines import call
from loss import LossConfig
from weight_sync.bridge import WeightSyncError, make_bridge
from weight_sync.process_group import PLANNED_DEVICES

STRICT = ("--sglang-strict", "--tp-size", "2")


def bundles(first: int) -> str:
    return f"cpu bundle {first},cpu bundle {first + 1}"


@pytest.fixture(scope="module")
def ray_session():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def start_trainer(model_dir: str, **layout):
    """A trainer whose rank r stands on `cpu bundle r`, as the launcher places colocated ranks."""
    from glue.trainer.group import TrainerGroup

    cfg = TrainerConfig(lr=1e-2, **layout)
    options = [{"num_cpus": 1, "runtime_env": {"env_vars": {PLANNED_DEVICES: f"cpu bundle {r}"}}}
               for r in range(cfg.world_size)]
    return TrainerGroup(model_dir, cfg, LossConfig(), actor_options=options)


def start_engine(engine_processes, model_dir: str, first_bundle: int) -> str:
    """A strict TP 2 engine whose ranks stand on bundles `first_bundle` and the next."""
    os.environ[PLANNED_DEVICES] = bundles(first_bundle)
    try:
        return engine_processes.start(model_dir, *STRICT)
    finally:
        del os.environ[PLANNED_DEVICES]


def same_gpu(urls: list[str]):
    """The plan's mapping for engine i on bundles 2i, 2i+1: its TP ranks read trainer ranks 2i, 2i+1."""
    return lambda url: [2 * urls.index(url), 2 * urls.index(url) + 1]


def checker_of(trainer, model_dir: str) -> list[dict[str, str]]:
    """What SGLang's /weights_checker must report, per TP rank, for an engine holding the trainer's weights."""
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.sglang_layout import checker_ranks

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = trainer.full_hf_state()
    missing = [name for name in model.state_dict() if name not in state and name != "lm_head.weight"]
    assert not missing, missing
    model.load_state_dict(state, strict=False)
    return [rank["checksums"] for rank in checker_ranks(model, 2)]


def engine_checksums(url: str) -> list[dict[str, str]]:
    status, checked = call(url, "/weights_checker", {"action": "checksum"})
    assert status == 200, checked
    return [rank["checksums"] for rank in checked["ranks"]]


def sluice_segments() -> dict[str, int]:
    return {f: os.path.getsize(f"/dev/shm/{f}") for f in os.listdir("/dev/shm") if f.startswith("sluice-")}


def mapped_segments(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("/dev/shm/sluice-" in line for line in f)


def test_two_tp2_engines_from_a_tp2_dp2_trainer_read_every_rank_from_their_own_gpu_bit_identical_200_times(
        ray_session, engine_processes, tiny_model_dir, tmp_path_factory):
    from glue.embedded_engine.tiny_model import save_tiny_model

    trainer_dir = save_tiny_model(tmp_path_factory.mktemp("seed8"), seed=8)
    trainer = start_trainer(trainer_dir, tensor_model_parallel_size=2, data_parallel_size=2)
    try:
        urls = [start_engine(engine_processes, tiny_model_dir, 2 * i) for i in range(2)]
        engine_pids = [p.pid for p in engine_processes.procs[-2:]]
        expected = checker_of(trainer, trainer_dir)
        assert engine_checksums(urls[0]) != expected
        before = sluice_segments()
        bridge = make_bridge(SyncConfig(transport="ipc", bucket_bytes=100_000, pipeline=True), source=trainer,
                             engine_urls=urls, engine_tp_size=2, ipc_sources=same_gpu(urls))
        try:
            bridge.sync(1)
            for url in urls:  # every rank of every engine holds the trainer's weights, bit for bit
                assert call(url, "/model_info", method="GET")[1]["weight_version"] == "1"
                assert engine_checksums(url) == expected
            first = sluice_segments()
            # four sources (trainer ranks 0-3, one per engine rank's device), two pipelined buffers each
            assert len(first) == len(before) + 8 and bridge.last_sync["buckets"] >= 3
            mapped = [mapped_segments(pid) for pid in engine_pids]
            assert mapped == [4, 4]  # each engine maps its two ranks' sources' two buffers, nothing more
            for version in range(2, 201):
                bridge.sync(version)
            assert sluice_segments() == first and [mapped_segments(pid) for pid in engine_pids] == mapped
            assert call(urls[1], "/model_info", method="GET")[1]["weight_version"] == "200"
            assert engine_checksums(urls[1]) == expected
        finally:
            bridge.close()
        assert sluice_segments() == before  # closing the channel unlinks every source's segments
    finally:
        trainer.shutdown()


@pytest.mark.long
def test_four_tp2_engines_from_a_tp2_dp4_trainer_hold_its_weights_bit_for_bit_on_all_eight_ranks(
        ray_session, engine_processes, tiny_model_dir, tmp_path_factory):
    """The issue's shape (`make test-long`: 8 trainer ranks and 8 engine ranks take about 100 s on 2 cores): every
    engine rank reads the copy of the trainer rank on its own device."""
    from glue.embedded_engine.tiny_model import save_tiny_model

    trainer_dir = save_tiny_model(tmp_path_factory.mktemp("seed10"), seed=10)
    trainer = start_trainer(trainer_dir, tensor_model_parallel_size=2, data_parallel_size=4)
    try:
        urls = [start_engine(engine_processes, tiny_model_dir, 2 * i) for i in range(4)]
        expected = checker_of(trainer, trainer_dir)
        bridge = make_bridge(SyncConfig(transport="ipc", bucket_bytes=100_000), source=trainer, engine_urls=urls,
                             engine_tp_size=2, ipc_sources=same_gpu(urls))
        try:
            bridge.sync(1)
        finally:
            bridge.close()
        assert [engine_checksums(url) for url in urls] == [expected] * 4
    finally:
        trainer.shutdown()


def test_a_mapping_that_hands_an_engine_rank_another_devices_copy_is_refused_and_an_unreached_engine_gets_disk(
        ray_session, engine_processes, tiny_model_dir, tmp_path_factory):
    """Today's single source (trainer rank 0 for every rank) would fail on GPUs for rank 1: it fails here too. The
    plan's mapping for a TP 2 trainer and two TP 2 engines: engine 0 by ipc from ranks 0 and 1, engine 1 (bundles 2-3,
    no trainer rank there) by disk, in the same sync."""
    from glue.embedded_engine.tiny_model import save_tiny_model

    trainer_dir = save_tiny_model(tmp_path_factory.mktemp("seed9"), seed=9)
    trainer = start_trainer(trainer_dir, tensor_model_parallel_size=2)
    try:
        urls = [start_engine(engine_processes, tiny_model_dir, 2 * i) for i in range(2)]
        bridge = make_bridge(SyncConfig(transport="ipc", bucket_bytes=100_000), source=trainer, engine_urls=urls[:1],
                             engine_tp_size=2)  # no ipc_sources: rank 0 serves both ranks
        try:
            with pytest.raises(WeightSyncError, match=r"serialized_named_tensors\[1\] was made on cpu bundle 0, but TP "
                                                      "rank 1 stands on cpu bundle 1"):
                bridge.sync(1)
        finally:
            bridge.close()
        assert call(urls[0], "/model_info", method="GET")[1]["weight_version"] != "1"
        bridge = make_bridge(SyncConfig(transport="ipc", bucket_bytes=100_000), source=trainer, engine_urls=urls,
                             engine_tp_size=2, ipc_sources=lambda url: [0, 1] if url == urls[0] else None,
                             disk_dir=str(tmp_path_factory.mktemp("weights")))
        try:
            bridge.sync(2)
        finally:
            bridge.close()
        expected = checker_of(trainer, trainer_dir)
        for url in urls:
            assert call(url, "/model_info", method="GET")[1]["weight_version"] == "2"
            assert engine_checksums(url) == expected
    finally:
        trainer.shutdown()


@pytest.mark.long  # second variants of the TP 2 x DP 2 sync above (~10 s each)
@pytest.mark.parametrize("layout, model", [({"pipeline_model_parallel_size": 2}, "tiny_model_dir"),
                                           ({"data_parallel_size": 2, "expert_model_parallel_size": 2},
                                            "tiny_moe_model_dir")])
def test_pipeline_and_expert_parallel_trainers_serve_each_engine_rank_from_its_own_device(
        ray_session, engine_processes, request, tmp_path_factory, layout, model):
    import shutil

    model_dir = request.getfixturevalue(model)
    trainer_dir = str(tmp_path_factory.mktemp("trainer") / "model")
    shutil.copytree(model_dir, trainer_dir)
    trainer = start_trainer(trainer_dir, **layout)
    try:
        url = start_engine(engine_processes, model_dir, 0)
        reference = engine_processes.start(model_dir, *STRICT)  # synced by disk, the reference path
        from helpers.trainer import make_batch

        trainer.train_step(make_batch())  # weights the engines do not hold
        before = engine_checksums(url)
        for transport, urls, sources in (("ipc", [url], lambda _: [0, 1]), ("disk", [reference], None)):
            bridge = make_bridge(SyncConfig(transport=transport, bucket_bytes=100_000), source=trainer,
                                 engine_urls=urls, engine_tp_size=2, ipc_sources=sources,
                                 disk_dir=str(tmp_path_factory.mktemp("weights")))
            try:
                bridge.sync(trainer.version)
            finally:
                bridge.close()
        assert engine_checksums(url) == engine_checksums(reference) != before  # every rank, bit for bit
    finally:
        trainer.shutdown()


def test_a_source_refills_a_buffer_only_after_every_engine_rank_answered_the_bucket_it_held(
        engine_processes, tiny_model_dir, tmp_path_factory, monkeypatch):
    """Pipelined (two buffers), bucket k+2 goes into bucket k's buffer: never before both TP ranks of both engines
    have answered bucket k (their answer is the release: the engine has copied it out)."""
    import threading
    import time

    import weight_sync.ipc_transport as ipc_transport
    from helpers.weights import hf_model, source_of

    urls = [engine_processes.start(tiny_model_dir, *STRICT) for _ in range(2)]
    events: list[tuple[float, str, int]] = []
    lock, answered = threading.Lock(), {url: 0 for url in urls}
    real_call = ipc_transport.call_update

    def reading(url, route, payload, timeout_s, key):
        answer = real_call(url, route, payload, timeout_s, key)
        with lock:
            events.append((time.perf_counter(), "answered", answered[url]))
            answered[url] += 1
        return answer

    class Recorded:  # the source seam, recording when each bucket is packed
        def __init__(self, source):
            self.source = source

        def __getattr__(self, name):
            return getattr(self.source, name)

        def send_weight_bucket(self, channel, index):
            events.append((time.perf_counter(), "packing", index))
            return self.source.send_weight_bucket(channel, index)

    monkeypatch.setattr(ipc_transport, "call_update", reading)
    model, _ = hf_model(tmp_path_factory, 12)
    bridge = make_bridge(SyncConfig(transport="ipc", bucket_bytes=40_000, pipeline=True),
                         source=Recorded(source_of(model)), engine_urls=urls, engine_tp_size=2)
    try:
        bridge.sync(1)
    finally:
        bridge.close()
    buckets = len(bridge.layouts)
    assert buckets >= 4
    for when, kind, index in events:
        if kind == "packing" and index >= 2:
            done = [t for t, k, i in events if k == "answered" and i == index - 2 and t < when]
            assert len(done) == len(urls), f"bucket {index} was packed before every engine answered bucket {index - 2}"
