"""One trainer rank: megatron-core model, DDP and optimizer (glue.trainer.optim) on this rank's shard (TP shard of
its pipeline stage's layers, its experts under EP, its rows of the batch under DP; `glue.trainer.parallel` says
which, `glue.trainer.pipeline` runs the micro-batches through megatron's schedules). `TrainerGroup` runs one per rank as a Ray actor; it turns a
`TrainBatch` into a PPO update (old logprobs recomputed or from version snapshots, loss from `loss/`) and its weights
into HF-named tensors for the weight bridge. A plain class, so tests can also drive it from spawned processes.
"""
from __future__ import annotations

import functools
import os
import socket
import sys
from typing import Any

import torch

from glue.trainer import cpu_compat, model, offload, optim
from glue.trainer.checkpointing import load_rank, save_rank
from glue.trainer.config import CONTEXT_PARALLEL_NEEDS, TrainerConfig
from glue.trainer.critic import Critic
from glue.trainer.packing import MicroBatch, plan_micro_batches, split_mini_batches
from glue.trainer.parallel import RankPlace, full_hf_state, hf_weight_specs, sum_over_dp, sum_tensor_over_dp
from glue.trainer.pipeline import run_micro_batches, share_from_last_stage, share_tensor_from_last_stage
from glue.trainer.rank_output import write_output_to
from glue.trainer.reference import RefCheckpoint, load_reference, resolve_ref_load
from glue.trainer.routing_replay import RoutingReplay, logprob_gaps, replay_args
from glue.trainer.snapshots import PolicySnapshots, pre_update_metrics
from glue.trainer.token_budget import resolve_token_budget
from glue.trainer.weight_stream import TrainerWeightSender
from glue.types import TrainBatch
from loss import LossConfig, SftLossConfig, compute_loss, count_tokens_and_seqs, ewma_proximal_logprobs
from weight_sync.buckets import dtype_to_str


