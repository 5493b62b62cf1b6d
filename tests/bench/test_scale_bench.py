"""`make bench` scale section: what grows with the run's size, measured here, written to bench-results/scale.json
one key per test (a test rewrites only its own key): `driver_ratio` (bytes the driver serialises per training step
over the batch's bytes, per trainer world size), `health_sweep_s` with its engines and timeout (one deep health
sweep over many stand-in engines, some hung), `sizes` (memory during a sync) and `sources` (a sync from one source
and from parallel sources)."""
from __future__ import annotations

import os
from typing import Any

import pytest

from helpers.bench import write_section

pytestmark = pytest.mark.bench


def test_driver_ratio_per_world_size(tmp_path_factory):
    """A real TrainerGroup (tiny Qwen2, DP = world size) trains one step; every byte the driver hands to Ray's
    serializer during it is counted."""
    import ray
    from ray._private.worker import global_worker

    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.trainer.config import TrainerConfig
    from glue.trainer.group import TrainerGroup
    from loss import LossConfig
    from helpers.trainer import make_batch, serialised_bytes

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


def test_health_sweep_over_64_stand_in_engines_with_4_hung():
    """One deep health sweep of the fleet watch over 64 stand-in engines speaking SGLang's /health_generate, 4 of
    them hung; target: at most 2 x the probe timeout."""
    import time

    from glue.fleet.watch import FleetWatch
    from helpers.fleet import StandInFleet

    fleet = StandInFleet(64, hung={5, 21, 42, 60}, hang_s=60)
    try:
        watch = FleetWatch(fleet, repair=lambda index: None, health_timeout_s=2.0, health_failures=1)
        t0 = time.perf_counter()
        hung = watch._hung_engines()
        sweep_s = time.perf_counter() - t0
    finally:
        fleet.close()
    write_section({"health_sweep_s": round(sweep_s, 3), "health_timeout_s": watch.health_timeout_s,
                   "health_engines": len(fleet.engine_urls), "health_hung_found": sorted(hung)})
    assert sorted(hung) == [5, 21, 42, 60] and sweep_s <= 2 * watch.health_timeout_s


MOE_SIZES = {  # the same tiny Qwen3-MoE with 8, 16 and 32 experts (most of an MoE's bytes): 15, 28 and 53 MB
    f"{n}_experts": dict(family="qwen3_moe", vocab_size=512, hidden_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, intermediate_size=1024, num_experts=n) for n in (8, 16, 32)
}
SYNC_SIZES = ("8_experts", "32_experts")  # 3.5 x apart; a third size added a minute and nothing the two miss
SYNC_BUCKET_BYTES = 1 << 20  # 2-7 % of these models, as 512 MiB-1 GiB buckets are of a 15-60 GB one
MEASURED_SYNCS = 3  # after the first: each one's resident-memory growth is reported, the worst one kept


def _memory(actor, reset: bool) -> int:
    """The actor process's resident-memory high-water mark (VmHWM), or with `reset` its resident bytes now
    (VmRSS) after resetting the mark. The function is made here so Ray ships it by value."""
    import ray

    def read(worker, reset=reset):
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        key = "VmRSS:" if reset else "VmHWM:"
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    return ray.get(actor.__ray_call__.remote(read))


def _max_growth(group, step) -> int:
    """The most any trainer rank's resident memory grew during `step()` (VmHWM after minus VmRSS before)."""
    before = [_memory(a, reset=True) for a in group._actors]
    step()
    return max(_memory(a, reset=False) - b for a, b in zip(group._actors, before))


def _count_sync_tensors(actor) -> None:
    """From now on the actor's weight sends run inside one `TensorCensus` (tests/tensor_census.py): the bytes of
    the tensors a sync allocates, as `torch.cuda.max_memory_allocated` counts them on a GPU."""
    import ray

    from tensor_census import TensorCensus

    def arm(worker):
        sender = worker._weight_sender
        census, send = TensorCensus(), getattr(sender, "uncounted_send", sender.send)

        def counted(*args, **kwargs):
            with census:
                return send(*args, **kwargs)

        sender.send, sender.uncounted_send, sender.census = counted, send, census

    ray.get(actor.__ray_call__.remote(arm))


def _sync_tensors(actor) -> dict[str, int]:
    """The census of the actor's sends so far, and the bytes of its channels' bucket buffers (kept between
    syncs, allocated when a channel opens)."""
    import ray

    def read(worker):
        sender, census = worker._weight_sender, getattr(worker._weight_sender, "census", None)
        buffers = sum(b.numel() * b.element_size() for c in getattr(sender._sender, "channels", {}).values()
                      for b in getattr(c, "buffers", [])) if sender._sender is not None else 0
        return {"peak": census.peak if census else 0, "largest": census.largest if census else 0,
                "buffers": buffers}

    return ray.get(actor.__ray_call__.remote(read))


