"""The megatron-core trainer on CPU/gloo in spawned rank processes: the tiny batch, the HF reference logprobs, rank
start-up and result collection, and the checks comparing one layout's step with another's."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import queue
import socket

import torch

from glue.trainer.config import TrainerConfig
from glue.types import Sample, TrainBatch
from loss import LossConfig
from .forkserver import rank_context

PROMPT_LEN, RESPONSE_LEN, BATCH = 5, 7, 6
ENTROPY_COEF = 0.01  # the spawned runs also train through the vocab-parallel entropy bonus


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_gloo(rank: int, port: int, world_size: int = 2) -> None:
    """This rank process into a gloo world on loopback `port`, one torch thread, megatron's CPU patches applied
    (a rank main's first step; megatron's parallel state is the caller's)."""
    import os

    from glue.trainer import cpu_compat

    cpu_compat.apply()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def hf_teacher_forced_logprobs(model_dir: str, tokens: torch.Tensor, with_entropy: bool = False):
    """log p(tokens[:, t+1] | tokens[:, :t+1]) from the HF model at position t, last column 0: [B, T]
    (and the entropy -sum p log p of the next-token distribution at each position, [B, T])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    logprobs = torch.nn.functional.pad(logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0], (0, 1))
    return (logprobs, -(logp.exp() * logp).sum(-1)) if with_entropy else logprobs


def make_batch(rollout_logprobs_from: str | None = None, response_len: int = RESPONSE_LEN) -> TrainBatch:
    """Six samples of random tokens with rewards 0..5 (advantage = reward - mean); response tokens trainable."""
    gen = torch.Generator().manual_seed(11)
    samples = []
    for i in range(BATCH):
        tokens = torch.randint(2, 32, (PROMPT_LEN + response_len,), generator=gen).tolist()
        s = Sample(prompt_tokens=tokens[:PROMPT_LEN], reward=float(i), index=i)
        s.append_response(tokens[PROMPT_LEN:], [-1.0] * response_len, version=0)
        samples.append(s)
    batch = TrainBatch.from_samples(samples, [float(i) - 2.5 for i in range(BATCH)])
    if rollout_logprobs_from is not None:
        batch.rollout_logprobs = hf_teacher_forced_logprobs(rollout_logprobs_from, batch.tokens) * batch.logprob_mask
    return batch


def _worker_main(rank: int, world_size: int, port: int, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig,
                 steps: int, batch: TrainBatch, results: mp.Queue) -> None:
    """One trainer rank in a spawned process: logprobs, `steps` train steps (the last one's metrics are kept),
    logprobs again, gathered HF weights."""
    from glue.trainer.worker import TrainerWorker

    worker = TrainerWorker(model_path=model_path, cfg=cfg, loss_cfg=loss_cfg, rank=rank, world_size=world_size)
    worker.initialize("127.0.0.1", port)
    before, entropy = worker.compute_logprobs(batch, with_entropy=True)
    metrics = [worker.train_step(batch) for _ in range(steps)]
    after = worker.compute_logprobs(batch)
    weights = worker.full_hf_state()
    worker.shutdown()
    # plain pickle bytes: a queued tensor would otherwise live in this process's shared memory, gone at exit
    results.put(pickle.dumps((rank, before, entropy, metrics, after, weights if rank == 0 else None)))


def run_trainer_ranks(model_path: str, tp_size: int, batch: TrainBatch, *, loss_cfg: LossConfig | None = None,
                      steps: int = 1, **layout) -> dict:
    """Spawn TP x DP ranks (`layout`: more TrainerConfig fields, e.g. data_parallel_size), train `steps` steps,
    collect rank 0's results ("metrics": the last step's, "all_metrics": every step's); every process is stopped
    by its own handle."""
    ctx = rank_context()
    results = ctx.Queue()
    cfg = TrainerConfig(**{"tensor_model_parallel_size": tp_size, "micro_batch_size": 4, "lr": 1e-2,
                           "num_cpus_per_worker": 1, **layout})
    world = cfg.world_size
    port = _free_port()
    loss_cfg = loss_cfg or LossConfig(entropy_coef=ENTROPY_COEF)
    procs = [ctx.Process(target=_worker_main, args=(r, world, port, model_path, cfg, loss_cfg, steps, batch, results))
             for r in range(world)]
    before, entropy, metrics, after, weights = results_of_ranks(procs, results)[0]
    return {"before": before, "entropy": entropy, "metrics": metrics[-1], "all_metrics": metrics, "after": after,
            "weights": weights}


def results_of_ranks(procs: list, results) -> dict[int, list]:
    """Start the spawned rank processes, collect what each puts on `results` (pickled `(rank, *values)`), join
    them; a rank that dies fails the test, and every process is stopped by its own handle whatever happens."""
    try:
        for p in procs:
            p.start()
        outs = {}
        while len(outs) < len(procs):
            try:
                rank, *rest = pickle.loads(results.get(timeout=5))
                outs[rank] = rest
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"trainer rank(s) died: exit codes {[p.exitcode for p in dead]}"
        for p in procs:
            p.join(timeout=60)
        return outs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


# Adam's first step moves a weight by lr * g / (|g| + eps): with a tiny eps, gradients at rounding level (which
# differ between layouts in their last bits) move weights by up to lr either way. A larger eps keeps the comparison
# of updated weights about the gradients, not their rounding.
ADAM = {"adam_eps": 1e-5}


def assert_same_step(one: dict, many: dict, what: str) -> None:
    """`many` (a parallel layout) trained exactly like `one` (a single rank), up to float rounding."""
    m1, m2 = one["metrics"], many["metrics"]
    assert m1["weights/version"] == m2["weights/version"] == 1.0
    for name in ("train/loss", "train/pg_loss", "train/clipfrac", "train/entropy"):
        assert abs(m1[name] - m2[name]) < 1e-6, f"{what}: {name} {m2[name]} != {m1[name]}"
    assert abs(m1["train/grad_norm"] - m2["train/grad_norm"]) < 1e-5 * max(1.0, m1["train/grad_norm"]), \
        f"{what}: grad norm {m2['train/grad_norm']} != {m1['train/grad_norm']}"
    assert (many["before"] - one["before"]).abs().max().item() < 1e-5, f"{what}: logprobs before the step differ"
    assert (many["after"] - one["after"]).abs().max().item() < 1e-5, f"{what}: logprobs after the step differ"
    assert list(many["weights"]) == list(one["weights"]), f"{what}: gathered HF names differ"
    for name, w1 in one["weights"].items():
        assert (many["weights"][name] - w1).abs().max().item() < 1e-5, f"{what}: {name}"


@contextlib.contextmanager
def serialised_bytes():
    """Bytes this process hands to Ray's serializer (task arguments and ray.put alike) inside the block."""
    from ray._private.serialization import SerializationContext

    original, counted = SerializationContext.serialize, []

    def counting(self, value):
        out = original(self, value)
        counted.append(out.total_bytes)
        return out

    SerializationContext.serialize = counting
    try:
        yield counted
    finally:
        SerializationContext.serialize = original
