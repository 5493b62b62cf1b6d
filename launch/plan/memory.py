"""How many bytes a trainer rank holds, counted from config.json alone: the HF model's parameters sorted by where
megatron-core puts them (TP shards, whole on every TP rank, routed experts over EP x expert TP, pipeline stages as
megatron-core splits them: glue.trainer.pipeline.PipelineSplit),
then per rank its weights, megatron's gradient buffer, fp32 main weights and Adam moments (sharded by the distributed
optimizer over the dense and the expert data-parallel groups) and the critic's and reference model's. Pure
arithmetic; launch.plan.memory_lines prints it in `--dry-run` and refuses a layout that cannot fit a GPU."""
from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from glue.trainer.config import TrainerConfig
from glue.trainer.optim import OFFLOAD_NEEDS_BF16, resolve_precision
from glue.trainer.pipeline import PipelineSplit
from launch.config import ConfigError, SluiceConfig
from launch.plan.model_check import hf_parameters, model_config
from weight_sync.buckets import pipeline_bucket_bytes
from weight_sync.families import family_of
from weight_sync.families.table import EMBEDDING, FINAL_NORM, OUTPUT, REPLICATED

LAYER = re.compile(r"model\.layers\.(\d+)\.")
EXPERTS_LOADED = "mlp.experts."  # where transformers 5 keeps a layer's routed experts (fused, one tensor per kind)


@dataclass(frozen=True)
class ModelParams:
    """An HF model's parameters by where megatron-core puts them."""

    embedding: int  # vocab x hidden, vocab-parallel over TP
    output: int  # lm_head (0 when tied to the embedding)
    final_norm: int
    split: tuple[int, ...]  # per layer: attention and dense-MLP weights, split over TP
    whole: tuple[int, ...]  # per layer: norms and the MoE router, whole on every TP rank
    experts: tuple[int, ...]  # per layer: the routed experts' weights, split over EP x expert TP
    hidden_size: int

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.final_norm + sum(self.split) + sum(self.whole) + sum(self.experts)

    @functools.lru_cache(maxsize=None)
    def stage_sums(self, stages: tuple[range, ...]) -> tuple[tuple[int, int, int], ...]:
        """(split, whole, experts) summed over each pipeline stage's layers (`stages`: each one's layer range)."""
        return tuple(tuple(sum(kind[i] for i in layers) for kind in (self.split, self.whole, self.experts))
                     for layers in stages)


def model_params(hf_config: Any) -> ModelParams:
    """Every HF parameter (counted on the meta device) sorted by its layout kind in weight_sync's name tables; a
    routed expert's tensors (one fused tensor per layer in transformers 5) by their `mlp.experts.` path."""
    family = family_of(hf_config)
    kinds = {family.loaded_name(name): rule.kind for rule in family.rules(hf_config) if rule.expert is None
             for name in rule.hf}
    layers = int(hf_config.num_hidden_layers)
    split, whole, experts = [0] * layers, [0] * layers, [0] * layers
    top = {EMBEDDING.hf[0]: 0, OUTPUT.hf[0]: 0, FINAL_NORM.hf[0]: 0}
    for name, numel in hf_parameters(hf_config).items():
        layer = LAYER.match(name)
        if layer is None and name in top:
            top[name] = numel
        elif layer is not None and name[layer.end():].startswith(EXPERTS_LOADED):
            experts[int(layer.group(1))] += numel
        elif layer is not None and name in kinds:
            (whole if kinds[name] == REPLICATED else split)[int(layer.group(1))] += numel
        else:
            raise ConfigError(f"the memory plan cannot place {hf_config.model_type} parameter {name!r}: it is in no "
                              "name table of weight_sync/families/")
    return ModelParams(embedding=top[EMBEDDING.hf[0]], output=top[OUTPUT.hf[0]], final_norm=top[FINAL_NORM.hf[0]],
                       split=tuple(split), whole=tuple(whole), experts=tuple(experts),
                       hidden_size=int(hf_config.hidden_size))


