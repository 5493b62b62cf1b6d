"""A run's configuration: YAML file + dotted CLI overrides -> one typed, validated `SluiceConfig`.

Sections are dataclasses owned by their components (glue.rollout.config, glue.rewards.config, glue.loop.config, glue.trainer.config, weight_sync.config, loss); this module only
composes them, applies overrides and reports bad keys (`tree.py`: a nested dict into checked dataclasses). It imports
no backend (ray, megatron, sglang).
May import: launch.slime, and the config sections of glue, loss and weight_sync."""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from glue.loop.config import EvalConfig, SyncConfig
from glue.rewards.config import RewardConfig
from glue.rewards.config import JudgeConfig, RewardModelConfig
from glue.rewards.config import TeacherConfig
from glue.rollout.config import RolloutConfig
from glue.sft.config import SftConfig
from glue.trainer.config import TrainerConfig
from launch.config.tree import ConfigError, apply_override, build, merge
from launch.slime import args as slime_args
from loss import LossConfig
from weight_sync.families import FAMILIES


@dataclass(kw_only=True)
class TinyModelConfig:
    family: Literal[tuple(FAMILIES)] = "qwen2"  # a model family (docs/models.md): dense qwen2, llama, qwen3 (q/k norms), glm4 (post norms), or a mixture of experts for EP and routing replay (qwen3_moe, mixtral, glm4_moe, deepseek_v3: multi-latent attention)
    vocab_size: int = 32  # tokens of the tiny model (>= 260 with tokenizer: true)
    hidden_size: int = 64  # model width
    num_layers: int = 2  # transformer layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 128  # MLP width (qwen3_moe, glm4_moe: each expert is a quarter of it; mixtral: as wide)
    num_experts: int = 4  # MoE families: routed experts per MoE layer (divisible by --expert-model-parallel-size)
    moe_top_k: int = 2  # MoE families: experts each token is routed to (HF num_experts_per_tok), 1 to num_experts
    seed: int = 0  # initial weights' seed
    tokenizer: bool = False  # also train a byte-level BPE tokenizer with a chat template (glue.embedded_engine.tiny_text_model), for text tasks; needs vocab_size >= 260

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"model.tiny.num_experts must be >= 1 and model.tiny.moe_top_k in [1, num_experts], got "
                             f"{self.num_experts} and {self.moe_top_k}")
        if self.tokenizer and self.vocab_size < 260:
            raise ValueError(f"model.tiny.vocab_size must be >= 260 with model.tiny.tokenizer=true (256 bytes and 4 "
                             f"special tokens), got {self.vocab_size}")


@dataclass(kw_only=True)
class ModelConfig:
    path: str | None = None  # local HF checkpoint directory; when null a tiny random model is built from `tiny`
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    shape: dict[str, Any] = field(default_factory=dict)  # model-shape flags as Megatron-LM / slime's MODEL_ARGS give them (--num-layers 36, --swiglu, ...), by flag name: checked against config.json before anything starts, a mismatch refused (the model is built from config.json)


