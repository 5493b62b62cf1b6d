"""The trainer's streamed weight source on CPU/gloo, for real (spawned ranks): bucket by bucket, the HF tensors rank 0
receives are bit-identical to the whole-model gather (`full_hf_state`) at TP=2, PP=2 and EP=2; only the source ends
up with a bucket, and it holds nothing but the bucket and the rest of one split fused tensor."""
from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch

from glue.embedded_engine.tiny_model import save_tiny_model
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from test_trainer_megatron import _free_port, results_of_ranks

BUCKET_BYTES = 12 << 10  # small buckets: several per stage, and fused q/k/v split across two of them


def _stream_rank(rank: int, world: int, port: int, model_path: str, cfg: TrainerConfig, results) -> None:
    from glue.trainer.weight_stream import TrainerWeightSource
    from glue.trainer.worker import TrainerWorker
    from weight_sync.buckets import plan_buckets

    worker = TrainerWorker(model_path=model_path, cfg=cfg, loss_cfg=LossConfig(), rank=rank, world_size=world)
    worker.initialize("127.0.0.1", port)
    whole = worker.full_hf_state()
    layouts = plan_buckets(worker.hf_weight_specs(), BUCKET_BYTES)
    source = TrainerWeightSource(worker.model, worker.hf_config, worker.place)
    source.bucket_names["test"] = [list(layout.names) for layout in layouts]
    source.stage(worker.version, with_tensor_checksums=False)
    streamed, left_over = {}, 0
    for layout in layouts:
        tensors = source._stream.bucket(list(layout.names))
        left_over = max(left_over, len(source._stream._ready))  # produced for a later bucket (a split fused rule)
        streamed.update({name: t.detach().cpu().clone() for name, t in tensors.items()})
    worker.shutdown()
    results.put(pickle.dumps((rank, whole, streamed, left_over, len(layouts))))


def stream_on_ranks(model_path: str, **layout) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cfg = TrainerConfig(**{"micro_batch_size": 2, "num_cpus_per_worker": 1, **layout})
    procs = [ctx.Process(target=_stream_rank, args=(r, cfg.world_size, port, model_path, cfg, results))
             for port in [_free_port()] for r in range(cfg.world_size)]
    return results_of_ranks(procs, results)


@pytest.mark.parametrize("family, layout", [
    ("qwen2", {"tensor_model_parallel_size": 2}),
    ("qwen3", {"pipeline_model_parallel_size": 2}),
    ("qwen3_moe", {"data_parallel_size": 2, "expert_model_parallel_size": 2}),
], ids=["tp2", "pp2", "ep2"])
def test_streamed_buckets_are_bit_identical_to_the_whole_model_gather(tmp_path_factory, family, layout):
    model = save_tiny_model(str(tmp_path_factory.mktemp(family)), family=family, seed=5)
    outs = stream_on_ranks(model, **layout)
    whole, streamed, left_over, buckets = outs[0]
    assert buckets > 3
    assert list(streamed) == list(whole)  # every tensor, in the bridge's order
    for name, tensor in whole.items():
        assert torch.equal(streamed[name], tensor), name
    assert left_over <= 2  # at most the rest of one fused q/k/v or gate/up waits for the next bucket
    for rank, (_, others_streamed, _, _) in outs.items():
        if rank != 0:
            assert others_streamed == {}  # only the source ends up with the bucket
