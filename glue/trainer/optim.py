"""The trainer's update, the way megatron-core trains: the model wrapped in megatron's `DistributedDataParallel`
(contiguous fp32 gradient buffers in buckets; dense gradients reduced over data parallelism, routed experts' over the
expert-data-parallel group), gradients finalised by megatron's `finalize_model_grads` (the DP reduce, TP sums of
norms under sequence parallelism and of Qwen3's q/k norms, the tied embedding across pipeline stages), and the
optimizer from `get_megatron_optimizer`: Adam with decoupled weight decay, fp32 main weights for bf16 models, state
sharded over DP ranks with the distributed optimizer, global-norm clipping, the learning rate from megatron's
`OptimizerParamScheduler`.

The worker keeps the bare GPTModel (`worker.model`: names, snapshots, the weight bridge read it) and trains through
`Training.module` (DDP around it, around megatron's Float16Module in bf16). Losses arrive normalised by the batch's
global token counts (`calculate_per_token_loss`), so DDP sums over ranks, it does not average.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from glue.trainer.config import TrainerConfig
from glue.trainer.megatron_fields import to_megatron
from weight_sync.fp8_blocks import block_fp8_of

PRECISIONS = ("fp32", "bf16")
OFFLOAD_NEEDS_BF16 = (
    "--optimizer-cpu-offload needs bf16 weights (trainer.precision: bf16): megatron's hybrid optimizer keeps fp32 "
    "main weights beside the model's bf16 weights; with fp32 weights the main weights are the model's own and "
    "megatron-core 0.16 cannot hand them to it")


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype an HF config says its weights are stored in (`dtype`, or `torch_dtype` before transformers 5)."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def resolve_precision(cfg: TrainerConfig, hf_config: Any) -> str:
    """`trainer.precision`, with `auto` following the checkpoint: a bf16 (or fp16) checkpoint trains in bf16 with fp32
    main weights, anything else in fp32. A bf16 request through the megatron flags (`--bf16`, `--params-dtype
    bfloat16`) counts as bf16."""
    if cfg.precision != "auto":
        return cfg.precision
    if cfg.requests_bf16():
        return "bf16"
    return "bf16" if checkpoint_dtype(hf_config) in (torch.bfloat16, torch.float16) else "fp32"


def precision_line(precision: str, cfg: TrainerConfig, hf_config: Any, dp_size: int) -> str:
    """The start-up line: what the checkpoint holds and what the trainer and the bridge use."""
    stored = checkpoint_dtype(hf_config)
    stored_name = str(stored).removeprefix("torch.") if stored is not None else "unknown"
    if block_fp8_of(hf_config) is not None:
        stored_name = f"block-FP8, dequantized at load (its unquantized tensors {stored_name})"
    weights = "bfloat16" if precision == "bf16" else "float32"
    sharded = f", sharded over DP={dp_size} (distributed optimizer)" if cfg.use_distributed_optimizer else ""
    main = ("float32 main weights and Adam state" if precision == "bf16"
            else "the weights are the optimizer's main weights, float32 Adam state") + sharded
    widened = " (widened from the checkpoint)" if stored in (torch.bfloat16, torch.float16) and precision == "fp32" \
        else ""
    dither = " (rounded from the main weights with a fixed dither)" if precision == "bf16" and \
        cfg.bf16_rounding == "dithered" else ""
    return (f"trainer precision {precision}: checkpoint {stored_name}, model weights {weights}{dither}{widened}, "
            f"{main}, float32 gradients; the weight bridge sends {weights}")


@dataclass
class Training:
    """megatron's training objects for one rank's model."""

    module: Any  # DistributedDataParallel(Float16Module(model)) in bf16, DistributedDataParallel(model) in fp32
    optimizer: Any  # megatron's ChainedOptimizer (dense and expert parameters)
    scheduler: Any  # OptimizerParamScheduler
    clip_grad: float

    def zero_grad(self) -> None:
        """Clear the gradient buffers before a step's backwards accumulate into them."""
        self.module.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> dict[str, float]:
        """Finalise the gradients (collective), check their global norm, clip, update the (main) weights, copy them
        into the model's weights (all-gathered over DP with the distributed optimizer) and advance the schedule.
        Raises FloatingPointError, with the weights untouched, when the norm is not finite. Returns grad_norm and
        the lr this step used."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        finalize_model_grads([self.module])
        self.scheduler.step(increment=1)  # optimizer step k runs at the schedule's step k (warm-up never gives 0)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.optimizer.prepare_grads():
            raise FloatingPointError("megatron's optimizer found inf/nan in the gradients")
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm}")
        if self.clip_grad > 0:
            for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                params = part.get_parameters()
                if params:  # the precision-aware path (optimizer offload) keeps its gradients in decoupled_grad
                    clip_grad_by_total_norm_fp32(params, max_norm=self.clip_grad, total_norm=norm, use_decoupled_grad=
                                                 part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        self.optimizer.step_with_ready_grads()
        return {"grad_norm": norm, "lr": float(lr)}

    def sharded_state_dict(self, model_sharded: dict[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        """The optimizer state (main weights, Adam moments, step) as megatron sharded tensors shaped like the model's
        (megatron's `fully_reshardable` form: each model-parallel shard's state gathered over its own DP group by gloo
        and written by that group's rank 0), so dist_checkpointing reshards it to any TP / PP / DP / EP layout."""
        if is_loading:
            self._allocate_adam_state()
        state = self.optimizer.sharded_state_dict(model_sharded, is_loading=is_loading, metadata={
            "distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True})
        _drop_optimizer_classes(state)
        return state

    def _allocate_adam_state(self) -> None:
        """Adam's state as torch creates it at the first step (step, both moments at zero), so a trainer that has not
        stepped yet has the structure a loaded state is copied into (megatron's own init only makes the moments)."""
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for inner in _torch_optimizers(part):
                for param in _main_params(inner):
                    state = inner.state[param]
                    if not state:
                        state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(param),
                                     exp_avg_sq=torch.zeros_like(param))
            if _is_hybrid(part):  # its own state maps the model's shards to their sub-optimizer's state
                part.optimizer._sync_sub_optimizers_state_to_hdo()

    def load_sharded_state_dict(self, state: dict[str, Any], scheduler_state: dict[str, Any]) -> None:
        """After `dist_checkpointing.load` of `sharded_state_dict(..., is_loading=True)`: the optimizer state at
        this rank's layout, and the schedule."""
        parts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for part in parts:
            _keep_steps_on_reshard(part)
        self.optimizer.load_state_dict(state)
        for part in parts:  # megatron hands every parameter one shared step tensor; torch's Adam adds 1 to it per
            for param_state in part.optimizer.state.values():  # parameter, so each needs its own
                if "step" in param_state:
                    param_state["step"] = param_state["step"].clone()
        self.scheduler.load_state_dict(scheduler_state)

    @property
    def optimizer_count(self) -> int:
        """How many optimizers megatron chained (dense, and routed experts under expert parallelism): the optimizer
        state reshards between layouts with the same count."""
        return len(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def restart_from_weights(self, scheduler_state: dict[str, Any]) -> None:
        """After the weights alone were loaded: the main weights are taken from them (megatron's
        reload_model_params), the Adam moments start empty, the schedule continues."""
        self.optimizer.reload_model_params()
        self.scheduler.load_state_dict(scheduler_state)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the training state on the device besides the model's weights: DDP's gradient (and
        parameter) buffers, the main weights and the Adam moments (glue.trainer.offload moves them). The share that
        `--optimizer-cpu-offload` keeps in host memory is not among them: it stays where it is."""
        buffers = [t for b in self.module.buffers + self.module.expert_parallel_buffers
                   for t in (b.param_data, b.grad_data) if t is not None]
        tensors = []
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for inner in _torch_optimizers(part, on_device=True):
                tensors += _main_params(inner)
                tensors += [v for state in inner.state.values() for v in state.values()
                            if torch.is_tensor(v) and v.dim() > 0]
        return buffers + tensors


def _drop_optimizer_classes(state: Any) -> None:
    """Why: megatron's hybrid optimizer (`--optimizer-cpu-offload`) keeps its sub-optimizer classes in its param
    groups; in a checkpoint's common part they make every weights-only torch.load (a resume, `sluice export-hf`)
    refuse it. The stored param groups (copies) leave them out; nothing reads them back."""
    parts = [state] if "optimizer" in state else [v for v in state.values() if isinstance(v, dict)]  # chained: by index
    for part in parts:
        for group in part.get("optimizer", {}).get("param_groups", []):
            for key in [k for k, v in group.items() if isinstance(v, type)]:
                del group[key]


def _keep_steps_on_reshard(part: Any) -> None:
    """Why: with torch's Adam (no apex / transformer-engine: every CPU run), megatron's distributed optimizer puts
    the checkpoint's step into each parameter's state and then copies the resharded tensors over every key of that
    state, `step` included, which the resharded tensors lack (KeyError). The step is handed back to that copy as the
    value it already holds; the moments and main weights are copied as megatron does."""
    original = getattr(part, "_set_main_param_and_optimizer_states", None)
    if original is None or getattr(original, "keeps_steps", False):
        return

    def set_states(model_param: Any, tensors: dict[str, torch.Tensor]) -> None:
        group, order = part.model_param_group_index_map[model_param]
        step = part.optimizer.state[part.optimizer.param_groups[group]["params"][order]].get("step")
        original(model_param, tensors if step is None or "step" in tensors else {**tensors, "step": step})

    set_states.keeps_steps = True
    part._set_main_param_and_optimizer_states = set_states


def _main_params(inner: Any) -> list[torch.Tensor]:
    """The fp32 tensors a torch optimizer of megatron's updates, in its order: this rank's shard of the main weights
    (distributed optimizer; host copies for the offloaded share), fp32 copies of bf16 weights, or the fp32 weights
    themselves."""
    return [p for group in inner.param_groups for p in group["params"]]


def _is_hybrid(part: Any) -> bool:
    """True when `part` (one of megatron's optimizers) runs megatron's hybrid CPU/device optimizer (offload)."""
    return hasattr(part.optimizer, "sub_optimizers")


def _torch_optimizers(part: Any, *, on_device: bool = False) -> list[Any]:
    """The torch optimizers that hold `part`'s main weights and Adam state: its inner one, or under
    `--optimizer-cpu-offload` the hybrid optimizer's sub-optimizers (host ones first, then the device one, none when
    all is offloaded), whose parameters are the fp32 main weights (host copies for the offloaded fraction).
    `on_device`: only those whose state is on the device."""
    if not _is_hybrid(part):
        return [part.optimizer]
    hybrid = part.optimizer
    return [hybrid.gpu_optimizer] * (hybrid.gpu_optimizer is not None) if on_device else list(hybrid.sub_optimizers)


def reduce_experts_over_expert_dp(model: torch.nn.Module) -> None:
    """Mark the routed experts' parameters for the expert-data-parallel reduce where megatron-core leaves them dense.
    megatron-core 0.16 marks them (`allreduce = False`: DDP reduces them over the expert-data-parallel group, the
    expert optimizer shards them there) only at EP > 1. At EP 1 with expert TP below TP under sequence parallelism,
    each TP rank's experts see only its own slice of the tokens, so their copies on the TP ranks (expert-data-parallel
    peers, not data-parallel ones) each hold part of the gradient; left dense, no collective sums them and the copies
    drift apart from the first step (the weights sent to the engines are rank 0's, the forward uses every rank's).
    Without sequence parallelism every TP rank routes the same tokens and their gradients agree as they are."""
    c = model.config
    if not c.num_moe_experts or c.expert_model_parallel_size > 1 or not c.sequence_parallel or \
            c.expert_tensor_parallel_size == c.tensor_model_parallel_size:
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def build(model: torch.nn.Module, cfg: TrainerConfig, precision: str) -> Training:
    """Wrap `model` (this rank's GPTModel, weights loaded, on its device) for training and make its optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    passed = cfg.megatron_values()
    bf16 = precision == "bf16"
    if cfg.megatron.get("optimizer_cpu_offload") and not bf16:
        raise ValueError(OFFLOAD_NEEDS_BF16)
    reduce_experts_over_expert_dp(model)
    inner = Float16Module(model.config, model) if bf16 else model
    ddp_config = DistributedDataParallelConfig(**{
        "grad_reduce_in_fp32": True, "overlap_grad_reduce": False, "average_in_collective": False,
        **to_megatron(DistributedDataParallelConfig, passed),
        "use_distributed_optimizer": cfg.use_distributed_optimizer})
    module = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=inner)
    opt_config = OptimizerConfig(**{
        **to_megatron(OptimizerConfig, passed), **_offload_fields(cfg),
        "optimizer": "adam", "lr": cfg.lr, "min_lr": cfg.min_lr, "weight_decay": cfg.weight_decay,
        "adam_beta1": cfg.adam_beta1, "adam_beta2": cfg.adam_beta2, "adam_eps": cfg.adam_eps,
        "clip_grad": cfg.grad_clip, "bf16": bf16, "fp16": False,
        "params_dtype": torch.bfloat16 if bf16 else torch.float32,
        "use_distributed_optimizer": cfg.use_distributed_optimizer})
    optimizer = get_megatron_optimizer(opt_config, [module])
    if bf16 and cfg.bf16_rounding == "dithered":
        for k, part in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
            _round_with_dither(part, k)
    warmup = cfg.lr_warmup_steps
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=cfg.lr_decay_steps or warmup + 1, lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
    return Training(module=module, optimizer=optimizer, scheduler=scheduler, clip_grad=cfg.grad_clip)


def _offload_fields(cfg: TrainerConfig) -> dict[str, Any]:
    """megatron's hybrid CPU/device optimizer for `--optimizer-cpu-offload`: it runs on the distributed optimizer's
    precision-aware path (Megatron-LM requires `--use-precision-aware-optimizer` with it): the distributed optimizer
    hands it the model's own weight shards, it keeps the fp32 main weights and Adam moments (in host memory for the
    offloaded fraction), reads `decoupled_grad` and writes the updated weights back into the model's shards."""
    if not cfg.megatron.get("optimizer_cpu_offload"):
        return {}
    _answer_te_version_checks_without_te()
    return {"optimizer_offload_fraction": cfg.optimizer_offload_fraction(), "use_precision_aware_optimizer": True}


def _answer_te_version_checks_without_te() -> None:
    """Why: megatron-core 0.16's OptimizerConfig asks `is_te_min_version("2.1.0")` on the precision-aware path, which
    raises TypeError where Transformer Engine is not installed (CPU, and GPU nodes without it): no TE is no recent TE,
    so the check answers False there and megatron's own one otherwise."""
    from megatron.core import utils
    from megatron.core.optimizer import optimizer_config

    check = utils.is_te_min_version

    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        return utils.get_te_version() is not None and check(version, check_equality)

    optimizer_config.is_te_min_version = is_te_min_version


def dithered_bf16(main: torch.Tensor, start: int, salt: int) -> torch.Tensor:
    """`main` (float32) rounded to bf16 with a fixed dither per position (`trainer.bf16_rounding: dithered`): the
    magnitude becomes floor(|x| + r * ulp) with r in [0, 1) from a golden-ratio hash of the position `start + i`
    shifted by `salt`. A value on the bf16 grid stays where it is, and a float32 drift d moves about |d| / ulp of the
    weights by one ulp, so on average the bf16 copy follows updates far below its spacing instead of swallowing them
    (round to nearest moves none of them). inf and nan pass through. Flat bf16 result; int32 arithmetic in chunks."""
    flat = main.detach().reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.bfloat16, device=flat.device)
    chunk = 1 << 22
    offset = (start + salt + 2**31) % 2**32 - 2**31  # only (i + start + salt) mod 2^32 enters the hash: an int32
    for lo in range(0, flat.numel(), chunk):
        bits = flat[lo:lo + chunk].float().view(torch.int32)
        idx = torch.arange(lo, lo + bits.numel(), dtype=torch.int32, device=flat.device) + offset
        r = ((idx * -1640531535) >> 16) & 0xFFFF  # int32 wraps: ((i + salt) * 0x9E3779B1) mod 2^32, its top half
        magnitude = bits & 0x7FFFFFFF
        rounded = torch.where(magnitude >= 0x7F800000, magnitude, (magnitude + r) & -65536)
        out[lo:lo + bits.numel()] = (rounded | (bits & -2147483648)).view(torch.float32).to(torch.bfloat16)
    return out


def _salt(part: int, group: int, index: int) -> int:
    """A per-parameter salt (optimizer part, param group, index in it), so that two parameters do not share a dither
    pattern."""
    return (((part * 104729 + group) * 7919 + index) * 40503 + 12345) & 0x7FFFFFFF


def _round_with_dither(part: Any, k: int) -> None:
    """Make megatron's main -> model weight copy of one optimizer (DistributedOptimizer or the non-distributed
    Float16OptimizerWithFloat16Params; the k-th part of megatron's chain) round its bf16 parameters with
    `dithered_bf16`; float32 ones copy as before."""
    if hasattr(part, "shard_fp32_from_float16_groups"):
        def copy() -> None:  # the distributed optimizer: each rank writes its shard into the param buffer
            for g, (mains, params) in enumerate(zip(part.shard_fp32_from_float16_groups, part.model_float16_groups)):
                for i, (main, param) in enumerate(zip(mains, params)):
                    ranges = part._get_model_param_range_map(param)
                    world = ranges["gbuf_world_in_bucket"]
                    gbuf, _, bucket = part.model_param_gbuf_map[param]
                    target = part.buffers[gbuf].buckets[bucket].param_data.view(-1)[world.start:world.end]
                    target.copy_(dithered_bf16(main, ranges["param"].start, _salt(k, g, i)))
            for mains, params in zip(part.shard_fp32_groups, part.model_fp32_groups):
                for main, param in zip(mains, params):
                    world = part._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                    gbuf, _, bucket = part.model_param_gbuf_map[param]
                    part.buffers[gbuf].buckets[bucket].param_data.view(-1)[world.start:world.end].copy_(main)
    elif hasattr(part, "fp32_from_float16_groups"):
        def copy() -> None:
            for g, (mains, params) in enumerate(zip(part.fp32_from_float16_groups, part.float16_groups)):
                for i, (main, param) in enumerate(zip(mains, params)):
                    param.data.view(-1).copy_(dithered_bf16(main, 0, _salt(k, g, i)))
    else:
        return  # an optimizer with no bf16 parameters (fp32, or an empty expert part)
    part._copy_main_params_to_model_params = copy


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's wrappers (DDP, Float16Module)."""
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return module