@dataclass(kw_only=True)
class FleetDevices:
    """Where a fleet beside the policy's (teacher, judge) runs: bundles of the placement group of its own, after the
    trainer's and the policy engines' (launch.plan.fleets), never shared with them."""

    tensor_parallel_size: int | None = None  # SGLang --tp-size of each of this fleet's engines; null: cluster.engine_tensor_parallel_size
    gpus: int | None = None  # devices of this whole fleet (its own bundles); null: num_engines x tensor_parallel_size, and when set it must equal that

    def check_devices(self, section: str) -> None:
        for name in ("tensor_parallel_size", "gpus"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{section}.{name} must be >= 1 or null, got {value!r}")


@dataclass(kw_only=True)
class JudgeSection(JudgeConfig, FleetDevices):
    model: ModelConfig = field(default_factory=lambda: ModelConfig(tiny=TinyModelConfig(tokenizer=True, vocab_size=272)))  # the judge's checkpoint (path), or a tiny random text model (tiny, tokenizer: true)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_devices("judge")
        check_text_model("judge.model", self.model)


@dataclass(kw_only=True)
class TeacherSection(TeacherConfig, FleetDevices):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_devices("teacher")


@dataclass(kw_only=True)
class RewardModelSection(RewardModelConfig):
    model: ModelConfig = field(default_factory=lambda: ModelConfig(tiny=TinyModelConfig(tokenizer=True, vocab_size=272)))  # an HF sequence-classification checkpoint with one label (path), or a tiny random one (tiny, tokenizer: true)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_text_model("reward_model.model", self.model)


def check_text_model(key: str, model: ModelConfig) -> None:
    """A reward model reads text: a tiny one needs its tokenizer."""
    if model.path is None and not model.tiny.tokenizer:
        raise ValueError(f"{key}.tiny.tokenizer must be true (a reward model reads text), or set {key}.path")


LOGGERS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # logger -> the package it needs


@dataclass(kw_only=True)
class WandbConfig:
    project: str = "sluice"  # W&B project
    entity: str | None = None  # W&B team or user; null: your default entity
    mode: Literal["offline", "online", "disabled"] = "offline"  # offline needs no network; `wandb sync runs/<name>/wandb/offline-run-*` uploads later
    group: str | None = None  # W&B run group; null: none


@dataclass(kw_only=True)
class RunConfig:
    name: str = "demo"  # run directory is <output_dir>/<name>
    output_dir: str = "runs"  # parent folder of run directories
    num_steps: int = 30  # training steps (one rollout batch each)
    seed: int = 0  # seeds the rollout side: prompt order and per-request sampling seeds
    mode: Literal["sync", "async", "sft"] = "sync"  # sync: every rollout comes from the latest weights; async: rollout runs on while the trainer trains; sft: supervised fine-tuning on the `sft:` section's chat data, no engines (docs/sft.md)
    ray_address: str | None = None  # attach to an existing Ray cluster ("auto" or host:port); null: the one RAY_ADDRESS names (set in a `ray job submit` job, docs/cluster.md), else a private local one
    ray_num_cpus: int = 8  # logical CPUs for a local Ray cluster (more than the real ones so no actor starves)
    overwrite: bool = False  # a folder holding a previous run is refused unless true (replaced once start-up succeeded)
    resume: str = "auto"  # auto: continue from the run folder's latest checkpoint if any; never; or a checkpoint path
    save_interval: int = 50  # write a checkpoint every this many steps (0: only at the end and on a requested stop)
    save_interval_s: float | None = 1800.0  # also write one at the first step boundary this many seconds after the last (null or 0: by steps only): a kill (a pre-empted node, `ray job stop` past its grace) then loses at most this much training plus a step, whatever a step takes; 30 min of the whole cluster's time against the few minutes a large model's checkpoint takes
    keep_checkpoints: int = 2  # the newest this many checkpoints are kept
    max_checkpoint_failures: int = 3  # a checkpoint write that fails (disk full) is said and the run goes on from the previous one; this many in a row stop the run
    stop_grace_s: float = 30.0  # the first Ctrl-C / SIGTERM waits at most this long for the step in progress, then cancels the groups still generating (their samples so far go into the checkpoint), writes the checkpoint and exits 0; a second signal stops at once
    max_restarts: int = 3  # a trainer rank that dies (its process or its Ray actor) has the trainer group restarted from the newest checkpoint in the run this many times per run, then the run stops with one line
    deterministic: bool = False  # same config + seed = same run, interrupted and resumed or not: seeded, batch-invariant sampling (engines' --enable-deterministic-inference), fixed group order, rollouts that never span a weight sync (slower)
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])  # where step records go: jsonl (runs/<name>/metrics.jsonl, always), tensorboard (runs/<name>/tensorboard/), wandb (pip install wandb)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # the W&B run, when run.loggers has wandb
    save_rollouts: bool = False  # write each step's trained groups (tokens, logprobs, versions, rewards, routed experts) to <run dir>/rollouts/step_<N>.json, which run.replay_from reads (docs/debugging.md)
    debug: Literal["off", "rollout_only", "train_only"] = "off"  # rollout_only: generate and save each step's groups, start no trainer (weights stay the initial ones); train_only: train on run.replay_from's saved groups, start no engines
    replay_from: str | None = None  # with run.debug train_only: the run directory whose saved rollouts (run.save_rollouts) are trained on, step N on step N's groups

    def __post_init__(self) -> None:
        for name in self.loggers:
            if not isinstance(name, str) or name not in LOGGERS:
                raise ValueError(f"run.loggers: unknown logger {name!r}; choose from {list(LOGGERS)}")
            if LOGGERS[name] is not None and importlib.util.find_spec(LOGGERS[name]) is None:
                raise ValueError(f"run.loggers has {name} but the {LOGGERS[name]} package is not installed: "
                                 f"pip install {LOGGERS[name]} (or remove {name} from run.loggers)")
        if self.num_steps < 1:
            raise ValueError(f"run.num_steps must be >= 1, got {self.num_steps}")
        if self.save_interval < 0 or self.keep_checkpoints < 1:
            raise ValueError(f"run.save_interval must be >= 0 and run.keep_checkpoints >= 1, got "
                             f"{self.save_interval} and {self.keep_checkpoints}")
        if self.save_interval_s is not None and not self.save_interval_s >= 0:
            raise ValueError(f"run.save_interval_s must be >= 0 seconds (0 or null: checkpoints by steps only), got "
                             f"{self.save_interval_s}")
        if self.max_checkpoint_failures < 1:
            raise ValueError(f"run.max_checkpoint_failures must be >= 1, got {self.max_checkpoint_failures}")
        if not self.stop_grace_s >= 0:
            raise ValueError(f"run.stop_grace_s must be >= 0 (seconds a stop waits for the step in progress), got "
                             f"{self.stop_grace_s}")
        if self.max_restarts < 0:
            raise ValueError(f"run.max_restarts must be >= 0 (trainer group restarts per run), got {self.max_restarts}")
        if self.debug == "train_only" and not self.replay_from:
            raise ValueError("run.debug=train_only needs run.replay_from: the folder of a run that had "
                             "run.save_rollouts: true (or run.debug: rollout_only)")
        if self.replay_from is not None and self.debug != "train_only":
            raise ValueError(f"run.replay_from is read only with run.debug=train_only (got run.debug={self.debug!r}); "
                             "set run.debug: train_only or drop run.replay_from")
        if self.debug != "off" and self.resume not in ("auto", "never"):
            raise ValueError(f"run.debug={self.debug} does not resume from a checkpoint (run.resume={self.resume!r}); "
                             "set run.resume: never")

    @property
    def cluster_address(self) -> str | None:
        """The Ray cluster the run attaches to: run.ray_address, else RAY_ADDRESS (which `ray job submit` sets for
        its job, so a submitted run joins the cluster it was submitted to); None: the run starts a private one."""
        from_env = os.environ.get("RAY_ADDRESS", "")
        return self.ray_address or (from_env if from_env not in ("", "local") else None)

    @property
    def cluster_address_source(self) -> str:
        """Which setting names `cluster_address`: run.ray_address or RAY_ADDRESS."""
        return "run.ray_address" if self.ray_address else "RAY_ADDRESS"

    @property
    def saves_rollouts(self) -> bool:
        """Each step's groups are written to the run folder: asked for, or what a rollout_only run is for."""
        return self.save_rollouts or self.debug == "rollout_only"


