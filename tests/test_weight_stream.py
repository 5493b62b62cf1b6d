"""The trainer's streamed weight source on CPU/gloo, for real (spawned ranks): bucket by bucket, the HF tensors rank 0
receives are bit-identical to the whole-model gather (`full_hf_state`) at TP=2, PP=2 and EP=2; only the source ends
up with a bucket, and it holds nothing but the bucket and the rest of one split fused tensor; no rank allocates more
than about a bucket while gathering, counted in tensor bytes (tests/tensor_census.py)."""
from __future__ import annotations

import pickle

import pytest
import torch

from glue.embedded_engine.tiny_model import save_tiny_model
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from helpers.trainer import _free_port, results_of_ranks
from helpers.forkserver import rank_context

BUCKET_BYTES = 12 << 10  # small buckets: several per stage, and fused q/k/v split across two of them


def _stream_rank(rank: int, world: int, port: int, model_path: str, cfg: TrainerConfig, bucket_bytes: int,
                 results) -> None:
    from glue.trainer.weight_stream import TrainerWeightSender
    from glue.trainer.worker import TrainerWorker
    from tensor_census import TensorCensus
    from weight_sync.buckets import plan_buckets

    worker = TrainerWorker(model_path=model_path, cfg=cfg, loss_cfg=LossConfig(), rank=rank, world_size=world)
    worker.initialize("127.0.0.1", port)
    whole = worker.full_hf_state()
    layouts = plan_buckets(worker.hf_weight_specs(), bucket_bytes)
    source = TrainerWeightSender(worker.model, worker.hf_config, worker.place)
    source.bucket_names["test"] = [list(layout.names) for layout in layouts]
    source.stage(worker.version, with_tensor_checksums=False)
    streamed, left_over, census = {}, 0, TensorCensus()
    for layout in layouts:
        with census:
            tensors = source._stream.bucket(list(layout.names))
        left_over = max(left_over, len(source._stream._ready))  # produced for a later bucket (a split fused rule)
        streamed.update({name: t.detach().cpu().clone() for name, t in tensors.items()})
        del tensors  # the bucket is sent: what the stream allocated for it may go
    worker.shutdown()
    counted = {"peak": census.peak, "largest": census.largest, "biggest_bucket": max(b.nbytes for b in layouts)}
    results.put(pickle.dumps((rank, whole, streamed, left_over, len(layouts), counted)))


def stream_on_ranks(model_path: str, bucket_bytes: int = BUCKET_BYTES, **layout) -> dict:
    ctx = rank_context()
    results = ctx.Queue()
    cfg = TrainerConfig(**{"micro_batch_size": 2, "num_cpus_per_worker": 1, **layout})
    procs = [ctx.Process(target=_stream_rank, args=(r, cfg.world_size, port, model_path, cfg, bucket_bytes, results))
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
    whole, streamed, left_over, buckets, _ = outs[0]
    assert buckets > 3
    assert list(streamed) == list(whole)  # every tensor, in the bridge's order
    for name, tensor in whole.items():
        assert torch.equal(streamed[name], tensor), name
    assert left_over <= 2  # at most the rest of one fused q/k/v or gate/up waits for the next bucket
    for rank, (_, others_streamed, _, _, _) in outs.items():
        if rank != 0:
            assert others_streamed == {}  # only the source ends up with the bucket


@pytest.mark.parametrize("layout", [
    pytest.param({"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2},
                 marks=pytest.mark.long),  # the expert-TP gather's second layout; tp2-ep2 stays in CI
    {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 2},
], ids=["tp2-etp2", "tp2-ep2"])
def test_no_rank_allocates_more_than_two_buckets_while_gathering_tp_and_ep_shards(tmp_path_factory, layout):
    """Buckets as large as the largest fused tensor (q/k/v, 32 KiB): gathering a bucket's TP / expert-TP shards
    (every kind: column, row, vocab, q/k/v, gate/up) and its other EP rank's experts allocates, on every rank, at
    most two buckets' worth of tensors at once, and no single tensor larger than a bucket. Counting the gathered
    shards, their concatenation and split copies of one fused tensor side by side would exceed it."""
    model = save_tiny_model(str(tmp_path_factory.mktemp("moe")), family="qwen3_moe", seed=5)
    outs = stream_on_ranks(model, bucket_bytes=32 << 10, **layout)
    whole, streamed, _, _, _ = outs[0]
    for name, tensor in whole.items():
        assert torch.equal(streamed[name], tensor), name
    for rank, (_, _, _, _, counted) in outs.items():
        assert counted["biggest_bucket"] <= 32 << 10, counted  # no tensor travels in a bucket of its own
        assert counted["largest"] <= counted["biggest_bucket"], (rank, counted)
        assert counted["peak"] <= 2 * counted["biggest_bucket"], (rank, counted)
