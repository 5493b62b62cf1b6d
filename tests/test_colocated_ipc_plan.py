"""Issue 49, the plan: colocated engines sync by ipc with one source per GPU (every engine TP rank is handed the bucket
copy of the trainer rank on its own GPU), whatever the number of engines; the memory plan counts those copies; an
engine standing on GPUs without a trainer rank alone gets the weights by disk, and the plan says why."""
from __future__ import annotations

import pytest

from launch.config import ConfigError, load_config
from launch.plan.ipc_sources import describe_sources, ipc_sources, plan_sources
from launch.plan.memory_lines import check_memory, memory_plan
from launch.plan.run_plan import resolve
from launch.plan.weight_groups import weight_sync_plan

EIGHT_GPUS = ["cluster.gpus_per_node=8", "cluster.placement=colocated", "rollout.num_engines=4",
              "cluster.engine_tensor_parallel_size=2", "trainer.tensor_model_parallel_size=2",
              "trainer.data_parallel_size=4"]


def test_four_colocated_engines_of_tp2_each_read_every_rank_from_the_trainer_rank_on_its_gpu():
    cfg, plan = resolve(load_config(None, EIGHT_GPUS))
    assert cfg.sync.transport == "ipc" and plan.notes == [] and plan.transport_reason == ""
    assert plan_sources(plan) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for engine, ranks in zip(plan.engines, plan_sources(plan)):  # same GPU: the trainer rank's bundle is the engine's
        assert [plan.trainer[r].device for r in ranks] == engine.devices
    assert describe_sources(plan)[1] == ("engine 1: TP rank 0 <- trainer rank 2 (node 0 gpu 2), TP rank 1 <- trainer "
                                         "rank 3 (node 0 gpu 3)")
    shown = weight_sync_plan(cfg, plan)
    assert shown["sources"].startswith("one per GPU: trainer rank 0 gathers each bucket and broadcasts it to ranks 1-7")
    assert shown["bucket_copies"].startswith("8 GPU(s) hold 1 bucket buffer(s) of at most 313.6 KB")


def test_the_memory_plan_counts_the_bucket_copies_each_gpu_holds_from_the_first_sync_on():
    # tiny model: 78,400 fp32 parameters = 313,600 bytes; pipelined buckets of 100,000 bytes -> two buffers per GPU
    cfg, _ = resolve(load_config(None, EIGHT_GPUS + ["sync.pipeline=true", "sync.bucket_bytes=100000"]))
    assert memory_plan(cfg)["weight_sync"].startswith("ipc bucket buffers: 2 x 100 KB = 200 KB on each GPU with an "
                                                      "engine rank")
    assert "of training state + ipc bucket buffers 200 KB + about" in check_memory(cfg)
    disk, _ = resolve(load_config(None, EIGHT_GPUS + ["sync.transport=disk"]))
    assert "weight_sync" not in memory_plan(disk) and "ipc" not in check_memory(disk)


def test_the_bucket_copies_kept_beside_a_colocated_engine_come_out_of_its_kv_pool():
    # 78,400 parameters served in bf16 over engine TP 2 = 78,400 bytes of weights per engine GPU; 250,000 bytes of
    # mem_fraction_static leave 171,600 for the KV pool by disk, and nothing once 200,000 bytes of buffers stay there
    sglang = ["cluster.engine=sglang", "sync.pipeline=true", "sync.bucket_bytes=100000"]
    roomy, _ = resolve(load_config(None, EIGHT_GPUS + sglang + ["sglang.mem_fraction_static=0.5"]))
    line = memory_plan(roomy)["engines"]
    assert "KV pool 40 GB (mem_fraction_static x 80 GB - weights; sglang.mem_fraction_static 0.5 - ipc bucket " \
           "buffers 200 KB)" in line, line
    tight = EIGHT_GPUS + sglang + ["sglang.mem_fraction_static=0.000003125"]
    disk, _ = resolve(load_config(None, tight + ["sync.transport=disk"]))
    assert "KV pool 171.6 KB" in memory_plan(disk)["engines"] and "ipc" not in memory_plan(disk)["engines"]
    check_memory(disk)
    ipc, _ = resolve(load_config(None, tight))
    with pytest.raises(ConfigError, match=r"leaves no KV pool \(sglang.mem_fraction_static 3.125e-06 - ipc bucket "
                                          r"buffers 200 KB"):
        check_memory(ipc)


def test_an_engine_on_gpus_without_a_trainer_rank_alone_gets_disk_and_the_plan_says_why():
    # trainer TP 2 on GPUs 0-1; engines 0 and 1 of TP 2 on GPUs 0-3: engine 1 shares no GPU with a trainer rank
    overrides = ["cluster.gpus_per_node=4", "cluster.placement=colocated", "rollout.num_engines=2",
                 "cluster.engine_tensor_parallel_size=2", "trainer.tensor_model_parallel_size=2"]
    for explicit in ([], ["sync.transport=ipc"]):
        cfg, plan = resolve(load_config(None, overrides + explicit))
        assert cfg.sync.transport == "ipc" and plan.notes == []
        assert plan.transport_reason == ("ipc, and disk for engine(s) 1: they stand on devices without a trainer rank "
                                         "(trainer 2 ranks, engines 4 GPUs), which no CUDA IPC handle reaches")
        shown = weight_sync_plan(cfg, plan)
        assert shown["transport"] == plan.transport_reason
        assert shown["ipc_handles"] == ["engine 0: TP rank 0 <- trainer rank 0 (node 0 gpu 0), TP rank 1 <- trainer "
                                        "rank 1 (node 0 gpu 1)",
                                        "engine 1: by disk (no trainer rank on node 0 gpu 2, node 0 gpu 3)"]


def test_devices_matter_on_gpus_and_where_cpu_bundles_stand_for_them_and_not_on_plain_cpu():
    assert ipc_sources([0, 1], [[0, 1], [2, 3]], devices_matter=True) == [[0, 1], None]
    assert ipc_sources([0, 1], [[0, 1], [2, 3]], devices_matter=False) == [[0, 1], [0, 0]]  # shared memory reaches
    strict = ["cluster.engine=sglang_strict", "cluster.placement=colocated", "rollout.num_engines=2",
              "cluster.engine_tensor_parallel_size=2", "trainer.tensor_model_parallel_size=2",
              "trainer.data_parallel_size=2"]
    cfg, plan = resolve(load_config(None, strict))
    assert plan.models_devices and cfg.sync.transport == "ipc"
    assert describe_sources(plan) == ["engine 0: TP rank 0 <- trainer rank 0 (cpu bundle 0), TP rank 1 <- trainer rank 1 "
                                      "(cpu bundle 1)", "engine 1: TP rank 0 <- trainer rank 2 (cpu bundle 2), TP rank 1 "
                                      "<- trainer rank 3 (cpu bundle 3)"]


def test_an_engine_past_the_planned_ones_has_no_ipc_source_so_it_gets_disk_and_a_replacement_keeps_its_slots():
    from launch.plan.ipc_sources import slot_sources

    urls = ["http://a", "http://b"]
    sources_of = slot_sources([[0, 1], [2, 3]], urls)
    assert sources_of("http://b") == [2, 3]
    urls[1] = "http://b2"  # a replacement takes its slot's url (RolloutFleet.replace_engine): the lookup is live
    assert sources_of("http://b2") == [2, 3]
    urls.append("http://late")  # RolloutFleet.add_engine: past the plan, on no planned GPU
    assert sources_of("http://late") is None
