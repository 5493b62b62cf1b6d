"""The value model behind `loss.advantage_estimator: gae`, living in each trainer rank beside the policy: a second
megatron-core GPTModel of the policy's shape (same TP / PP / EP / DP shard, loaded from the same HF weights) whose
output layer is one linear unit, with its own DDP, megatron optimizer and schedule (`trainer.critic_lr`). Each
`train_step` asks it first: values of the batch's tokens -> GAE advantages and returns (loss/value.py), then the
critic trains toward the returns with the clipped value loss. It never reaches the engines: weight sync is the
policy's. Checkpoints hold its shards and optimizer state beside the policy's (`critic/`).
"""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Callable

import torch

from glue.trainer import model, optim
from glue.trainer.checkpointing import load_sharded, save_sharded
from glue.trainer.packing import MicroBatch, split_mini_batches
from glue.trainer.parallel import sum_over_dp, sum_tensor_over_dp
from glue.trainer.pipeline import run_micro_batches, share_from_last_stage, share_tensor_from_last_stage
from glue.types import TrainBatch
from loss.config import LossConfig
from loss.value import clipped_value_loss, explained_variance, gae_targets
from weight_sync.convert import in_names_of

CRITIC_DIR = "critic"


class ValueHead(torch.nn.Module):
    """Takes the place of GPTModel's output layer: final hidden states [S (/TP under sequence parallelism), B, H] ->
    values [S, B, 1]. One unit is not split over TP: every TP rank holds the whole head and computes every value
    (the hidden states are gathered first under sequence parallelism; the backward keeps this rank's part of the
    gradient, each rank having computed the whole loss). Zero at start, so the first values are 0."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
                ) -> tuple[torch.Tensor, None]:
        """GPTModel calls its output layer as `(hidden, weight=..., runtime_gather_output=...) -> (out, bias)`."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def build_value_model(hf_config: Any, model_path: str, layout: Any, build: dict[str, Any]) -> torch.nn.Module:
    """This rank's shard of the critic: the policy's GPTModel built untied (the head replaces the output layer, the
    embedding stays the trunk's own), every trunk weight from the HF checkpoint, the value head on the last stage."""
    untied = copy.copy(hf_config)
    untied.tie_word_embeddings = False
    critic = model.build_model(untied, **build)
    if critic.post_process:
        critic.output_layer = ValueHead(critic.config.hidden_size, sequence_parallel=critic.config.sequence_parallel,
                                        dtype=critic.config.params_dtype)
    params = {n: p for n, p in critic.named_parameters() if not n.startswith("output_layer.")}
    converted = in_names_of(model.hf_to_megatron_local(model.read_hf_state(model_path), hf_config, layout), params)
    local = {k: v for k, v in converted.items() if not k.startswith("output_layer.")}
    if sorted(params) != sorted(local):
        raise ValueError(f"critic: the HF -> megatron conversion does not cover the trunk: missing "
                         f"{sorted(set(params) - set(local))[:5]}, unexpected {sorted(set(local) - set(params))[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(local[name].to(param.dtype))
    return critic


class Critic:
    """The value model of one trainer rank and its training. `micro_batches(seq_lens, T, rows)` is the worker's
    plan (the same packing and DP split as the policy's); every method is collective over the trainer's ranks."""

    def __init__(self, *, model: torch.nn.Module, training: Any, place: Any, device: torch.device, loss_cfg: LossConfig,
                 micro_batches: Callable[[list[int], int, slice], list[MicroBatch]], num_epochs: int,
                 num_mini_batches: int):
        self.model, self.training, self.place, self.device = model, training, place, device
        self.loss_cfg, self.micro_batches = loss_cfg, micro_batches
        self.num_epochs, self.num_mini_batches = num_epochs, num_mini_batches

    @classmethod
    def build(cls, worker: Any, build: dict[str, Any]) -> "Critic":
        """The critic for `worker` (initialised: parallel state, place, device), with `build` the policy's
        build_model arguments, trained by Adam at trainer.critic_lr (trainer.lr when null)."""
        cfg = worker.cfg
        critic = build_value_model(worker.hf_config, worker.model_path, worker.place.layout(), build)
        critic.to(worker.device)
        lr = cfg.critic_lr or cfg.lr
        training = optim.build(critic, dataclasses.replace(cfg, lr=lr, min_lr=min(cfg.min_lr, lr)), worker.precision)
        return cls(model=critic, training=training, place=worker.place, device=worker.device,
                   loss_cfg=worker.loss_cfg, micro_batches=worker._micro_batches, num_epochs=cfg.num_epochs,
                   num_mini_batches=cfg.num_mini_batches)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """V(tokens[:, :t+1]) at every position t, [B, T] float32 on CPU (position t is the state from which
        tokens[:, t+1] was sampled, aligned with `logprob_mask`); every rank gets every row."""
        rows, seq_len = batch.tokens.shape
        values = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        micro_batches = self.micro_batches(batch.seq_lens, seq_len, slice(0, rows))
        results = run_micro_batches(self.model, micro_batches, batch.tokens,
                                    lambda mb, out: (None, out[..., 0].float()), forward_only=True)
        for mb, mb_values in zip(micro_batches, results):  # results: on the last stage only
            if mb.is_real:
                mb.put(mb_values, values)
        return sum_tensor_over_dp(share_tensor_from_last_stage(values), self.place).cpu()

    def train_step(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """Values before the update -> GAE advantages and returns; then `num_epochs` x `num_mini_batches` critic
        optimizer steps toward the returns. Returns the batch carrying the advantages and the `critic/*` metrics."""
        mask = batch.logprob_mask.float()
        old_values = self.values(batch)
        rewards = torch.tensor(batch.rewards, dtype=torch.float64)
        advantages, returns = gae_targets(self.loss_cfg, rewards=rewards, values=old_values, mask=mask)
        totals: dict[str, float] = {}
        for _ in range(self.num_epochs):
            for rows in split_mini_batches(len(batch.seq_lens), self.num_mini_batches):
                for name, value in self._optimizer_step(batch, old_values, returns, rows).items():
                    totals[name] = totals.get(name, 0.0) + value
        num_steps = self.num_epochs * self.num_mini_batches
        valid = mask > 0
        metrics = {f"critic/{name}": value / num_steps for name, value in totals.items()}
        metrics.update({"critic/values_mean": float(old_values[valid].mean()) if valid.any() else 0.0,
                        "critic/returns_mean": float(returns[valid].mean()) if valid.any() else 0.0,
                        "critic/explained_variance": explained_variance(old_values, returns, mask)})
        return dataclasses.replace(batch, advantages=advantages), metrics

    def _optimizer_step(self, batch: TrainBatch, old_values: torch.Tensor, returns: torch.Tensor, rows: slice
                        ) -> dict[str, float]:
        """One critic optimizer step over `rows`: micro-batch value losses normalised by the rows' global token
        count (so the summed gradient is the mini-batch's token mean), gradients summed over DP ranks."""
        mask = batch.logprob_mask.float()
        num_tokens = float(mask[rows].sum())
        self.training.zero_grad()

        def head(mb: MicroBatch, out: torch.Tensor) -> tuple[torch.Tensor, tuple]:
            mb_mask = mb.take(mask).to(self.device) * float(mb.is_real)
            loss, metrics = clipped_value_loss(
                out[..., 0].float(), old_values=mb.take(old_values).to(self.device),
                returns=mb.take(returns).to(self.device), mask=mb_mask, clip=self.loss_cfg.value_clip,
                num_global_tokens=num_tokens)
            return loss, (metrics, float(mb_mask.sum()) / max(num_tokens, 1.0))

        sums = {"value_loss": 0.0, "value_clipfrac": 0.0}
        micro_batches = self.micro_batches(batch.seq_lens, batch.tokens.shape[1], rows)
        for metrics, share in run_micro_batches(self.training.module, micro_batches, batch.tokens, head,
                                                forward_only=False):
            sums["value_loss"] += float(metrics["value_loss"])
            sums["value_clipfrac"] += float(metrics["value_clipfrac"]) * share
        sums = sum_over_dp(share_from_last_stage(sums), self.place, self.device)
        sums.update(self.training.step())
        return sums

    def state_tensors(self) -> list[torch.Tensor]:
        """The critic's weights and training state (offloaded with the policy's under colocated placement)."""
        return [p.data for p in self.model.parameters()] + self.training.state_tensors()

    def save(self, directory: str, rank: int) -> None:
        """Collective: the critic's weight shards and optimizer state (megatron's sharded format, reshardable like the
        policy's) into `directory`/critic/dist, and this rank's schedule into `directory`/critic/."""
        dist = os.path.join(directory, CRITIC_DIR, "dist")
        os.makedirs(dist, exist_ok=True)
        save_sharded(self.model, self.training, dist)
        torch.save({"scheduler": self.training.scheduler.state_dict()}, critic_rank_file(directory, rank))

    def load(self, directory: str, rank: int) -> None:
        """Collective: the critic's weights and optimizer state from `directory`/critic/ at this rank's layout."""
        dist = os.path.join(directory, CRITIC_DIR, "dist")
        if not os.path.isdir(dist):
            raise FileNotFoundError(f"{directory} holds no critic ({dist} is missing): it was written by a run without "
                                    "loss.advantage_estimator: gae; resume it with the estimator it was trained with")
        path = critic_rank_file(directory, rank)
        if not os.path.exists(path):  # taken with fewer ranks: the schedule is the same on every rank
            path = critic_rank_file(directory, 0)
        scheduler = torch.load(path, map_location="cpu", weights_only=False)["scheduler"]
        load_sharded(self.model, self.training, dist, scheduler)


def critic_rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, CRITIC_DIR, f"rank_{rank:05d}.pt")