@dataclass(kw_only=True)
class ClusterConfig:
    """Where the trainer ranks and the engines go: one Ray placement group, one bundle per device."""

    placement: Literal["disaggregated", "colocated"] = "disaggregated"  # separate devices, or shared ones
    num_nodes: int = 1  # nodes the run spans (each started with `ray start`)
    gpus_per_node: int = 0  # 0: no GPU, every trainer rank and engine gets a CPU bundle instead
    trainer_gpus: int | None = None  # devices of the trainer; null = TP x PP x CP x DP
    engine_gpus: int | None = None  # devices of all engines; null = rollout.num_engines x engine_tensor_parallel_size
    engine_tensor_parallel_size: int = 1  # SGLang --tp-size of every engine
    engine_nodes: int | None = None  # nodes each policy engine spans (SGLang --nnodes); null: TP / gpus_per_node when TP takes more GPUs than a node has, else 1; on CPU (cluster.engine=sglang_strict) set it to rehearse an engine that spans nodes
    engine: Literal["auto", "embedded", "sglang", "sglang_strict"] = "auto"  # auto: SGLang servers on GPU, the embedded engine on CPU; sglang_strict: the embedded engine answering exactly as SGLang does (--sglang-strict), with every SGLang default and check: a CPU rehearsal of an SGLang run
    cpus_per_bundle: float = 1.0  # CPUs each bundle reserves next to its device (CPU bundles: the whole slot)
    node_ip: str | None = None  # the driver node's address in Ray (`ray start --node-ip-address`); null: Ray's pick
    node_wait_s: float = 600  # attached to a cluster: how long to wait for cluster.num_nodes nodes to join
    placement_timeout_s: float = 120  # how long to wait for the cluster to grant the placement group before failing with its free resources, and for an engine or trainer rank started again after its node was lost to get its bundle back; 0: wait until it fits, saying every minute what for
    gpu_memory_gb: float = 80  # memory of one GPU in GB (10^9 bytes): --dry-run's memory plan, and a trainer rank whose training state exceeds it is refused

    def __post_init__(self) -> None:
        for name in ("num_nodes", "engine_tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_node < 0:
            raise ValueError(f"cluster.gpus_per_node must be >= 0 (0 = CPU only), got {self.gpus_per_node}")
        for name in ("trainer_gpus", "engine_gpus", "engine_nodes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be >= 1 or null, got {getattr(self, name)}")
        if not self.cpus_per_bundle > 0:
            raise ValueError(f"cluster.cpus_per_bundle must be > 0, got {self.cpus_per_bundle}")
        if not self.node_wait_s >= 0:
            raise ValueError(f"cluster.node_wait_s must be >= 0, got {self.node_wait_s}")
        if not self.placement_timeout_s >= 0:
            raise ValueError(f"cluster.placement_timeout_s must be >= 0 (0: wait until the cluster has room), got "
                             f"{self.placement_timeout_s}")
        if not self.gpu_memory_gb > 0:
            raise ValueError(f"cluster.gpu_memory_gb must be > 0 (one GPU's memory in GB), got {self.gpu_memory_gb}")

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def engine_kind(self) -> str:
        """Whose semantics the engines have ("sglang" or "embedded"): what sluice may assume of them."""
        if self.engine == "auto":
            return "sglang" if self.uses_gpus else "embedded"
        return "sglang" if self.engine == "sglang_strict" else self.engine

    @property
    def engine_server(self) -> str:
        """Which process serves them: "sglang" (real SGLang servers) or "embedded" (sluice's CPU engine; in
        `--sglang-strict` mode when cluster.engine is sglang_strict)."""
        return "embedded" if self.engine == "sglang_strict" else self.engine_kind


@dataclass(kw_only=True)
class SluiceConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    judge: JudgeSection | None = None  # an LLM judge scoring each finished group (glue.rewards.judge); null: none
    reward_model: RewardModelSection | None = None  # a scalar reward model scoring each finished group (glue.rewards.scalar_rm); null: none
    sft: SftConfig = field(default_factory=SftConfig)  # the chat data of a run.mode sft run
    sglang: dict[str, Any] = field(default_factory=dict)  # SGLang server options (--sglang-*), for every engine
    router: dict[str, Any] = field(default_factory=dict)  # sgl-router options (--router-*)
    teacher: TeacherSection | None = None  # on-policy distillation: the teacher's model and fleet (docs/distillation.md); null: none

    def __post_init__(self) -> None:
        self.reward.check_against(self.rollout.sampling.max_new_tokens)
        if self.run.debug == "train_only" and self.eval.enabled:
            raise ValueError(f"eval.interval={self.eval.interval} needs engines, which run.debug=train_only does not "
                             "start; set eval.interval: 0")
        if self.run.mode == "sft":
            self.sft.check_against(has_tokenizer=self.model.path is not None or self.model.tiny.tokenizer,
                                   temperature=self.trainer.temperature, eval_enabled=self.eval.enabled,
                                   debug=self.run.debug, routing_replay=self.trainer.routing_replay)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                flags: dict[str, Any] | None = None, slime: dict[str, Any] | None = None) -> SluiceConfig:
    """Read YAML (optional), merge pass-through `flags` (nested sections, from --<megatron-field>, --sglang-*,
    --router-*) and slime's arguments (`slime`, by name: launch.slime.args), apply `key.sub=value` overrides (CLI
    wins over YAML), build and validate the typed config. Pass-through values are checked against the backends'
    definitions later, by `launch.plan.run_plan.resolve`."""
    return build(SluiceConfig, compose(path, overrides, flags, slime), prefix="")


