"""`make bench`: trainer throughput with and without sequence packing on a batch whose lengths spread 64x
(log-uniform 16..1024 tokens, as agent rollouts are), one megatron-core rank on CPU. Writes
bench-results/packing.json: trained tokens/s, step seconds, peak resident memory and the losses per mode."""
from __future__ import annotations

import json
import math
import multiprocessing
import pickle
import resource
import time

import pytest
import torch

from conftest import REPO_ROOT, free_port
from glue.trainer.config import TrainerConfig
from glue.types import Sample, TrainBatch
from loss import LossConfig

pytestmark = pytest.mark.bench

MODEL = dict(family="qwen2", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
             intermediate_size=1024)
NUM_SAMPLES, SHORTEST, LONGEST, PROMPT_LEN = 32, 16, 1024, 8
STEPS = 3  # the first is a warm-up, not timed
MODES = {  # name: TrainerConfig fields
    "padded": dict(micro_batch_size=4),  # today's path: 4 rows of the longest sample's width per forward
    "packed_1024": dict(max_tokens_per_micro_batch=LONGEST),  # rows as wide as the padded ones
    "packed_4096": dict(max_tokens_per_micro_batch=4 * LONGEST),  # the token slots of a padded micro-batch
}


def spread_batch() -> TrainBatch:
    """NUM_SAMPLES samples with lengths log-uniform in [SHORTEST, LONGEST], random tokens, rewards 0, 1, ..."""
    gen = torch.Generator().manual_seed(0)
    logs = torch.empty(NUM_SAMPLES).uniform_(math.log(SHORTEST), math.log(LONGEST), generator=gen)
    lengths = logs.exp().round().long().tolist()
    lengths[0] = LONGEST  # the padded width is the longest sample's
    samples = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(2, MODEL["vocab_size"], (n,), generator=gen).tolist()
        s = Sample(prompt_tokens=tokens[:PROMPT_LEN], reward=float(i % 4), index=i, group_id=i // 4)
        s.append_response(tokens[PROMPT_LEN:], [-8.0] * (n - PROMPT_LEN), version=0)
        samples.append(s)
    return TrainBatch.from_samples(samples, [float(i % 4) - 1.5 for i in range(NUM_SAMPLES)])


def _resident_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def run_mode(model_dir: str, fields: dict, results) -> None:
    """One mode in a fresh process (so the peak resident memory is this mode's): STEPS train steps."""
    from megatron.core import parallel_state

    from glue.trainer.worker import TrainerWorker

    cfg = TrainerConfig(lr=1e-4, grad_clip=0.0, **fields)
    worker = TrainerWorker(model_path=model_dir, cfg=cfg, loss_cfg=LossConfig(), rank=0, world_size=1)
    worker.initialize("127.0.0.1", free_port())
    batch = spread_batch()
    resident_before = _resident_kib()
    seconds, losses = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        metrics = worker.train_step(batch)
        seconds.append(time.perf_counter() - start)
        losses.append(metrics["train/loss"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    worker.shutdown()
    parallel_state.destroy_model_parallel()
    results.put(pickle.dumps(dict(seconds=seconds, losses=losses, resident_before_kib=resident_before,
                                  peak_resident_kib=peak)))


def test_packing_trains_a_spread_batch_faster_with_the_same_loss(tmp_path):
    from glue.embedded_engine.tiny_model import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "model"), seed=0, **MODEL)
    batch = spread_batch()
    tokens = sum(batch.seq_lens)
    ctx = multiprocessing.get_context("spawn")
    report = {"model": MODEL, "num_samples": NUM_SAMPLES, "lengths": f"log-uniform {SHORTEST}..{LONGEST}",
              "real_tokens": tokens, "padded_token_slots": NUM_SAMPLES * max(batch.seq_lens),
              "timed_steps": STEPS - 1, "torch_threads": torch.get_num_threads(), "modes": {}}
    for name, fields in MODES.items():
        results = ctx.Queue()
        proc = ctx.Process(target=run_mode, args=(model_dir, fields, results))
        proc.start()
        out = pickle.loads(results.get(timeout=1800))
        proc.join(timeout=60)
        step_s = sum(out["seconds"][1:]) / (STEPS - 1)
        report["modes"][name] = {
            "config": fields, "step_seconds": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
            "peak_resident_mib": round(out["peak_resident_kib"] / 1024, 1),
            "peak_above_loaded_mib": round((out["peak_resident_kib"] - out["resident_before_kib"]) / 1024, 1),
            "losses": out["losses"], "all_step_seconds": [round(s, 3) for s in out["seconds"]]}
    padded = report["modes"]["padded"]
    for name, mode in report["modes"].items():
        mode["speedup_vs_padded"] = round(mode["tokens_per_s"] / padded["tokens_per_s"], 2)
        mode["max_loss_diff_vs_padded"] = max(abs(a - b) for a, b in zip(mode["losses"], padded["losses"]))
    out_path = REPO_ROOT / "bench-results" / "packing.json"
    out_path.parent.mkdir(exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    for name, mode in report["modes"].items():
        assert mode["max_loss_diff_vs_padded"] < 1e-5, f"{name}: losses {mode['losses']} != {padded['losses']}"
    assert report["modes"]["packed_1024"]["speedup_vs_padded"] >= 2.0
