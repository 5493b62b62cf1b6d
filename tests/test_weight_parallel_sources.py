"""Parallel weight sources (issue 25 item 2), for real: a megatron-core trainer on Ray actors at PP=2 and at EP=2
syncs embedded engines (and SGLang-strict ones) over gloo, from trainer rank 0 alone and from one source per pipeline
stage / expert group, each through its own weight group; the engines end with bit-identical weights. An engine's
refusal inside a parallel transfer surfaces at once, every source leaves its broadcast, and the next sync works. The
groups `--dry-run` plans from config.json are the ones the bridge builds (issue 38 item 6)."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from glue.loop.config import SyncConfig
from glue.embedded_engine.tiny_model import save_tiny_model
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from weight_sync.bridge import WeightSyncError, make_bridge
from weight_sync.engine_calls import post_json, weight_checksums
from weight_sync.parallel import ParallelBroadcastTransport, interleave

BUCKET = 12 << 10  # several buckets per source


def test_engines_take_every_sources_buckets_in_one_round_robin_order():
    assert interleave([3, 1, 2]) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]
    assert interleave([]) == []


def test_parallel_sources_need_the_broadcast_transport():
    with pytest.raises(ValueError, match="sync.sources: parallel needs sync.transport: broadcast"):
        SyncConfig(transport="ipc", sources="parallel")
    with pytest.raises(ValueError, match="sync.sources must be"):
        SyncConfig(sources="many")


@pytest.fixture
def ray_session():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def post(url: str, route: str, payload: dict | None) -> dict:
    return post_json(f"{url}{route}", payload, 30)


def start_trainer_and_engines(tmp_path, engine_starts, family: str, **layout):
    """The trainer (seed-5 weights) and the engines, started side by side: `engine_starts` are calls that each start
    one engine and return its URL."""
    from glue.trainer.group import TrainerGroup

    model = save_tiny_model(str(tmp_path / family), family=family, seed=5)
    with ThreadPoolExecutor(max_workers=len(engine_starts)) as pool:
        engines = [pool.submit(start) for start in engine_starts]
        trainer = TrainerGroup(model, TrainerConfig(micro_batch_size=2, num_cpus_per_worker=1, **layout),
                               LossConfig())
        try:
            return trainer, [engine.result() for engine in engines]
        except BaseException:
            trainer.shutdown()
            raise


def bridges(trainer, one_urls, parallel_urls, **cfg):
    one = make_bridge(SyncConfig(sources="one", bucket_bytes=BUCKET, timeout_s=120, **cfg), source=trainer,
                      engine_urls=one_urls)
    parallel = make_bridge(SyncConfig(bucket_bytes=BUCKET, timeout_s=120, **cfg), source=trainer,
                           engine_urls=parallel_urls)  # sources null: parallel, the layout has two
    assert not isinstance(one.transport, ParallelBroadcastTransport)
    assert isinstance(parallel.transport, ParallelBroadcastTransport)
    assert parallel.transport.ranks == [0, 1]  # two source ranks, each with its own named group
    assert all(len(part.layouts) >= 2 for part in parallel.transport.parts)
    names = [name for part in parallel.transport.parts for name in part.groups.values()]
    assert len(set(names)) == 2 and names[0].startswith("sluice_w_s0_") and names[1].startswith("sluice_w_s1_")
    assert sorted(n for b in one.layouts for n in b.names) == sorted(n for b in parallel.layouts for n in b.names)
    assert sum(b.nbytes for b in one.layouts) == sum(b.nbytes for b in parallel.layouts)
    return one, parallel


def assert_the_plan_lists_the_bridges_groups(model: str, overrides: list[str], trainer, bridge) -> None:
    """`--dry-run`'s weight groups for this layout, planned from config.json alone, are the ones the bridge built
    from the running trainer: the same sources, each with the ranks producing its tensors, its tensors in the order
    they are sent, its group's name and its members' ranks."""
    from glue.trainer.model import read_hf_config
    from launch.config import load_config
    from launch.plan.run_plan import resolve
    from launch.plan.weight_groups import plan_weight_groups

    cfg, plan = resolve(load_config(None, [f"model.path={model}", "rollout.num_engines=1", "run.ray_num_cpus=8",
                                           *overrides]))
    groups = plan_weight_groups(cfg, plan, read_hf_config(model))
    assert [g.source.rank for g in groups] == bridge.transport.ranks == [0, 1]
    for group, part in zip(groups, bridge.transport.parts):
        assert group.source.members == trainer._members[group.source.rank]
        assert list(group.source.names) == [name for layout in part.layouts for name in layout.names]
        assert all(name.startswith(f"{group.prefix}_") for name in part.groups.values())
        assert [m.rank for m in group.members] == list(range(1 + part.ranks_per_engine))  # the source, one engine


@pytest.mark.slow
def test_pp2_parallel_sources_give_embedded_engines_the_one_source_weights_and_a_refusal_surfaces_at_once(
        tmp_path, ray_session, engine_processes):
    start = save_tiny_model(str(tmp_path / "start"), family="qwen3", seed=0)  # not the trainer's weights
    bad = save_tiny_model(str(tmp_path / "bad"), family="qwen3", vocab_size=48)  # not the trainer's shapes
    trainer, (one_url, parallel_url, bad_url) = start_trainer_and_engines(
        tmp_path, [lambda model=model: engine_processes.start(model) for model in (start, start, bad)], "qwen3",
        pipeline_model_parallel_size=2)
    try:
        before = weight_checksums(parallel_url, 30)
        # verify full: every engine tensor equals the trainer's, by HF name
        one, parallel = bridges(trainer, [one_url], [parallel_url], verify="full")
        try:
            assert_the_plan_lists_the_bridges_groups(str(tmp_path / "qwen3"), [
                "model.tiny.family=qwen3", "trainer.pipeline_model_parallel_size=2"], trainer, parallel)
            one.sync(1)
            parallel.sync(1)
            after = weight_checksums(parallel_url, 30)
            assert after == weight_checksums(one_url, 30)  # bit-identical to the single-source result
            assert after != before
            assert parallel.last_sync["buckets"] == len(parallel.layouts) and parallel.last_sync["bytes"] > 0
        finally:
            one.close()
            parallel.close()
        # an engine whose model does not fit refuses the first bucket it receives: the sync fails at once with its
        # message (every source leaves its broadcast), the spent groups are dropped, and without it the next sync
        # builds fresh groups and goes through
        mixed = make_bridge(SyncConfig(bucket_bytes=BUCKET, timeout_s=120, verify="full"), source=trainer,
                            engine_urls=[parallel_url, bad_url])
        try:
            t0 = time.perf_counter()
            with pytest.raises(WeightSyncError, match=bad_url):
                mixed.sync(2)
            assert time.perf_counter() - t0 < 30, "the refusal waited for a timeout instead of surfacing at once"
            assert all(not part.groups for part in mixed.transport.parts)
            mixed.remove_engine(bad_url)
            mixed.sync(3)
            assert weight_checksums(parallel_url, 30) == after
            assert post(parallel_url, "/model_info", None)["weight_version"] == "3"
        finally:
            mixed.close()
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_ep2_parallel_sources_give_sglang_strict_engines_the_one_source_weights(tmp_path, ray_session,
                                                                               engine_processes):
    start = save_tiny_model(str(tmp_path / "start"), family="qwen3_moe", seed=0)
    trainer, (one_url, parallel_url) = start_trainer_and_engines(
        tmp_path, [lambda: engine_processes.start_sglang_stand_in(start)] * 2, "qwen3_moe", data_parallel_size=2,
        expert_model_parallel_size=2)
    try:
        before = post(parallel_url, "/weights_checker", {"action": "checksum"})["per_engine_checksum"]
        one, parallel = bridges(trainer, [one_url], [parallel_url], verify="auto")  # strict: versions only
        try:
            assert_the_plan_lists_the_bridges_groups(str(tmp_path / "qwen3_moe"), [
                "cluster.engine=sglang_strict", "trainer.data_parallel_size=2",
                "trainer.expert_model_parallel_size=2"], trainer, parallel)
            one.sync(1)
            parallel.sync(1)
            sums = [post(url, "/weights_checker", {"action": "checksum"}) for url in (one_url, parallel_url)]
            assert sums[0]["ranks"] == sums[1]["ranks"]  # SGLang's per-tensor checksums, bit-identical
            assert sums[1]["per_engine_checksum"] != before
            assert post(parallel_url, "/model_info", None)["weight_version"] == "1"
        finally:
            one.close()
            parallel.close()
    finally:
        trainer.shutdown()


def plan_of(coords: list, producers: list) -> list:
    """The sources (`group_sources`, what `WeightStream.source_plan` answers) over hand-written coordinates and
    producers (one rule, one HF name each)."""
    from glue.trainer.weight_stream import group_sources

    names = [f"w{i}" for i in range(len(producers))]
    return group_sources(names, {name: (i,) for i, name in enumerate(names)}, producers, coords)


def test_each_stage_and_expert_group_is_a_source_unless_their_ranks_overlap():
    from glue.trainer.weight_stream import Coords, Producer, SourcePart

    # PP=2 x EP=2, TP=1: dense stage s led by (pp s, ep 0); the ep-1 experts of stage s by (pp s, ep 1)
    coords = [Coords(pp=pp, tp=0, dp=ep, ep=ep, etp=0, edp=0) for pp in (0, 1) for ep in (0, 1)]
    producers = [Producer(stage=0, ep_rank=None, leader=0), Producer(stage=0, ep_rank=1, leader=1),
                 Producer(stage=1, ep_rank=None, leader=2), Producer(stage=1, ep_rank=1, leader=3),
                 Producer(stage=1, ep_rank=0, leader=2)]
    assert plan_of(coords, producers) == [SourcePart(rank=0, members=(0,), names=("w0",)),
                                          SourcePart(rank=1, members=(1,), names=("w1",)),
                                          SourcePart(rank=2, members=(2,), names=("w2", "w4")),
                                          SourcePart(rank=3, members=(3,), names=("w3",))]
    # TP=2 x EP=2 (expert TP 1) x DP=2: the dense TP group {0, 1} holds the ep-1 leader's rank 1, so one source
    # (rank 0; rank 1 sends it its experts point to point) instead of two that would share rank 1
    coords = [Coords(pp=0, tp=tp, dp=dp, ep=tp, etp=0, edp=dp) for dp in (0, 1) for tp in (0, 1)]
    producers = [Producer(stage=0, ep_rank=None, leader=0), Producer(stage=0, ep_rank=1, leader=1),
                 Producer(stage=0, ep_rank=0, leader=0)]
    assert plan_of(coords, producers) == [SourcePart(rank=0, members=(0, 1), names=("w0", "w1", "w2"))]


def test_a_tensor_of_every_expert_is_sent_by_one_source_that_its_ep_ranks_send_their_slices_to():
    from glue.trainer.weight_stream import Coords, Producer, SourcePart, group_sources

    # EP=2, TP=1, DP=2: gpt-oss's `mlp.experts.gate_up_proj` holds experts of both EP ranks (leaders 0 and 1), which
    # would otherwise be two sources
    coords = [Coords(pp=0, tp=0, dp=ep, ep=ep, etp=0, edp=0) for ep in (0, 1)]
    producers = [Producer(stage=0, ep_rank=None, leader=0), Producer(stage=0, ep_rank=0, leader=0),
                 Producer(stage=0, ep_rank=1, leader=1)]
    assert plan_of(coords, producers[1:]) == [SourcePart(rank=0, members=(0,), names=("w0",)),
                                              SourcePart(rank=1, members=(1,), names=("w1",))]
    fused = group_sources(["norm", "experts.gate_up_proj"], {"norm": (0,), "experts.gate_up_proj": (1, 2)},
                          producers, coords)
    assert fused == [SourcePart(rank=0, members=(0, 1), names=("norm", "experts.gate_up_proj"))]


@pytest.mark.slow
def test_a_gpt_oss_trainer_at_ep2_gives_an_engine_its_fused_experts_whole_from_both_ranks_slices(
        tmp_path, ray_session, engine_processes):
    from weight_sync.buckets import tensor_checksum

    start = save_tiny_model(str(tmp_path / "start"), family="gpt_oss", seed=0)  # not the trainer's weights
    trainer, (url,) = start_trainer_and_engines(tmp_path, [lambda: engine_processes.start(start)], "gpt_oss",
                                                data_parallel_size=2, expert_model_parallel_size=2)
    try:
        before = weight_checksums(url, 30)
        # verify full: every engine tensor equals the trainer's, by HF name (`mlp.experts.gate_up_proj` holds experts
        # 0-1 from EP rank 0 and 2-3 from EP rank 1)
        bridge = make_bridge(SyncConfig(bucket_bytes=BUCKET, timeout_s=120, verify="full"), source=trainer,
                             engine_urls=[url])
        try:
            bridge.sync(1)
            after = weight_checksums(url, 30)
            assert after != before
            # and against the trainer's weights as the converter assembles them (megatron_to_hf, tested bit-exact)
            assert after == {name: tensor_checksum(t) for name, t in trainer.full_hf_state().items()}
            assert post(url, "/model_info", None)["weight_version"] == "1"
        finally:
            bridge.close()
    finally:
        trainer.shutdown()
