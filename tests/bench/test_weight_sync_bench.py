"""`make bench`: weight-sync throughput for a ~220 MB Qwen2 into a real embedded engine, per transport, against a raw
gloo broadcast of one flat buffer of the same bytes between the same two processes. Writes
bench-results/weight_sync.json (bytes, seconds, GB/s, ratio_to_raw, and where the time goes)."""
from __future__ import annotations

import json
import multiprocessing
import statistics
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, free_port

pytestmark = pytest.mark.bench

MODEL = dict(family="qwen2", vocab_size=16000, hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=2,
             intermediate_size=2816)
REPEATS = 5


def engine_host(model_dir: str, port: int, raw_port: int, nbytes: int, repeats: int) -> None:
    """The engine's process: first the raw baseline's receiving side, then the embedded engine itself."""
    torch.set_num_threads(1)
    from glue.embedded_engine.engine import build_engine, serve
    from weight_sync.broadcast import broadcast_bucket
    from weight_sync.process_group import create_process_group, destroy_process_group

    group = create_process_group(master_address="127.0.0.1", master_port=raw_port, rank=1, world_size=2,
                                 group_name="raw", timeout_s=120)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats + 1):
        broadcast_bucket(group, buffer, src=0)
    destroy_process_group(group)
    server = build_engine(model_path=model_dir, host="127.0.0.1", port=port, seed=0, max_running_requests=4,
                          num_threads=1, weight_version="0", weight_sync_timeout_s=300)
    serve(server, host="127.0.0.1", port=port)


def raw_broadcast_seconds(raw_port: int, nbytes: int, repeats: int) -> float:
    """Median time of one broadcast of a preallocated flat buffer of `nbytes` (the first, warm-up, not counted)."""
    from weight_sync.broadcast import broadcast_bucket
    from weight_sync.process_group import create_process_group, destroy_process_group

    group = create_process_group(master_address="127.0.0.1", master_port=raw_port, rank=0, world_size=2,
                                 group_name="raw", timeout_s=120)
    flat = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        broadcast_bucket(group, flat, src=0)
        times.append(time.perf_counter() - t0)
    destroy_process_group(group)
    return statistics.median(times[1:])


def wait_healthy(url: str, proc, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.is_alive(), "the engine process exited during start-up"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"engine at {url} not healthy after {timeout_s} s")


def time_bridge(url: str, source, tmp_path: Path, **sync) -> dict:
    from glue.config import SyncConfig
    from weight_sync.bridge import make_bridge

    bridge = make_bridge(SyncConfig(disk_dir=str(tmp_path / "ckpt"), **sync), source=source, engine_urls=[url])
    try:
        bridge.sync(1)  # warm-up: buffers and segments are allocated here, once
        runs = [dict(bridge.sync(v)) for v in range(2, REPEATS + 2)]
    finally:
        bridge.close()
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return median


def summarize(t: dict, nbytes: int, raw_s: float, settings: dict) -> dict:
    return {"bytes": nbytes, "seconds": round(t["total_s"], 4), "gb_per_s": round(nbytes / t["total_s"] / 1e9, 3),
            "ratio_to_raw": round(raw_s / t["total_s"], 3), "buckets": int(t["buckets"]),
            "breakdown_s": {k: round(t[k], 4) for k in ("stage_s", "transfer_s", "verify_s")}, "settings": settings}


def start_trainer_rank(model_dir: str):
    """A one-rank megatron-core trainer in this process, loaded from `model_dir`: a weight source like the run's."""
    from glue.trainer.config import TrainerConfig
    from glue.trainer.worker import TrainerWorker
    from loss import LossConfig

    worker = TrainerWorker(model_path=model_dir, cfg=TrainerConfig(), loss_cfg=LossConfig(), rank=0, world_size=1)
    worker.initialize("127.0.0.1", free_port())
    return worker


def test_weight_sync_throughput_per_transport_against_a_raw_gloo_broadcast(tmp_path):
    from safetensors.torch import load_file

    from glue.embedded_engine.tiny_model import save_tiny_model
    from weight_sync.source import LocalWeightSource

    model_dir = save_tiny_model(tmp_path / "model", **MODEL)
    gen = torch.Generator().manual_seed(1)
    tensors = {n: torch.randn(t.shape, generator=gen) * 0.02 for n, t in load_file(f"{model_dir}/model.safetensors").items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert nbytes >= 200e6
    port, raw_port = free_port(), free_port()
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=engine_host, args=(model_dir, port, raw_port, nbytes, REPEATS))
    proc.start()
    try:
        raw_s = raw_broadcast_seconds(raw_port, nbytes, REPEATS)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        source = LocalWeightSource(tensors)
        results = {}
        for name, sync in [("broadcast", dict(transport="broadcast")),
                           ("broadcast_verify_off", dict(transport="broadcast", verify="off")),
                           ("broadcast_64MiB_buckets", dict(transport="broadcast", bucket_bytes=64 * 1024**2)),
                           ("ipc", dict(transport="ipc")), ("disk", dict(transport="disk"))]:
            results[name] = summarize(time_bridge(url, source, tmp_path, **sync), nbytes, raw_s, sync)
        # The same broadcast from a real megatron-core trainer rank (TP=1): stage_s is then the gather of the
        # megatron parameters and their conversion to HF names and layouts (fused QKV / gate-up split).
        trainer = start_trainer_rank(model_dir)
        try:
            results["broadcast_from_megatron_tp1"] = summarize(
                time_bridge(url, trainer, tmp_path, transport="broadcast"), nbytes, raw_s,
                {"transport": "broadcast", "source": "megatron-core TrainerWorker, TP=1"})
        finally:
            trainer.shutdown()
    finally:
        proc.terminate()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    report = {"model": MODEL, "bytes": nbytes, "repeats": REPEATS, "threads": torch.get_num_threads(),
              "raw_gloo_broadcast": {"seconds": round(raw_s, 4), "gb_per_s": round(nbytes / raw_s / 1e9, 3)},
              "transports": results}
    out = REPO_ROOT / "bench-results" / "weight_sync.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    assert all(r["ratio_to_raw"] > 0 for r in results.values())
