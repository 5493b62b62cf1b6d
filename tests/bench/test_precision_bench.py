"""`make bench` precision section (issue 29), written to bench-results/precision.json one key per test:
`bytes_per_param` (training state a rank holds per parameter of its model shard, counted from the tensors: bf16
weights, megatron DDP's fp32 gradient buffer, fp32 main weights and Adam moments; bf16 with the distributed optimizer
at DP=1 and DP=2), `sync_bytes_per_param` (bytes a weight sync sends per parameter to bf16 engines), `small_updates`
(at lr 1e-6, 10 steps on SmolLM2-135M: cosine between the bf16 run's and the fp32 run's weight change, the same
for a bf16 run with `trainer.bf16_rounding: dithered`, and the
fraction of weights bf16 training without fp32 main weights changes at all) and `step_s` (fp32 and bf16, same batch).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time

import pytest
import torch

from conftest import REPO_ROOT
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from helpers.bench import write_section
from helpers.trainer import _free_port, make_batch, results_of_ranks

pytestmark = pytest.mark.bench
OUT = REPO_ROOT / "bench-results" / "precision.json"
SMOLLM2 = os.environ.get("SMOLLM2", str(REPO_ROOT / "models" / "smollm2-135m-instruct"))


def state_breakdown(worker) -> dict[str, int]:
    """Bytes of each part of one rank's training state, every storage counted once."""
    from glue.trainer.offload import state_bytes

    training = worker.training
    parts = getattr(training.optimizer, "chained_optimizers", [training.optimizer])
    main = [p for part in parts for g in part.optimizer.param_groups for p in g["params"]]
    moments = [v for part in parts for s in part.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0]
    buffers = training.module.buffers + training.module.expert_parallel_buffers
    weights = [p.data for p in worker.model.parameters()]
    return {"weights": state_bytes(weights), "gradients": state_bytes([b.grad_data for b in buffers]),
            "main_weights": state_bytes(main) if worker.precision == "bf16" else 0,
            "adam_moments": state_bytes(moments), "total": worker.training_state_bytes()}


def _bytes_main(rank: int, world: int, port: int, model: str, cfg: TrainerConfig, results) -> None:
    from glue.trainer.worker import TrainerWorker

    worker = TrainerWorker(model_path=model, cfg=cfg, loss_cfg=LossConfig(), rank=rank, world_size=world)
    worker.initialize("127.0.0.1", port)
    worker.train_step(make_batch())  # Adam's moments exist from the first step on
    numel = sum(p.numel() for p in worker.model.parameters())
    out = {"numel": numel, **state_breakdown(worker)}
    specs = worker.hf_weight_specs()
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4}
    out["sync_bytes_per_param"] = (sum(sizes[d] * torch.Size(s).numel() for _, d, s in specs)
                                   / sum(torch.Size(s).numel() for _, _, s in specs))
    worker.shutdown()
    results.put(pickle.dumps((rank, out)))


def rank_state(model: str, dp: int, **fields) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cfg = TrainerConfig(**{"lr": 1e-3, "num_cpus_per_worker": 1, "data_parallel_size": dp, "micro_batch_size": 3,
                           **fields})
    port = _free_port()
    procs = [ctx.Process(target=_bytes_main, args=(r, dp, port, model, cfg, results)) for r in range(dp)]
    outs = results_of_ranks(procs, results)
    return max((out[0] for out in outs.values()), key=lambda o: o["total"] / o["numel"])


def test_bytes_per_param_and_sync_bytes(tmp_path_factory):
    from glue.embedded_engine.tiny_model import save_tiny_model

    # the model when it is here (megatron pads its buffers per bucket: on a tiny model that shows)
    smollm2 = os.path.isfile(os.path.join(SMOLLM2, "config.json"))
    model = SMOLLM2 if smollm2 else save_tiny_model(str(tmp_path_factory.mktemp("qwen3")), family="qwen3", seed=0)
    figures, parts = {}, {}
    for dp in (1, 2):
        state = rank_state(model, dp, precision="bf16")
        figures[f"dp{dp}"] = round(state["total"] / state["numel"], 3)
        parts[f"dp{dp}"] = {k: round(v / state["numel"], 3) for k, v in state.items()
                            if k not in ("numel", "sync_bytes_per_param")}
    fp32 = rank_state(model, 1, precision="fp32", use_distributed_optimizer=False)
    write_section({"bytes_per_param": figures, "bytes_per_param_parts": parts,
                   "bytes_per_param_model": "SmolLM2-135M" if smollm2 else "tiny Qwen3 (make smollm2 for SmolLM2)",
                   "bytes_per_param_fp32_dp1": round(fp32["total"] / fp32["numel"], 3),
                   "bytes_per_param_targets": {"dp1": 18, "dp2": 12},
                   "sync_bytes_per_param": state["sync_bytes_per_param"],
                   "sync_bytes_per_param_fp32": fp32["sync_bytes_per_param"]}, OUT)
    print(figures, parts)
    assert state["sync_bytes_per_param"] == 2.0