def _sync_memory(group, bridge, bucket: int) -> dict[str, Any]:
    """One bridge's figures: the first sync's growth (it also opens the channels and imports the sync's code), the
    growth of each of the next MEASURED_SYNCS syncs, then one more sync with the census armed (so its bookkeeping
    stays out of the growth figures)."""
    first = _max_growth(group, lambda: bridge.sync(1))
    each = [_max_growth(group, lambda v=v: bridge.sync(v)) for v in range(2, 2 + MEASURED_SYNCS)]
    for actor in group._actors:
        _count_sync_tensors(actor)
    bridge.sync(2 + MEASURED_SYNCS)
    counted = [_sync_tensors(a) for a in group._actors]
    tensor_peak, buffers = max(c["peak"] for c in counted), max(c["buffers"] for c in counted)
    return {"bucket_bytes": bucket, "biggest_bucket_bytes": max(b.nbytes for b in bridge.layouts),
            "max_rank_extra_bytes": max(each), "max_rank_extra_buckets": round(max(each) / bucket, 2),
            "max_rank_extra_each_sync": each,
            "max_rank_tensor_bytes": tensor_peak, "max_rank_tensor_buckets": round(tensor_peak / bucket, 2),
            "rank0_host_copy_bytes": max(c["largest"] for c in counted), "channel_buffer_bytes": buffers,
            "first_sync_extra_bytes": first}


SIZE_LAYOUTS = {  # EP=2 alone (dense weights whole on rank 0), and with TP=2 (dense weights gathered shard by shard)
    "ep2_dp2": {"data_parallel_size": 2, "expert_model_parallel_size": 2},
    "tp2_ep2": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
}


def test_sync_memory_per_model_size(tmp_path_factory, engine_processes):
    """Two-rank trainers on Ray (EP=2 x DP=2, and TP=2 x EP=2), one embedded engine, broadcast syncs in 1 MiB
    buckets from one source (rank 0 gathers what other ranks hold point to point) and from parallel sources, at
    two model sizes. Per row: the largest trainer rank's resident-memory growth during a sync after the first
    (VmHWM after minus VmRSS before, the worst of MEASURED_SYNCS; process-wide, so allocator, gloo and Ray count),
    the bytes of tensors a sync allocates held at once on the largest rank (`max_rank_tensor_bytes`, counted by
    TensorCensus: what max_memory_allocated is on a GPU) and the largest one of them (`rank0_host_copy_bytes`),
    the channel's bucket buffers (kept between syncs) and the first sync's growth (those buffers, the code it
    imports, the weight group's gloo context and threads: costs that do not come back); beside them,
    the growth of the whole-model gather the sync used before streaming (`full_hf_state`). Targets: tensors plus
    buffers <= 3 buckets, no copy larger than a bucket, resident growth growing less than half as fast as the
    model."""
    import ray
    import ray.cloudpickle

    import tensor_census
    from glue.loop.config import SyncConfig
    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.trainer.config import TrainerConfig
    from glue.trainer.group import TrainerGroup
    from loss import LossConfig
    from weight_sync.bridge import make_bridge

    ray.cloudpickle.register_pickle_by_value(tensor_census)  # the actors do not import from tests/
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for name in SYNC_SIZES:
            model = save_tiny_model(str(tmp_path_factory.mktemp(name)), seed=0, **MOE_SIZES[name])
            engine = engine_processes.start(model)
            for layout_name, layout in SIZE_LAYOUTS.items():
                group = TrainerGroup(model, TrainerConfig(micro_batch_size=2, num_cpus_per_worker=1, **layout),
                                     LossConfig())
                try:
                    model_bytes = sum(int(torch_numel(s)) * 4 for _, _, s in group.hf_weight_specs())
                    made = []
                    for sources in ("one", "parallel"):
                        bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=SYNC_BUCKET_BYTES,
                                                        sources=sources), source=group, engine_urls=[engine])
                        try:
                            figures = _sync_memory(group, bridge, SYNC_BUCKET_BYTES)
                        finally:
                            bridge.close()
                        made.append({"model": name, "layout": layout_name, "model_bytes": model_bytes,
                                     "sources": sources, **figures})
                    whole_gather_extra = _max_growth(group, group.full_hf_state)
                    rows += [{**row, "whole_gather_extra_bytes": whole_gather_extra} for row in made]
                finally:
                    group.shutdown()
    finally:
        ray.shutdown()
    write_section({"sizes": rows})
    for layout_name in SIZE_LAYOUTS:
        for sources in ("one", "parallel"):
            same = [r for r in rows if r["layout"] == layout_name and r["sources"] == sources]
            small, large = same[0], same[-1]
            growth = ((large["max_rank_extra_bytes"] - small["max_rank_extra_bytes"])
                      / (large["model_bytes"] - small["model_bytes"]))
            assert growth < 0.5, (layout_name, sources, growth, same)
    assert all(r["rank0_host_copy_bytes"] <= r["bucket_bytes"] for r in rows), rows
    assert all(r["max_rank_tensor_bytes"] + r["channel_buffer_bytes"] <= 3 * r["bucket_bytes"] for r in rows), rows