@dataclass(frozen=True)
class Layout:
    """A trainer's parallel sizes, expert TP resolved."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    split: PipelineSplit = PipelineSplit()  # how the layers split over the pipeline stages

    @classmethod
    def of(cls, t: TrainerConfig) -> "Layout":
        return cls(tp=t.tensor_model_parallel_size, pp=t.pipeline_model_parallel_size, cp=t.context_parallel_size,
                   dp=t.data_parallel_size, ep=t.expert_model_parallel_size,
                   etp=t.expert_tensor_parallel_size or t.tensor_model_parallel_size,
                   split=PipelineSplit.of(t.megatron_values()))

    def stages(self, num_layers: int) -> tuple[range, ...]:
        """Each pipeline stage's layers (ValueError when megatron-core refuses the split)."""
        return self.split.ranges(num_layers, self.pp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """megatron's expert-data-parallel group: the dense ranks of a stage over EP x expert TP."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def describe(self) -> str:
        sizes = f"TP{self.tp} x PP{self.pp}" + (f" x CP{self.cp}" if self.cp > 1 else "") + f" x DP{self.dp}"
        return sizes + (f", EP{self.ep} x ETP{self.etp}" if self.ep > 1 or self.etp != self.tp else "")


@dataclass(frozen=True)
class Settings:
    """What sets a rank's bytes besides its layout."""

    bf16: bool  # bf16 weights with fp32 main weights; else everything fp32 (the weights are the main weights)
    distributed_optimizer: bool
    grads_fp32: bool = True  # megatron DDP's grad_reduce_in_fp32, which the trainer turns on
    critic: bool = False  # loss.advantage_estimator gae: a value model with its own state
    reference: bool = False  # loss.kl_loss_coef > 0: a frozen copy of the weights
    optimizer_offload: float = 0.0  # share of the main weights and Adam moments in host memory (--optimizer-cpu-offload)

    @classmethod
    def of(cls, cfg: SluiceConfig, hf_config: Any) -> "Settings":
        """The run's: trainer.precision resolved as the trainer resolves it; no critic or reference in run.mode sft
        (its trainer takes the SFT loss, not the `loss:` section). An offloaded optimizer with fp32 weights is
        refused here, as the trainer would refuse it at start."""
        t, rl = cfg.trainer, cfg.run.mode != "sft"
        bf16 = resolve_precision(t, hf_config) == "bf16"
        if t.optimizer_offload_fraction() and not bf16:
            raise ConfigError(OFFLOAD_NEEDS_BF16)
        return cls(bf16=bf16, distributed_optimizer=t.use_distributed_optimizer,
                   grads_fp32=bool(t.megatron.get("grad_reduce_in_fp32", True)),
                   critic=rl and cfg.loss.uses_critic, reference=rl and cfg.loss.kl_loss_coef > 0,
                   optimizer_offload=t.optimizer_offload_fraction())

    @property
    def weight_bytes(self) -> int:
        return 2 if self.bf16 else 4


@dataclass(frozen=True)
class StateBytes:
    """On the GPU (`total`), and the offloaded optimizer state in host memory besides."""

    weights: int
    gradients: int
    main_weights: int
    adam_moments: int
    host: int = 0  # main weights and Adam moments megatron's hybrid optimizer keeps in host memory

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.main_weights + self.adam_moments


@dataclass(frozen=True)
class RankMemory:
    """One rank of pipeline stage `stage` (the TP, DP and EP ranks of a stage hold the same)."""

    stage: int
    layers: range  # the stage's decoder layers
    parameters: int
    policy: StateBytes
    critic: StateBytes | None
    reference: int

    @property
    def total(self) -> int:
        return self.policy.total + (self.critic.total if self.critic else 0) + self.reference


def stage_params(p: ModelParams, layout: Layout, stage: int, *, value_head: bool = False) -> tuple[int, int]:
    """(dense, expert) parameters one rank of pipeline stage `stage` holds: its layers' TP shards, norms and routers
    whole, experts' shards over EP x expert TP; the embedding on the first stage; the final norm and the output layer
    on the last (its own copy of a tied embedding when that lives on another stage; the critic's value head, hidden
    + 1 weights, in its place)."""
    split, whole, experts = p.stage_sums(layout.stages(len(p.split)))[stage]
    dense = split // layout.tp + whole
    if stage == 0:
        dense += p.embedding // layout.tp
    if stage == layout.pp - 1:
        dense += p.final_norm
        if value_head:
            dense += p.hidden_size + 1
        elif p.output or stage > 0:
            dense += (p.output or p.embedding) // layout.tp
    return dense, experts // (layout.ep * layout.etp)


def state_bytes(dense: int, experts: int, layout: Layout, s: Settings) -> StateBytes:
    """megatron's training state for one rank's parameters: the weights, DDP's gradient buffer (fp32 with
    grad_reduce_in_fp32), fp32 main weights (bf16 only) and two fp32 Adam moments, the last two sharded by the
    distributed optimizer over the dense DP group (DP x CP) and the expert-DP group, and the offloaded share of them
    in host memory (megatron's hybrid optimizer moves whole tensors until it has that share: at least that much)."""
    shares = (layout.dp * layout.cp, layout.expert_dp) if s.distributed_optimizer else (1, 1)
    owned = dense / shares[0] + experts / shares[1]
    n = dense + experts
    optimizer = (4 * owned if s.bf16 else 0, 8 * owned)
    device = 1 - s.optimizer_offload
    return StateBytes(weights=n * s.weight_bytes, gradients=n * (4 if s.grads_fp32 else s.weight_bytes),
                      main_weights=round(optimizer[0] * device), adam_moments=round(optimizer[1] * device),
                      host=round(sum(optimizer) * s.optimizer_offload))


def rank_memory(p: ModelParams, layout: Layout, s: Settings) -> list[RankMemory]:
    """The training state of a rank of each pipeline stage."""
    ranks = []
    for stage, layers in enumerate(layout.stages(len(p.split))):
        dense, experts = stage_params(p, layout, stage)
        critic = state_bytes(*stage_params(p, layout, stage, value_head=True), layout, s) if s.critic else None
        ranks.append(RankMemory(stage=stage, layers=layers, parameters=dense + experts,
                                policy=state_bytes(dense, experts, layout, s), critic=critic,
                                reference=(dense + experts) * s.weight_bytes if s.reference else 0))
    return ranks


def trainer_memory(cfg: SluiceConfig) -> list[RankMemory]:
    """Each pipeline stage's rank of the run's trainer."""
    hf_config = model_config(cfg)
    return rank_memory(model_params(hf_config), Layout.of(cfg.trainer), Settings.of(cfg, hf_config))


def fitting_layout(p: ModelParams, layout: Layout, s: Settings, limit: float, *, tp_ok: Callable[[int], bool],
                   experts: int) -> tuple[Layout, Settings, int] | None:
    """The layout nearest `layout` (and its settings: the distributed optimizer turned on, or in bf16 the whole
    optimizer state offloaded to host memory, if need be) whose every rank's training state fits `limit` bytes, with
    that state: on as many GPUs if any does, else on the fewest (up to 1024); offloading only where no layout fits
    without it on those GPUs; changing the fewest sizes. `tp_ok(tp)`: the model splits over that TP. The layout's
    pipeline split (first / last stage sizes) stays: a PP size it cannot take is not offered."""
    found = []
    powers = [2**k for k in range(11)]
    offloads = {s.optimizer_offload, 1.0} if s.bf16 else {s.optimizer_offload}
    for tp, pp, dp, ep, distributed, offload in itertools.product(powers[:4], powers[:5], powers, powers,
                                                                  {s.distributed_optimizer, True}, offloads):
        for etp in {1, tp}:
            candidate = Layout(tp=tp, pp=pp, cp=layout.cp, dp=dp, ep=ep, etp=etp, split=layout.split)
            if (candidate.world > 1024 or not splits(candidate, len(p.split)) or (experts or 1) % ep
                    or (tp * layout.cp * dp) % (ep * etp) or (not experts and etp != tp) or not tp_ok(tp)
                    or (offload and not distributed)):  # the hybrid optimizer runs on the distributed one
                continue
            settings = replace(s, distributed_optimizer=distributed, optimizer_offload=offload)
            peak = max(r.total for r in rank_memory(p, candidate, settings))
            if peak <= limit:
                changes = sum(getattr(candidate, f) != getattr(layout, f) for f in ("tp", "pp", "dp", "ep", "etp"))
                key = (candidate.world != layout.world, candidate.world, offload != s.optimizer_offload,
                       changes + (distributed != s.distributed_optimizer), peak)
                found.append((key, candidate, settings, peak))
    if not found:
        return None
    _, candidate, settings, peak = min(found, key=lambda f: f[0])
    return candidate, settings, peak


def splits(layout: Layout, num_layers: int) -> bool:
    """Whether megatron-core takes the layout's pipeline split of `num_layers` layers."""
    try:
        layout.stages(num_layers)
    except ValueError:
        return False
    return True


FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
         "dp": "trainer.data_parallel_size=", "ep": "--expert-model-parallel-size",
         "etp": "--expert-tensor-parallel-size"}  # how a layout size is set; `=`: a config key, not a flag