def _small_updates_main(model: str, lr: float, steps: int, results) -> None:
    """fp32 and bf16 (fp32 main weights) megatron runs from the same weights on the same batch, then plain bf16
    Adam with no main weights (what trainer.precision refuses), in one process one after the other."""
    from megatron.core import parallel_state

    from glue.trainer.worker import TrainerWorker
    from helpers.trainer import make_batch as tiny_batch

    batch = tiny_batch()
    batch.tokens = batch.tokens % 1000 + 100  # ordinary SmolLM2 tokens
    out = {}
    for run in ("fp32", "bf16", "bf16_dithered"):
        precision = run.split("_")[0]
        cfg = TrainerConfig(lr=lr, precision=precision, grad_clip=0.0, micro_batch_size=6, num_cpus_per_worker=1,
                            bf16_rounding="dithered" if run == "bf16_dithered" else "nearest")
        worker = TrainerWorker(model_path=model, cfg=cfg, loss_cfg=LossConfig(), rank=0, world_size=1)
        worker.initialize("127.0.0.1", _free_port())
        start = {n: p.detach().float().clone() for n, p in worker.model.named_parameters()}
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            worker.train_step(batch)
            times.append(time.perf_counter() - t)
        part = worker.training.optimizer.chained_optimizers[0]
        # the fp32 weights each run ends with: its main weights (bf16) or its weights (fp32), in model order
        if precision == "bf16":
            ends = [m for g in part.shard_fp32_from_float16_groups for m in g]
            names = [n for g in part.model_float16_groups for p in g for n, q in worker.model.named_parameters()
                     if q is p]
        else:
            names = [n for n, _ in worker.model.named_parameters()]
            ends = [p.detach() for _, p in worker.model.named_parameters()]
        delta = {n: e.float().view(-1) - start[n].view(-1) for n, e in zip(names, ends)}
        out[run] = {"delta": torch.cat([delta[n] for n in sorted(delta)]),  # the same order in every run
                    "step_s": sum(times[1:]) / max(len(times) - 1, 1)}
        worker.shutdown()
        parallel_state.destroy_model_parallel()
    out["bf16_no_main"] = _bf16_without_main_weights(model, batch, lr, steps)
    a, b = out["fp32"]["delta"], out["bf16"]["delta"]
    results.put(pickle.dumps({"cosine_bf16_vs_fp32": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
                              "cosine_bf16_dithered_vs_fp32": float(torch.nn.functional.cosine_similarity(
                                  a, out["bf16_dithered"]["delta"], dim=0)),
                              "changed_fraction_bf16_main": float((b != 0).float().mean()),
                              "changed_fraction_fp32": float((a != 0).float().mean()),
                              "changed_fraction_bf16_no_main": out["bf16_no_main"],
                              "step_s": {run: out[run]["step_s"] for run in ("fp32", "bf16", "bf16_dithered")}}))


def _bf16_without_main_weights(model: str, batch, lr: float, steps: int) -> float:
    """The HF model in bf16 stepped by torch's AdamW on its bf16 weights (no fp32 copy), on the batch's response
    tokens (log-likelihood weighted by the advantages, as a policy gradient): the fraction of weights that moved."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    start = [p.detach().clone() for p in hf.parameters()]
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad()
        logp = torch.log_softmax(hf(batch.tokens).logits.float(), -1)[:, :-1]
        token_logp = logp.gather(-1, batch.tokens[:, 1:, None])[..., 0]
        mask = batch.logprob_mask[:, :-1].float()
        loss = -(token_logp * mask * batch.advantages[:, :-1].float()).sum() / mask.sum()
        loss.backward()
        opt.step()
    changed = sum(int((p.detach() != s).sum()) for p, s in zip(hf.parameters(), start))
    return changed / sum(s.numel() for s in start)


def test_small_updates_on_smollm2():
    if not os.path.isfile(os.path.join(SMOLLM2, "config.json")):
        pytest.skip(f"needs the SmolLM2-135M model at {SMOLLM2} (make smollm2)")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_small_updates_main, args=(SMOLLM2, 1e-6, 10, results))
    out = results_of_ranks([proc], _Ranked(results))[0][0]
    write_section({"small_updates": {k: v for k, v in out.items() if k != "step_s"}, "step_s": out["step_s"],
                   "small_updates_target": {"cosine_bf16_vs_fp32": 0.9}}, OUT)
    print(out)
    assert out["changed_fraction_bf16_main"] > out["changed_fraction_bf16_no_main"]


class _Ranked:
    """A results queue whose items come back as (rank 0, item), as results_of_ranks expects."""

    def __init__(self, queue):
        self.queue = queue

    def get(self, timeout: float):
        return pickle.dumps((0, pickle.loads(self.queue.get(timeout=timeout))))
