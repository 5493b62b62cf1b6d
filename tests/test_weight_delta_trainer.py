"""Delta sync from the real megatron-core trainer (Ray actors on gloo, TP=2, bf16): after each optimizer step the
bucket-streamed source sends only what changed, and a bf16 embedded engine ends bit-identical to the trainer each
time (verify: full compares every engine tensor's checksum with the trainer's)."""
from __future__ import annotations

import os

import pytest

from glue.loop.config import SyncConfig
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from helpers.trainer import make_batch
from weight_sync.bridge import make_bridge
from weight_sync.engine_calls import weight_checksums


@pytest.fixture(scope="module")
def bf16_trainer(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.trainer.group import TrainerGroup

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    group = None
    try:
        # lr 1e-5 (the SmolLM2 recipe's): a step moves some bf16 weights by a rounding step, most stay as they are
        group = TrainerGroup(save_tiny_model(tmp_path_factory.mktemp("seed8"), seed=8),
                             TrainerConfig(tensor_model_parallel_size=2, lr=1e-5, precision="bf16"), LossConfig())
        yield group
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()


@pytest.mark.long  # 20 s with its Ray + TP=2 trainer; delta sync into engines stays in CI through tests/test_weight_delta.py
def test_delta_syncs_after_training_steps_leave_a_bf16_engine_bit_identical_to_the_trainer(
        engine_processes, tiny_model_dir, bf16_trainer):
    url = engine_processes.start(tiny_model_dir, "--dtype", "bfloat16")
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=64_000, verify="full", delta=True),
                         source=bf16_trainer, engine_urls=[url])
    try:
        first = bridge.sync(bf16_trainer.version)
        assert first["bytes_sent"] == first["bytes_full"]
        fractions = []
        for _ in range(2):
            bf16_trainer.train_step(make_batch())
            figures = bridge.sync(bf16_trainer.version)  # raises WeightSyncError on any differing tensor
            fractions.append(figures["delta_changed_frac"])
            print(f"step {bf16_trainer.version}: {figures['delta_changed_frac']:.3f} of elements changed, "
                  f"{figures['bytes_sent']:.0f} of {figures['bytes_full']:.0f} bytes sent")
            assert 0 < figures["delta_changed_frac"] < 1
            assert figures["bytes_sent"] < figures["bytes_full"]
        full = bf16_trainer.full_hf_state()
        from weight_sync.buckets import tensor_checksum

        assert weight_checksums(url, 30) == {n: tensor_checksum(t) for n, t in full.items()}
    finally:
        bridge.close()