def compose(path: str | Path | None = None, overrides: list[str] = (), flags: dict[str, Any] | None = None,
            slime: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run config mapping before typing: YAML, then pass-through flags and slime's arguments, then overrides;
    slime's defaults (where sluice's differ) fill only what is still unset. Notes go to stderr."""
    raw: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        raw = yaml.safe_load(text) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    merge(raw, flags or {})
    notes: list[str] = []
    if slime:
        context = copy.deepcopy(raw)
        for item in overrides:
            apply_override(context, item)
        try:
            slime_args.check_same_keys(slime, flags or {})
            translation = slime_args.translate(slime, context, loggers=tuple(RunConfig().loggers))
        except ValueError as err:
            raise ConfigError(str(err)) from None
        slime_args.apply(raw, translation)
        notes += translation.notes
    for item in overrides:
        apply_override(raw, item)
    if slime:
        try:
            slime_args.check_label_key(raw, slime)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    notes += _sequence_parallel_at_tp1(raw, flags or {}, overrides)
    for note in notes:
        print(f"sluice: note: {note}", file=sys.stderr)
    return raw


def _sequence_parallel_at_tp1(raw: dict[str, Any], flags: dict[str, Any], overrides: list[str]) -> list[str]:
    """`--sequence-parallel` (the Megatron-LM flag) at TP=1 is turned off, as Megatron-LM does; written as a config
    key (trainer.megatron.sequence_parallel) it is still refused there, by megatron-core's rule."""
    trainer = raw.get("trainer") or {}
    from_flag = (flags.get("trainer") or {}).get("megatron", {}).get("sequence_parallel") is True
    as_key = any(item.lstrip("-").startswith("trainer.megatron.sequence_parallel=") for item in overrides)
    if not from_flag or as_key or (trainer.get("tensor_model_parallel_size") or 1) != 1:
        return []
    trainer["megatron"].pop("sequence_parallel", None)
    return ["--sequence-parallel is turned off at --tensor-model-parallel-size 1, as Megatron-LM does"]


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def write_resolved(cfg: SluiceConfig, path: Path) -> None:
    """The fully resolved config, every default included, so a run can be repeated from its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
