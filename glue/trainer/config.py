"""Typed settings of the megatron-core trainer (the `trainer:` section of a run config).

Light module: imports no backend, so a run config can be built and validated anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# The parallel sizes the glue itself reads (placement, world size); every other megatron-core field travels in
# `megatron` untouched. The launcher routes `--tensor-model-parallel-size` etc. here by their megatron names.
CONTEXT_PARALLEL_NEEDS = (
    "context parallelism is not run by this trainer: it needs Transformer-Engine's attention (the TE layer spec, "
    "whose TEDotProductAttention exchanges K/V between CP ranks; transformer-engine installs only with CUDA), each "
    "micro-batch split into 2 x CP load-balanced sequence chunks per rank, and the per-token logprobs gathered back "
    "over the CP group; this local-spec trainer has none of these yet")
PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size")


@dataclass(kw_only=True)
class TrainerConfig:
    tensor_model_parallel_size: int = 1  # Megatron TP degree; the trainer starts TP x PP x CP x DP Ray actors
    pipeline_model_parallel_size: int = 1  # Megatron PP degree (layers split into stages, megatron's 1F1B schedule)
    context_parallel_size: int = 1  # Megatron CP degree (sequence split across ranks; not run yet: needs TE attention)
    expert_model_parallel_size: int = 1  # Megatron EP degree (experts split across TP x CP x DP ranks)
    expert_tensor_parallel_size: int | None = None  # Megatron ETP degree of expert layers (null = TP)
    data_parallel_size: int = 1  # trainer replicas; world size = TP x PP x CP x DP
    megatron: dict[str, Any] = field(default_factory=dict)  # other megatron-core config fields, passed through as-is
    layer_spec: Literal["auto", "local", "te"] = "auto"  # megatron-core layer spec: te (Transformer Engine's fused GPU kernels; needs transformer_engine on the trainer nodes), local (plain PyTorch modules, runs anywhere) or auto (te where transformer_engine imports, else local)
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # bf16: bf16 model weights with fp32 main weights, gradients and Adam state (megatron's mixed precision); fp32: everything fp32; auto: bf16 when the checkpoint's torch_dtype is bf16/fp16 or a megatron flag asks for it (--bf16, --params-dtype bfloat16), else fp32
    bf16_rounding: Literal["nearest", "dithered"] = "nearest"  # bf16: how the fp32 main weights become the bf16 model weights after each step: nearest (megatron's cast) or dithered (a fixed per-weight dither: the bf16 weights follow updates far below bf16's spacing on average, where nearest holds them still; docs/precision.md)
    compile: bool = False  # torch.compile the transformer layers' elementwise work (RMSNorms, RoPE, SwiGLU: inductor fuses each into a kernel or two, forward and backward) on the local layer spec (not on the unfused reference, --attention-backend local); the first micro-batches pay the compile (seconds per function); `make bench` trainer_speed counts the ops it saves, `make gpu-bench` measures it on a GPU
    use_distributed_optimizer: bool = True  # megatron's distributed optimizer: main weights and Adam state sharded over the data-parallel ranks (false: each DP rank holds all of its model shard's state)
    lr: float = 1e-3  # Adam learning rate, the peak of the schedule (tiny random models need a high one)
    critic_lr: float | None = None  # loss.advantage_estimator gae: the critic's Adam learning rate (its own optimizer and schedule; null = lr)
    min_lr: float = 0.0  # the schedule's floor for cosine / linear decay
    lr_warmup_steps: int = 0  # optimizer steps over which the lr rises linearly from 0 to lr (step k of the warm-up runs at lr * k / lr_warmup_steps)
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"  # lr after the warm-up: constant, or decaying to min_lr at lr_decay_steps (megatron's OptimizerParamScheduler)
    lr_decay_steps: int | None = None  # optimizer step at which cosine / linear decay reaches min_lr (needed for those styles; counts every optimizer step: num_mini_batches x num_epochs per train step)
    weight_decay: float = 0.0  # Adam decoupled weight decay (megatron: not applied to biases and norms)
    adam_beta1: float = 0.9  # Adam beta1
    adam_beta2: float = 0.999  # Adam beta2
    adam_eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # max global gradient norm (0 turns clipping off)
    micro_batch_size: int = 8  # rows per forward/backward when not packing; gradients accumulate over the batch
    max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"  # sequence packing: whole samples packed (first-fit decreasing) into one row of at most this many tokens per forward, attention kept within each sample; auto = on CUDA a budget sized from the device memory left after the model and optimizer (glue.trainer.token_budget), on CPU padded rows; null or 0 = padded rows of micro_batch_size (a longer sample gets a row of its own)
    dp_balance: Literal["tokens", "rows"] = "tokens"  # how a mini-batch's samples are split over DP ranks: tokens (each rank gets near-equal trained tokens: longest sample first to the rank with the fewest, so one long answer does not leave the other ranks idle; padded rows keep equal row counts per rank) or rows (contiguous near-equal shares by sample count)
    routing_replay: bool = False  # MoE routing replay (R3): every MoE layer routes each token through the experts the engine chose (needs rollout.return_routed_experts); logs moe/routing_agreement and the logprob gap with and without it, split by staleness (two extra forward-only passes per step; with snapshot old logprobs one more per version held, for the gap at each token's own version)
    num_mini_batches: int = 1  # optimizer steps (PPO mini-batches) per train_step (the policy version moves by 1 per train_step)
    num_epochs: int = 1  # passes over the batch per train_step
    seed: int = 0  # parameter-init / dropout RNG seed (weights come from the HF checkpoint)
    temperature: float = 1.0  # logits are divided by this before log-softmax, to match the engines' sampling
    old_logprobs: Literal["recompute", "snapshot"] = "recompute"  # when loss.old_logprobs_from is given: recompute with the current weights before the update, or snapshot (host copies of the last max_staleness + 1 versions: each token's exact old logprob at its own version)
    num_cpus_per_worker: float = 0.5  # Ray CPUs reserved per trainer actor (fractional so actors never starve)
    ref_load: str | None = None  # the reference policy of the KL loss term (slime's --ref-load; read only when loss.kl_loss_coef > 0): an HF checkpoint directory or a sluice checkpoint (a step_<N> folder, or a run's checkpoints/ or run folder: the newest); null: the initial policy, model.path
    master_port: int = 0  # rendezvous port of the trainer's torch.distributed group (0 = pick a free one)

    def __post_init__(self) -> None:
        for name in (*PARALLEL_SIZES, "data_parallel_size", "micro_batch_size", "num_mini_batches", "num_epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"trainer.{name} must be an integer >= 1, got {value!r}")
        budget = self.max_tokens_per_micro_batch
        if budget not in (None, "auto") and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"trainer.max_tokens_per_micro_batch must be an integer >= 1, auto (sized from GPU "
                             f"memory) or null / 0 (padded micro-batches of micro_batch_size rows), got {budget!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"trainer.compile must be true or false, got {self.compile!r}")
        if self.dp_balance not in ("tokens", "rows"):
            raise ValueError(f"trainer.dp_balance must be 'tokens' or 'rows', got {self.dp_balance!r}")
        if self.layer_spec not in ("auto", "local", "te"):
            raise ValueError(f"trainer.layer_spec must be auto, local or te, got {self.layer_spec!r}")
        if not self.lr > 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if self.critic_lr is not None and not self.critic_lr > 0:
            raise ValueError(f"trainer.critic_lr must be > 0 (or null to use trainer.lr), got {self.critic_lr}")
        self._check_precision_and_schedule()
        self._check_optimizer_offload()
        if self.weight_decay < 0:
            raise ValueError(f"trainer.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"trainer.adam_eps must be > 0, got {self.adam_eps}")
        if self.grad_clip < 0:
            raise ValueError(f"trainer.grad_clip must be >= 0 (0 = no clipping), got {self.grad_clip}")
        if self.old_logprobs not in ("recompute", "snapshot"):
            raise ValueError(f"trainer.old_logprobs must be 'recompute' or 'snapshot', got {self.old_logprobs!r}")
        if not self.temperature > 0:
            raise ValueError(f"trainer.temperature must be > 0 (it must equal the sampling temperature), got {self.temperature}")
        if not self.num_cpus_per_worker > 0:
            raise ValueError(f"trainer.num_cpus_per_worker must be > 0, got {self.num_cpus_per_worker}")
        if self.ref_load is not None and (not isinstance(self.ref_load, str) or not self.ref_load.strip()):
            raise ValueError(f"trainer.ref_load must be a checkpoint directory or null (the initial policy), got "
                             f"{self.ref_load!r}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"trainer.master_port must be a TCP port or 0, got {self.master_port}")
        self._check_parallel_layout()
        self._check_te_options()

    def _check_precision_and_schedule(self) -> None:
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"trainer.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.bf16_rounding not in ("nearest", "dithered"):
            raise ValueError(f"trainer.bf16_rounding must be nearest or dithered, got {self.bf16_rounding!r}")
        if self.megatron.get("fp16"):
            raise ValueError("--fp16 (megatron fp16 with loss scaling) is not run by this trainer; use trainer.precision: "
                             "bf16 (--bf16)")
        low = self.megatron.get("params_dtype") in ("bfloat16", "float16") or self.megatron.get("main_params_dtype") \
            in ("bfloat16", "float16")
        if low and (self.precision == "fp32" or self.megatron.get("bf16") is False):
            raise ValueError("bf16 weights without fp32 main weights: Adam updates below bf16's rounding are lost "
                             "(trainer.precision: bf16 keeps fp32 main weights); drop --params-dtype / "
                             "--main-params-dtype or set trainer.precision: bf16")
        if self.megatron.get("main_params_dtype") in ("bfloat16", "float16"):
            raise ValueError("--main-params-dtype bfloat16: the main weights must stay float32; drop the flag")
        if self.precision == "fp32" and self.megatron.get("bf16"):
            raise ValueError("--bf16 conflicts with trainer.precision: fp32; set one of them")
        if not isinstance(self.lr_warmup_steps, int) or self.lr_warmup_steps < 0:
            raise ValueError(f"trainer.lr_warmup_steps must be an integer >= 0, got {self.lr_warmup_steps!r}")
        if self.lr_decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(f"trainer.lr_decay_style must be constant, cosine or linear, got {self.lr_decay_style!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"trainer.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        decay = self.lr_decay_steps
        if self.lr_decay_style != "constant" and (not isinstance(decay, int) or decay <= self.lr_warmup_steps):
            raise ValueError(f"trainer.lr_decay_style {self.lr_decay_style} needs trainer.lr_decay_steps, an integer "
                             f"> lr_warmup_steps={self.lr_warmup_steps} (optimizer steps), got {decay!r}")

    def _check_optimizer_offload(self) -> None:
        """megatron's hybrid CPU/device optimizer (`--optimizer-cpu-offload`) runs on the distributed optimizer's
        precision-aware path, where it also copies the updated main weights into the model's weights itself."""
        fraction = self.megatron.get("optimizer_offload_fraction")
        if not self.megatron.get("optimizer_cpu_offload"):
            if fraction:
                raise ValueError(f"--optimizer-offload-fraction {fraction} needs --optimizer-cpu-offload "
                                 "(trainer.megatron.optimizer_cpu_offload: true)")
            return
        if fraction is not None and not (isinstance(fraction, (int, float)) and 0 <= fraction <= 1):
            raise ValueError(f"trainer.megatron.optimizer_offload_fraction must be in [0, 1] (the share of the main "
                             f"weights and Adam state kept in host memory), got {fraction!r}")
        if self.precision == "fp32":
            raise ValueError("--optimizer-cpu-offload needs bf16 weights with fp32 main weights (megatron's hybrid "
                             "optimizer keeps the main weights beside the model's); set trainer.precision: bf16")
        if not self.use_distributed_optimizer:
            raise ValueError("--optimizer-cpu-offload runs on megatron's distributed optimizer (its precision-aware "
                             "path); set trainer.use_distributed_optimizer: true")
        if self.bf16_rounding == "dithered":
            raise ValueError("--optimizer-cpu-offload copies the main weights into the bf16 weights inside megatron's "
                             "hybrid optimizer (round to nearest); set trainer.bf16_rounding: nearest")

    def optimizer_offload_fraction(self) -> float:
        """The share of the main weights and Adam state megatron's hybrid optimizer keeps (and updates) in host
        memory: 0 without `--optimizer-cpu-offload`, else `--optimizer-offload-fraction`, 1 when not given (Megatron-LM's
        default; megatron-core's config field defaults to 0, which would offload nothing)."""
        if not self.megatron.get("optimizer_cpu_offload"):
            return 0.0
        fraction = self.megatron.get("optimizer_offload_fraction")
        return 1.0 if fraction is None else float(fraction)

    def requests_bf16(self) -> bool:
        """True when the megatron pass-through asks for bf16 (`--bf16`, `--params-dtype bfloat16`)."""
        return bool(self.megatron.get("bf16")) or self.megatron.get("params_dtype") == "bfloat16"

    def _check_parallel_layout(self) -> None:
        """megatron-core's own layout rules, checked before any rank starts (its errors come much later)."""
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        if etp < 1:
            raise ValueError(f"trainer.expert_tensor_parallel_size must be >= 1 or null, got {etp}")
        dense = self.tensor_model_parallel_size * self.context_parallel_size * self.data_parallel_size
        if dense % (etp * self.expert_model_parallel_size):
            raise ValueError(
                f"expert layout ETP x EP = {etp} x {self.expert_model_parallel_size} must divide TP x CP x DP = "
                f"{self.tensor_model_parallel_size} x {self.context_parallel_size} x {self.data_parallel_size} = {dense} "
                "(megatron-core folds expert parallelism into the dense ranks); change "
                "--expert-model-parallel-size / --expert-tensor-parallel-size or the trainer's GPU count")
        if self.megatron.get("sequence_parallel") and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1 (megatron-core refuses it "
                             "at TP=1); drop it or raise TP")

    def _check_te_options(self) -> None:
        """What the options that run on Transformer Engine (glue.trainer.te_spec.TE_OPTIONS) cannot be combined
        with, wherever TE imports."""
        m = self.megatron
        if m.get("use_precision_aware_optimizer") and not self.use_distributed_optimizer:
            raise ValueError("--use-precision-aware-optimizer runs in megatron's distributed optimizer only: set "
                             "trainer.use_distributed_optimizer: true or drop the flag")
        if m.get("use_precision_aware_optimizer") and self.bf16_rounding == "dithered":
            raise ValueError("--use-precision-aware-optimizer with trainer.bf16_rounding: dithered: TE's FusedAdam "
                             "holds the main weights, so there are no fp32 main-weight shards to round with a dither; "
                             "use trainer.bf16_rounding: nearest or drop the flag")
        if m.get("moe_router_fusion") and self.routing_replay:
            raise ValueError("--moe-router-fusion with trainer.routing_replay: megatron's fused top-k routing skips "
                             "the router replay, so the engines' routing would not be replayed; drop one of them")

    @property
    def world_size(self) -> int:
        """Number of trainer ranks: TP x PP x CP x DP."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
                * self.data_parallel_size)

    def megatron_values(self) -> dict[str, Any]:
        """Every megatron-core config field this config sets, by field name: the passed-through ones plus the
        parallel sizes the glue reads (those win: placement was computed from them)."""
        sizes = {name: getattr(self, name) for name in PARALLEL_SIZES}
        sizes["expert_tensor_parallel_size"] = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        replay = {"moe_enable_routing_replay": True} if self.routing_replay else {}
        return {**self.megatron, **replay, **sizes}

    def parallel_state_sizes(self) -> dict[str, Any]:
        """Keyword arguments of megatron's `parallel_state.initialize_model_parallel` for this layout."""
        values = self.megatron_values()
        keys = (*PARALLEL_SIZES, "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size")
        return {key: values[key] for key in keys if values.get(key) is not None}

    def unsupported(self) -> list[str]:
        """Valid megatron-core layouts this trainer build does not run yet, one line each (empty = runnable).

        The launcher prints these in `--dry-run` and refuses to start a run that has any.
        """
        notes = []
        if self.context_parallel_size != 1:
            notes.append(f"CP = {self.context_parallel_size}: {CONTEXT_PARALLEL_NEEDS}; use --context-parallel-size 1")
        if self.megatron.get("virtual_pipeline_model_parallel_size"):
            notes.append("virtual pipeline stages (--virtual-pipeline-model-parallel-size): this trainer builds one "
                         "model chunk per pipeline rank and runs the non-interleaved 1F1B schedule; drop the flag")
        return notes