def layout_change(old: Layout, new: Layout, s_old: Settings, s_new: Settings, *, needs_sp: bool) -> str:
    """The flags that turn `old` into `new`: `--expert-model-parallel-size 8 trainer.data_parallel_size=4`."""
    flags = [f"{flag}{getattr(new, f)}" if flag.endswith("=") else f"{flag} {getattr(new, f)}"
             for f, flag in FLAGS.items() if getattr(new, f) != getattr(old, f)]
    if s_new.distributed_optimizer != s_old.distributed_optimizer:
        flags.append("trainer.use_distributed_optimizer=true")
    if s_new.optimizer_offload != s_old.optimizer_offload:
        flags.append("--optimizer-offload-fraction 1" if s_old.optimizer_offload else "--optimizer-cpu-offload")
    if needs_sp and new.tp > 1:
        flags.append("--sequence-parallel")
    return " ".join(flags)


@dataclass(frozen=True)
class IpcBuffers:
    """The ipc transport's bucket buffers on each GPU that holds an engine rank (a full bucket copy each, made by the
    trainer rank there, weight_sync.channels.IpcChannel): `count` of `bucket` bytes, allocated with the first sync and
    reused by every later one (kept while the trainer trains and the engines generate)."""

    count: int
    bucket: int

    @property
    def total(self) -> int:
        return self.count * self.bucket


def ipc_buffers(cfg: SluiceConfig, total_bytes: int) -> IpcBuffers | None:
    """The run's ipc buffers for a sync of `total_bytes`, as the bridge sizes them (two pipelined when there are
    several buckets, buckets of `pipeline_bucket_bytes`); None unless weights travel by ipc."""
    s = cfg.sync
    if s.transport != "ipc" or cfg.run.mode == "sft":
        return None
    pipeline = s.backend == "nccl" if s.pipeline is None else s.pipeline
    bucket = pipeline_bucket_bytes(total_bytes, s.bucket_bytes) if pipeline else s.bucket_bytes
    count = 2 if pipeline and math.ceil(total_bytes / bucket) > 1 else 1
    return IpcBuffers(count=count, bucket=min(bucket, total_bytes))