def torch_numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


SOURCE_LAYOUTS = {  # trainer layouts with two sources each, and a model big enough that a sync takes ~0.1 s here
    "pp2": ({"pipeline_model_parallel_size": 2},
            dict(family="qwen3", vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                 intermediate_size=1536)),
    "ep2": ({"data_parallel_size": 2, "expert_model_parallel_size": 2}, MOE_SIZES["16_experts"]),
}


SPLIT = ("stage_s", "transfer_s", "verify_s", "wire_s", "pack_s", "copy_in_s")  # a sync's figures kept per mode


def test_sync_from_one_source_and_from_parallel_sources(tmp_path_factory, engine_processes):
    """PP=2 and EP=2 trainers on Ray, one embedded engine: the same weights, in the same 4 MiB bucket size, synced
    from trainer rank 0 alone (`sync.sources: one`) and from one source per stage / expert group (`parallel`),
    alternately, 5 times each after one warm-up each; the medians of total_s, and the median syncs' splits (wire_s,
    pack_s: summed over buckets and, in parallel, over sources, so a source's wait for the engine to finish another
    source's bucket counts as wire). Target: parallel <= 0.8 x one source."""
    import statistics

    import ray

    from glue.loop.config import SyncConfig
    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.trainer.config import TrainerConfig
    from glue.trainer.group import TrainerGroup
    from loss import LossConfig
    from weight_sync.bridge import make_bridge

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    rows = {}
    try:
        for name, (layout, shape) in SOURCE_LAYOUTS.items():
            model = save_tiny_model(str(tmp_path_factory.mktemp(name)), seed=0, **shape)
            engine = engine_processes.start(model)
            group = TrainerGroup(model, TrainerConfig(micro_batch_size=2, num_cpus_per_worker=1, **layout),
                                 LossConfig())
            try:
                made = {mode: make_bridge(SyncConfig(sources=mode, bucket_bytes=4 << 20, verify="checksum"),
                                          source=group, engine_urls=[engine]) for mode in ("one", "parallel")}
                runs: dict[str, list[dict[str, float]]] = {"one": [], "parallel": []}
                parts = getattr(made["parallel"].transport, "parts", [])
                bytes_per_source = [sum(b.nbytes for b in part.layouts) for part in parts]
                try:
                    for round_ in range(6):
                        for mode, bridge in made.items():
                            figures = bridge.sync(round_)
                            if round_:
                                runs[mode].append(figures)
                finally:
                    for bridge in made.values():
                        bridge.close()
            finally:
                group.shutdown()
            row = {"bytes": int(runs["one"][0]["bytes"]), "sources": len(bytes_per_source),
                   "bytes_per_source": bytes_per_source, "buckets": int(runs["parallel"][0]["buckets"])}
            for mode, key in (("one", "one_source"), ("parallel", "parallel")):
                totals = [r["total_s"] for r in runs[mode]]
                median = sorted(runs[mode], key=lambda r: r["total_s"])[len(totals) // 2]
                row[f"{key}_s"] = round(statistics.median(totals), 4)
                row[f"{key}_all_s"] = [round(t, 4) for t in totals]
                row[f"{key}_split"] = {k: round(median[k], 4) for k in SPLIT}
            row["ratio"] = round(row["parallel_s"] / row["one_source_s"], 3)
            rows[name] = row
    finally:
        ray.shutdown()
    pp2 = rows["pp2"]
    write_section({"sources": {"one_source_s": pp2["one_source_s"], "parallel_s": pp2["parallel_s"],
                               "layouts": rows}})
    assert all(row["sources"] == 2 for row in rows.values()), rows
