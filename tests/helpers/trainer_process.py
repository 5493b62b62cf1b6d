"""One world-size-1 megatron-core trainer worker, started and stopped inside a spawned process, and scenarios run
there (so megatron's global parallel state never enters pytest's)."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
from typing import Any, Callable

import torch

from glue.trainer.config import TrainerConfig
from loss import LossConfig
from .forkserver import rank_context


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(scenario: Callable[..., dict], args: tuple, results: mp.Queue) -> None:
    results.put(pickle.dumps(scenario(*args)))  # plain bytes: queued tensors would die with this process


def run_in_trainer_process(scenario: Callable[..., dict], *args: Any) -> dict:
    """`scenario(*args)` in a spawned process, so megatron's global parallel state never enters pytest's; its
    traceback, if it raises, is in the captured stderr."""
    ctx = rank_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(scenario, args, results))
    proc.start()
    try:
        while True:
            try:
                return pickle.loads(results.get(timeout=5))
            except queue.Empty:
                assert proc.exitcode in (None, 0), f"the trainer process died with exit code {proc.exitcode}"
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def start_worker(model_dir: str, loss_cfg: LossConfig, keep_versions: int = 1, **fields: Any):
    """A world-size-1 TrainerWorker on its own gloo group (its own fields: e.g. old_logprobs, num_mini_batches)."""
    from glue.trainer.worker import TrainerWorker

    cfg = TrainerConfig(**{"lr": 1e-2, "num_cpus_per_worker": 1, **fields})
    worker = TrainerWorker(model_path=model_dir, cfg=cfg, loss_cfg=loss_cfg, rank=0, world_size=1,
                           keep_versions=keep_versions)
    worker.initialize("127.0.0.1", _free_port())
    return worker


def stop_worker(worker) -> None:
    """Leave the gloo group and megatron's parallel state, so the next worker in this process starts clean."""
    from megatron.core import parallel_state

    worker.shutdown()
    parallel_state.destroy_model_parallel()


def with_versions(batch, versions: Callable[[int, int], int]):
    """`batch` with token (row b, position t) stamped `versions(b, t)` wherever it is trained, -1 elsewhere."""
    stamped = torch.tensor([[versions(b, t) for t in range(batch.tokens.shape[1])]
                            for b in range(batch.tokens.shape[0])])
    batch.versions = torch.where(batch.logprob_mask > 0, stamped, -1)
    return batch