class TrainerWorker:
    """Construct anywhere; `initialize()` joins the trainer's process group and loads the model.

    `version` is the policy version of the live weights: 0 as loaded, +1 per `train_step` (the version the next
    weight sync publishes). `keep_versions`: how many versions `trainer.old_logprobs: snapshot` keeps on the host
    (the launcher passes sync.max_staleness + 1, so every version an admitted token can carry is kept).
    """

    def __init__(self, *, model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig | SftLossConfig, rank: int,
                 world_size: int, keep_versions: int = 1, log_path: str | None = None):
        if log_path is not None:  # before anything can print: this rank's output goes to the run's logs/
            write_output_to(log_path, f"sluice: trainer rank {rank} of {world_size}")
        if world_size != cfg.world_size:
            raise ValueError(f"trainer world size {world_size} != TP x PP x CP x DP = {cfg.world_size}; start exactly "
                             "that many workers")
        if cfg.context_parallel_size != 1:
            raise ValueError(f"trainer.context_parallel_size={cfg.context_parallel_size}: {CONTEXT_PARALLEL_NEEDS}; "
                             "set trainer.context_parallel_size: 1")
        if loss_cfg.kl_reward_coef > 0:
            raise ValueError("loss.kl_reward_coef > 0 needs reference logprobs before the advantages are computed, "
                             "which this trainer does not provide yet; use loss.kl_loss_coef (KL as a loss term)")
        self.model_path, self.cfg, self.loss_cfg = model_path, cfg, loss_cfg
        self.rank, self.world_size = rank, world_size
        self.version = 0
        # host copies of this rank's shard per version, only when the loss takes old logprobs from the trainer
        uses_snapshots = loss_cfg.needs_old_logprobs and cfg.old_logprobs == "snapshot"
        self._snapshots = PolicySnapshots(keep_versions) if uses_snapshots else None
        self._weight_sender: Any = None  # glue.trainer.weight_stream.TrainerWeightSender, made on first use
        self._offloaded: list[Any] | None = None  # host copies while offloaded (colocated placement)
        self.critic: Any = None  # glue.trainer.critic.Critic with loss.advantage_estimator gae, built by initialize

    def rendezvous_address(self) -> tuple[str, int]:
        """This host's address (Ray's node IP inside an actor, else loopback) and a free port, for rank 0."""
        ray = sys.modules.get("ray")
        host = ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"
        with socket.socket() as sock:
            sock.bind(("", 0))
            return host, sock.getsockname()[1]

    def initialize(self, master_addr: str, master_port: int) -> str:
        """Init torch.distributed + megatron parallel state, build the model from HF weights, make the optimizer.
        Returns the start-up line saying the dtypes of the checkpoint, weights, main weights and the bridge."""
        from megatron.core import parallel_state, tensor_parallel

        cpu_compat.apply()
        torch.manual_seed(self.cfg.seed)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        torch.distributed.init_process_group("gloo" if cpu_compat.is_cpu_only() else "nccl",
                                             rank=self.rank, world_size=self.world_size)
        self.device = torch.device("cpu") if cpu_compat.is_cpu_only() else torch.device("cuda", torch.cuda.current_device())
        parallel_state.initialize_model_parallel(**self.cfg.parallel_state_sizes())
        tensor_parallel.model_parallel_cuda_manual_seed(self.cfg.seed)
        self.hf_config = model.read_hf_config(self.model_path)
        self.precision = optim.resolve_precision(self.cfg, self.hf_config)
        build = dict(tp_size=self.cfg.tensor_model_parallel_size, megatron_args=self.cfg.megatron_values(),
                     precision=self.precision, layer_spec_choice=self.cfg.layer_spec,
                     compiled=self.cfg.compile)
        self.model = model.build_model(self.hf_config, **build)
        self.place = RankPlace.from_parallel_state(self.model)
        model.load_hf_weights(self.model, self.model_path, self.hf_config, self.place.layout())
        self.model.to(self.device)
        self.reference = None  # the frozen reference policy of the KL loss term (glue.trainer.reference)
        if self.loss_cfg.kl_loss_coef > 0:
            self.reference = model.build_model(self.hf_config, **build)
            ref = resolve_ref_load(self.cfg.ref_load) if self.cfg.ref_load else RefCheckpoint("hf", self.model_path)
            load_reference(self.reference, ref, self.hf_config, self.place.layout())
            self.reference.requires_grad_(False).to(self.device)
        # megatron's DDP (its gradient and parameter buffers now back self.model's parameters) and optimizer
        self.training = optim.build(self.model, self.cfg, self.precision)
        self.max_tokens = resolve_token_budget(self.cfg.max_tokens_per_micro_batch, optim.unwrap(self.model),
                                               self.hf_config.vocab_size, self.device)
        self.replay = RoutingReplay(self.model) if self.cfg.routing_replay else None  # MoE routing replay (R3)
        if self.loss_cfg.uses_critic:  # GAE: a value model beside the policy (docs/critic.md)
            self.critic = Critic.build(self, build)
        if self._snapshots is not None:
            self._snapshots.save(self.version, self.model)
        return optim.precision_line(self.precision, self.cfg, self.hf_config, self.place.dp_size)

    def _micro_batches(self, seq_lens: list[int], seq_len: int, rows: slice) -> list[MicroBatch]:
        """This rank's micro-batches over `rows` of a [B, seq_len] batch (glue.trainer.packing): packed rows when
        trainer.max_tokens_per_micro_batch is set (auto: sized from CUDA memory at start), else padded rows; the
        samples split over DP ranks per trainer.dp_balance; the same count on every DP rank, and the same shapes
        where experts are spread over ranks."""
        return plan_micro_batches(seq_lens, seq_len, rows, max_tokens=self.max_tokens,
                                  micro_batch_size=self.cfg.micro_batch_size, dp_rank=self.place.dp_rank,
                                  dp_size=self.place.dp_size, even_shapes=self.place.ep_size > 1,
                                  balance=self.cfg.dp_balance)

    def _forward(self, tokens: torch.Tensor, logits: torch.Tensor, with_entropy: bool = False,
                 seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The end of one micro-batch's forward, on the last pipeline stage: (logprobs [R, L], entropy [R, L] or
        None) of its token rows `tokens` [R, L] from their logits; `seq_ids` marks packed samples. Differentiable
        when grad is enabled."""
        tokens = tokens.to(self.device)
        seq_ids = None if seq_ids is None else seq_ids.to(self.device)
        return model.token_logprobs_and_entropy(logits, tokens, self.cfg.temperature, seq_ids,
                                                with_entropy=with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch | torch.Tensor, with_entropy: bool = False,
                         reference: bool = False, seq_lens: list[int] | None = None, replay: bool = True,
                         routed_experts: torch.Tensor | None = None) -> Any:
        """Logprob of tokens[:, t+1] at position t with the current weights (or the reference model's), [B, T] on
        CPU (0 at each sample's last token when packing, in the last column always); each DP rank computes its
        micro-batches and every rank gets all of the rows, in the batch's order. A bare token tensor is taken with
        `seq_lens` (default: every row is real to the end) and, to replay routing, its rows' `routed_experts`. With
        trainer.routing_replay the policy routes through the batch's `routed_experts` unless `replay` is False.

        With `with_entropy`, returns `(logprobs, entropy)`, both [B, T].
        """
        if reference and self.reference is None:
            raise RuntimeError("this trainer keeps no reference model: it is built only when loss.kl_loss_coef > 0")
        tokens = batch.tokens if isinstance(batch, TrainBatch) else batch
        if isinstance(batch, TrainBatch):
            seq_lens = batch.seq_lens
        rows, seq_len = tokens.shape
        module = self.reference if reference else self.model
        logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=self.device)
        entropy = torch.zeros_like(logprobs) if with_entropy else None

        def head(mb: MicroBatch, logits: torch.Tensor) -> tuple[None, tuple]:
            return None, self._forward(mb.take(tokens), logits, with_entropy, mb.seq_ids)

        micro_batches = self._micro_batches(seq_lens or [seq_len] * rows, seq_len, slice(0, rows))
        replaying = replay and not reference and self.replay is not None
        if replaying and isinstance(batch, TrainBatch):
            routing = replay_args(self.replay, batch)
        else:
            routing = {"replay": self.replay, "routed_experts": routed_experts} if replaying and \
                routed_experts is not None else {}
        results = run_micro_batches(module, micro_batches, tokens, head, forward_only=True, **routing)
        for mb, (mb_logprobs, mb_entropy) in zip(micro_batches, results):  # results: on the last stage only
            if mb.is_real:
                mb.put(mb_logprobs, logprobs)
                if with_entropy:
                    mb.put(mb_entropy, entropy)
        logprobs = sum_tensor_over_dp(share_tensor_from_last_stage(logprobs), self.place).cpu()
        if not with_entropy:
            return logprobs
        return logprobs, sum_tensor_over_dp(share_tensor_from_last_stage(entropy), self.place).cpu()

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's value at every position of the batch, [B, T] on CPU (loss.advantage_estimator gae only)."""
        if self.critic is None:
            raise RuntimeError("this trainer has no critic: it is built only with loss.advantage_estimator: gae")
        return self.critic.values(batch)

    @torch.no_grad()
    def compute_old_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The old (proximal) logprobs `train_step` trains against, [B, T] on CPU, per `trainer.old_logprobs`:
        `recompute`: the current weights' logprobs (the classic proximal policy); `snapshot`: each trained token's
        logprob under the weights of the version that generated it (`batch.versions`), 0 where logprob_mask is 0."""
        return self._old_logprobs(batch)[0]

    def _old_logprobs(self, batch: TrainBatch, with_entropy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """(old logprobs [B, T], the current weights' entropy [B, T] when recomputing `with_entropy`, metrics)."""
        if self._snapshots is not None:
            old_logprobs, metrics = self._snapshots.old_logprobs(batch, self.model, self.version, self.compute_logprobs)
            return old_logprobs, None, metrics
        if with_entropy:
            logprobs, entropy = self.compute_logprobs(batch, with_entropy=True)
            return logprobs, entropy, {}
        return self.compute_logprobs(batch), None, {}

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """PPO update(s) on `batch` at policy version `self.version`: old logprobs per `trainer.old_logprobs` (none
        when the loss takes them from the rollout or its EWMA), then `num_epochs` x `num_mini_batches` optimizer
        steps, each accumulating micro-batch gradients normalised by the mini-batch's global counts. The version
        then moves by one however many optimizer steps ran: engines load one version per train_step."""
        old_logprobs, entropy, metrics, proximal = None, None, {}, None
        if self.critic is not None:  # the critic's values give the advantages; it trains toward the returns
            batch, metrics = self.critic.train_step(batch)
        if self.loss_cfg.needs_old_logprobs:
            old_logprobs, entropy, old_metrics = self._old_logprobs(batch, with_entropy=True)
            metrics.update(old_metrics)
        if self._snapshots is not None and self.loss_cfg.needs_proximal_logprobs:
            # decoupled PPO: the snapshots are the behaviour policy; the clip is against the weights before the update
            proximal, entropy = self.compute_logprobs(batch, with_entropy=True)
        ref_logprobs = self.compute_logprobs(batch, reference=True) if self.reference is not None else None
        replay_gaps = {}
        if self.replay is not None:  # R3's metrics; with snapshots also the gap at each token's version, unreplayed
            at_version = None if self._snapshots is None or old_logprobs is None else (
                old_logprobs, self._snapshots.old_logprobs(batch, self.model, self.version,
                                                           functools.partial(self.compute_logprobs, replay=False))[0])
            replay_gaps = logprob_gaps(batch, self.compute_logprobs, self.replay, self.version, at_version)
        mini_batches = split_mini_batches(batch.tokens.shape[0], self.cfg.num_mini_batches)
        # PPO-EWMA's state per token (a copy): the rollout logprobs, then one update per optimizer step that trains it
        ewma = (batch.rollout_logprobs.to(self.device, torch.float32, copy=True)
                if self.loss_cfg.old_logprobs_from == "ewma" else None)
        totals: dict[str, float] = {}
        for _ in range(self.cfg.num_epochs):
            for rows in mini_batches:
                for name, value in self._optimizer_step(batch, old_logprobs, ref_logprobs, rows, ewma,
                                                        proximal).items():
                    totals[name] = totals.get(name, 0.0) + value
        num_steps = self.cfg.num_epochs * len(mini_batches)
        metrics.update({f"train/{name}": value / num_steps for name, value in totals.items()})
        metrics.update(pre_update_metrics(batch, old_logprobs, entropy))
        if self.replay is not None:
            metrics.update(replay_gaps, **self.replay.agreement_over_ranks())
        self.version += 1
        if self._snapshots is not None:
            self._snapshots.save(self.version, self.model)
        metrics["weights/version"] = float(self.version)
        return metrics

    def _optimizer_step(self, batch: TrainBatch, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                        rows: slice, ewma: torch.Tensor | None = None, proximal: torch.Tensor | None = None
                        ) -> dict[str, float]:
        """One optimizer step over `rows` of the batch (this DP rank trains on its micro-batches, gradients are
        summed over ranks); returns its loss, grad norm and the loss's metrics (token-weighted means over
        micro-batches and DP ranks; `pg_loss` shares are summed)."""
        num_tokens, num_seqs = count_tokens_and_seqs(batch.logprob_mask[rows].float())
        self.training.zero_grad()

        def head(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, tuple]:
            loss, metrics, share = self._micro_batch_loss(batch, mb, logits, old_logprobs, ref_logprobs,
                                                          num_tokens, num_seqs, ewma, proximal)
            return loss, (float(loss.detach()), metrics, share)

        sums: dict[str, float] = {"loss": 0.0}
        micro_batches = self._micro_batches(batch.seq_lens, batch.tokens.shape[1], rows)
        for loss, loss_metrics, share in run_micro_batches(self.training.module, micro_batches, batch.tokens, head,
                                                           forward_only=False,  # the backwards ran too
                                                           **replay_args(self.replay, batch)):
            sums["loss"] += loss
            for name, value in loss_metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value) * (1.0 if name == "pg_loss" else share)
        sums = sum_over_dp(share_from_last_stage(sums), self.place, self.device)
        try:
            sums.update(self.training.step())  # gradients finalised, checked, clipped; the weights updated
        except FloatingPointError as error:
            raise FloatingPointError(f"{error} at version {self.version}; lower trainer.lr or check the batch") from None
        return sums

    def _micro_batch_loss(self, batch: TrainBatch, mb: MicroBatch, logits: torch.Tensor,
                          old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, num_tokens: int,
                          num_seqs: int, ewma: torch.Tensor | None = None, proximal: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, dict[str, Any], float]:
        """One micro-batch's loss from its logits (normalised by the mini-batch's global counts), its metrics and its
        share of the mini-batch's trained tokens; `ewma` (PPO-EWMA's state, [B, T]) gets this evaluation's update. A
        padding micro-batch's mask is all 0: its loss is 0 but its forward and backward still meet the other ranks'
        collectives."""
        def take(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else mb.take(x).to(self.device)

        logprobs, entropy = self._forward(mb.take(batch.tokens), logits, self.loss_cfg.entropy_coef > 0, mb.seq_ids)
        mask = take(batch.logprob_mask.float()) * float(mb.is_real)
        loss, metrics = compute_loss(  # the RL policy loss, or SFT's cross-entropy (loss.SftLossConfig)
            self.loss_cfg, logprobs=logprobs, old_logprobs=take(old_logprobs),
            rollout_logprobs=take(batch.rollout_logprobs.float()), advantages=take(batch.advantages.float()),
            mask=mask, num_global_tokens=num_tokens, num_global_seqs=num_seqs, entropy=entropy,
            seq_ids=None if mb.seq_ids is None else mb.seq_ids.to(self.device),
            ewma_logprobs=take(ewma), ref_logprobs=take(ref_logprobs), proximal_logprobs=take(proximal))
        if ewma is not None and mb.is_real and isinstance(self.loss_cfg, LossConfig):  # only an RL loss has an EWMA
            mb.put(ewma_proximal_logprobs(state=take(ewma), logprobs=logprobs, beta=self.loss_cfg.ewma_beta), ewma)
        return loss, metrics, float(mask.sum()) / max(num_tokens, 1)

    # ---- colocated placement: give the device to the engines during rollout ----
    def _state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of this rank's training state: the policy's weights (and the reference model's, with a KL
        term), megatron's gradient / parameter buffers, main weights and Adam moments."""
        params = [p.data for p in self.model.parameters()]
        if self.reference is not None:
            params += [p.data for p in self.reference.parameters()]
        critic = self.critic.state_tensors() if self.critic is not None else []
        return params + self.training.state_tensors() + critic

    def training_state_bytes(self) -> int:
        """Bytes the weights, gradient buffers, main weights and optimizer state hold right now (0 while
        offloaded)."""
        return offload.state_bytes(self._state_tensors())

    def offload(self) -> int:
        """Copy the training state to host memory (glue.trainer.offload) and free its device storage; returns
        `training_state_bytes()` (0). Idempotent."""
        if self._offloaded is None:
            if self._weight_sender is not None:
                self._weight_sender.drop_staged()
            self._offloaded = offload.to_host(self._state_tensors())
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the freed blocks back to the driver, where the engines can take them
        return self.training_state_bytes()

    def onload(self) -> int:
        """Bring the training state back to the device; returns `training_state_bytes()`."""
        if self._offloaded is not None:
            saved, self._offloaded = self._offloaded, None
            offload.to_device(saved)
        return self.training_state_bytes()

    def hf_weight_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(HF name, dtype name, full shape) of every tensor the weight bridge sends, in bucket order."""
        return [(n, dtype_to_str(dtype), shape) for n, dtype, shape in hf_weight_specs(self.model, self.hf_config, self.place)]

    def full_hf_state(self) -> dict[str, torch.Tensor]:
        """Every weight as a full HF-named CPU tensor on rank 0, {} elsewhere (collective: every rank calls it)."""
        return full_hf_state(self.model, self.hf_config, self.place, keep=self.rank == 0)

    # ---- checkpoints (glue.trainer.checkpointing): HF weights, optimizer and RNG state per rank ----
    def save_checkpoint(self, directory: str) -> None:
        """Collective: this rank's part of a checkpoint into `directory`."""
        save_rank(self, directory)

    def load_checkpoint(self, directory: str) -> int:
        """This rank's part of the checkpoint in `directory`; returns the policy version it was taken at."""
        return load_rank(self, directory)

    # ---- the weight bridge's source calls (weight_sync.transports.WeightSource): every rank takes part ----
    def _weights(self) -> Any:
        if self._weight_sender is None:
            self._weight_sender = TrainerWeightSender(self.model, self.hf_config, self.place)
        return self._weight_sender

    def open_weight_channel(self, name: str, spec: dict[str, Any]) -> None:
        """Every rank learns the channel's buckets; rank 0 opens it (a weight group, a shared segment or a
        checkpoint directory)."""
        self._weights().open(name, spec)

    def stage_weights(self, with_tensor_checksums: bool = False) -> None:
        """Collective: start a sync of the current weights (nothing is gathered until a bucket is sent)."""
        self._weights().stage(self.version, with_tensor_checksums)

    def weight_source_plan(self) -> list[Any]:
        """Collective: the parallel weight sources of this layout (glue.trainer.weight_stream.SourcePart list)."""
        return self._weights().source_plan()

    def send_weight_bucket(self, channel: str, index: int) -> dict[str, Any]:
        """Collective: gather bucket `index` of the staged weights onto rank 0, which sends it into `channel`
        (glue.trainer.weight_stream)."""
        return self._weights().send(channel, index, self.version)

    def prepare_weight_bucket(self, channel: str, index: int, delta: bool) -> dict[str, Any]:
        """Collective: gather bucket `index` onto its source rank, which chooses whether it goes whole or as a delta
        (delta sync; glue.trainer.weight_stream)."""
        return self._weights().prepare(channel, index, self.version, delta)

    def close_weight_channel(self, name: str) -> None:
        if self._weight_sender is not None:
            self._weight_sender.close(name)

    def shutdown(self) -> None:
        """Leave the process groups and remove what only interpreter exit would (the actor is killed afterwards,
        with no exit handlers run)."""
        if self._weight_sender is not None:
            self._weight_sender.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        remove_wandb_staging_dirs()


def remove_wandb_staging_dirs() -> None:
    """megatron-core imports wandb for nothing (inference/contexts/dynamic_context.py), and that import makes two
    staging folders in the temp dir (`tmp*wandb-media`, `tmp*wandb-artifacts`) that wandb removes only at
    interpreter exit; a killed Ray actor never gets there, so every trainer rank left two behind. Removes them if
    wandb made them in this process (its private attributes, looked up defensively: nothing happens if they move)."""
    import sys

    for module, owner, attr in (("wandb.sdk.data_types._private", None, "MEDIA_TMP"),
                                ("wandb.sdk.artifacts.artifact", "Artifact", "_TMP_DIR")):
        loaded = sys.modules.get(module)
        holder = getattr(loaded, owner, None) if owner and loaded else loaded
        staging = getattr(holder, attr, None)
        if hasattr(staging, "cleanup"):
            staging.cleanup()
