"""`make bench` scale section `delta` (issue 25 item 8): delta sync on the SmolLM2-135M recipe in bf16. A one-rank
megatron-core trainer (Ray actor, gloo) takes a few optimizer steps at each learning rate, each followed by a delta
sync to a bf16 embedded engine and, for comparison, a whole sync of the same weights by the same bridge: per step
the fraction of elements that changed, bytes sent against a whole sync's, and both syncs' seconds (plus one sync by
a bridge without delta sync, per rate). Every sync is verified by bucket checksums, and at the end of each rate a
sync with verify: full compares every engine tensor with the trainer's."""
from __future__ import annotations

import os
import statistics

import pytest

from conftest import REPO_ROOT
from helpers.bench import write_section
from helpers.trainer import make_batch

pytestmark = pytest.mark.bench
SMOLLM2 = os.environ.get("SMOLLM2", str(REPO_ROOT / "models" / "smollm2-135m-instruct"))
RATES = (1e-5, 1e-6)  # the recipe's lr, and a tenth of it
STEPS = 3
SPLIT = ("stage_s", "pack_s", "wire_s", "copy_in_s", "verify_s")


def run_rate(lr: float, url: str) -> list[dict[str, float]]:
    from glue.loop.config import SyncConfig
    from glue.trainer.config import TrainerConfig
    from glue.trainer.group import TrainerGroup
    from loss import LossConfig
    from weight_sync.bridge import make_bridge

    trainer = TrainerGroup(SMOLLM2, TrainerConfig(lr=lr, precision="bf16"), LossConfig())
    try:
        delta = make_bridge(SyncConfig(transport="broadcast", delta=True, verify="checksum"), source=trainer,
                            engine_urls=[url])
        try:
            delta.sync(trainer.version)  # the baseline
            rows = []
            for _ in range(STEPS):
                trainer.train_step(make_batch())
                figures = delta.sync(trainer.version)
                delta.delta_ready = False  # the same weights again, whole (and the baselines refreshed)
                whole = delta.sync(trainer.version)
                rows.append({"lr": lr, "version": trainer.version, "changed_frac": figures["delta_changed_frac"],
                             "bytes_sent": figures["bytes_sent"], "bytes_full": figures["bytes_full"],
                             "delta_s": figures["total_s"], "whole_s": whole["total_s"],
                             **{f"delta_{k}": figures[k] for k in SPLIT}, **{f"whole_{k}": whole[k] for k in SPLIT}})
                print(rows[-1], flush=True)
            delta.verify = "full"  # once more, every engine tensor against the trainer's
            delta.sync(trainer.version)
        finally:
            delta.close()
        plain = make_bridge(SyncConfig(transport="broadcast", verify="checksum"), source=trainer, engine_urls=[url])
        try:  # a bridge without delta sync, for reference
            rows[-1]["plain_whole_s"] = plain.sync(trainer.version)["total_s"]
        finally:
            plain.close()
        return rows
    finally:
        trainer.shutdown()


def test_delta_sync_on_smollm2_bf16(engine_processes):
    if not os.path.isdir(SMOLLM2):
        pytest.skip(f"SmolLM2-135M-Instruct is not at {SMOLLM2} (set SMOLLM2=<dir>)")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    url = engine_processes.start(SMOLLM2, "--dtype", "bfloat16", timeout_s=300)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows = [row for lr in RATES for row in run_rate(lr, url)]
    finally:
        ray.shutdown()
    summary = {}
    for lr in RATES:
        mine = [r for r in rows if r["lr"] == lr]
        summary[f"lr_{lr:g}"] = {
            "changed_frac": [round(r["changed_frac"], 4) for r in mine],
            "bytes_sent_frac": [round(r["bytes_sent"] / r["bytes_full"], 4) for r in mine],
            "delta_s_median": round(statistics.median(r["delta_s"] for r in mine), 3),
            "whole_s_median": round(statistics.median(r["whole_s"] for r in mine), 3),
            "plain_whole_s": round(mine[-1]["plain_whole_s"], 3)}
    write_section({"delta": {"model": "SmolLM2-135M-Instruct", "precision": "bf16", "steps_per_lr": STEPS,
                             "load_avg_1min_at_end": round(os.getloadavg()[0], 1),
                             "bytes_full": rows[0]["bytes_full"], **summary, "rows": rows}})
    assert all(0 < r["changed_frac"] < 1 and r["bytes_sent"] <= r["bytes_full"] for r in rows), rows
