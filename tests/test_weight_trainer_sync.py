"""From the megatron-core trainer (Ray actors, TP=2 so the bridge sends gathered shards) to embedded engines, by
broadcast and by IPC after a training step: each engine's greedy generations and logprobs equal the trainer's own
forward on the same tokens."""
from __future__ import annotations

import os

import pytest
import torch

from glue.loop.config import SyncConfig
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from helpers.engines import generate
from helpers.trainer import make_batch
from weight_sync.bridge import make_bridge

PROMPTS = ([3, 4, 5], [9, 2], [2, 7, 7, 1])


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A TP=2 trainer on a seed-8 tiny model after one optimizer step (so its weights are nobody's checkpoint)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.trainer.group import TrainerGroup

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    group = None
    try:
        group = TrainerGroup(save_tiny_model(tmp_path_factory.mktemp("seed8"), seed=8),
                             TrainerConfig(tensor_model_parallel_size=2, lr=1e-2), LossConfig())
        group.train_step(make_batch())
        yield group
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()


def engine_vs_trainer(url: str, trainer) -> float:
    """Largest |engine logprob - trainer logprob| over greedy generations; the engine's tokens must be the
    argmax of the trainer's distribution too."""
    worst = 0.0
    for prompt in PROMPTS:
        out = generate(url, {"input_ids": prompt, "return_logprob": True,
                             "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}})
        tokens = torch.tensor([prompt + out["output_ids"]])
        positions = range(len(prompt) - 1, tokens.shape[1] - 1)
        trainer_lp = trainer.compute_logprobs(tokens)[0]
        engine_lp = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        worst = max(worst, max(abs(engine_lp[i] - float(trainer_lp[p])) for i, p in enumerate(positions)))
    return worst


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_after_a_sync_the_engine_generates_with_the_trainers_logprobs(engine_processes, tiny_model_dir, trainer,
                                                                      transport):
    url = engine_processes.start(tiny_model_dir)  # seed-0 weights: far from the trainer's
    assert engine_vs_trainer(url, trainer) > 1e-2
    bridge = make_bridge(SyncConfig(transport=transport, bucket_bytes=64_000, verify="full"), source=trainer,
                         engine_urls=[url])
    try:
        bridge.sync(trainer.version)
        diff = engine_vs_trainer(url, trainer)
        print(f"{transport}: max |engine - trainer| logprob after sync = {diff:.2e}")
        assert diff < 1e-5
    finally:
        bridge.close()


@pytest.fixture(scope="module")
def bf16_trainer(trainer, tmp_path_factory):
    """A bf16 trainer (fp32 main weights) at TP=2 after one step, in the same Ray session as `trainer`."""
    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.trainer.group import TrainerGroup

    group = TrainerGroup(save_tiny_model(tmp_path_factory.mktemp("seed9"), seed=9),
                         TrainerConfig(tensor_model_parallel_size=2, lr=1e-2, precision="bf16"), LossConfig())
    try:
        group.train_step(make_batch())
        yield group
    finally:
        group.shutdown()


def test_a_bf16_trainer_sends_bf16_bytes_and_bf16_engines_end_bit_identical(engine_processes, tiny_model_dir,
                                                                            bf16_trainer):
    """Issue 29 item 3: the bridge sends the weights the engines serve, half of fp32's bytes, and the engines'
    tensors equal the trainer's bit for bit (verify: full compares every engine tensor's checksum)."""
    url = engine_processes.start(tiny_model_dir, "--dtype", "bfloat16")
    # the driver prints the trainer's start-up line (the actors' output does not reach it)
    assert bf16_trainer.startup_line.startswith("trainer precision bf16: checkpoint float32, model weights bfloat16")
    specs = bf16_trainer.hf_weight_specs()
    assert {dtype for _, dtype, _ in specs} == {"bfloat16"}
    numel = sum(torch.Size(shape).numel() for _, _, shape in specs)
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=64_000, verify="full"), source=bf16_trainer,
                         engine_urls=[url])
    try:
        stats = bridge.sync(bf16_trainer.version)  # raises WeightSyncError on any differing tensor
    finally:
        bridge.close()
    assert stats["bytes"] == 2 * numel
    # both sides compute in bf16 from the same weights (HF's and megatron's kernels round differently)
    assert engine_vs_trainer(url, bf16_trainer) < 0.1
