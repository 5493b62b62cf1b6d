"""What a run reads from `model.path`, checked before anything starts (by launch.run.preflight, for every run and for
`--dry-run`), and what the plan learns from config.json alone: the checkpoint's files, the rules megatron-core sets
for the model the trainer builds from it and the layer spec it is built with (what a weight sync moves, and through
which groups: launch.plan.weight_groups)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from glue.embedded_engine.tiny_model import tiny_config
from glue.trainer import te_spec
from glue.trainer.layer_spec import SINKS_ELSEWHERE
from glue.trainer.megatron_fields import megatron_fields
from glue.trainer.model import check_tensor_parallel, megatron_config, read_hf_config
from glue.trainer.optim import resolve_precision
from glue.trainer.pipeline import planned_stage_layers
from glue.trainer.te_spec import resolve_layer_spec
from launch.config import ConfigError, SluiceConfig
from launch.slime.megatron import check_shape
from weight_sync.families import family_of, num_experts
from weight_sync.fp8_blocks import SCALE_SUFFIX, block_fp8_of

WEIGHT_SUFFIXES = (".safetensors", ".bin")
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # AutoTokenizer loads any one


def model_config(cfg: SluiceConfig) -> Any:
    """The HF config of the model the run trains: model.path's config.json (a family the trainer builds), or, with
    model.path null, the tiny model's, built in memory (its weights are written at start-up)."""
    return section_model_config(cfg.model, "model")


def section_model_config(model: Any, key: str) -> Any:
    """The HF config of a `ModelConfig` section at `key` (model, judge.model): its path's config.json, or its tiny
    model's, built in memory."""
    if model.path is None:
        tiny = {k: v for k, v in dataclasses.asdict(model.tiny).items() if k not in ("seed", "tokenizer")}
        try:
            return tiny_config(**tiny)
        except ValueError as err:
            raise ConfigError(f"{key}.tiny: {err}") from None
    path = Path(model.path)
    if not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise ConfigError(f"{key}.path {model.path!r} {what}: point it at a local HF checkpoint directory "
                          "(config.json, *.safetensors, tokenizer files)")

    try:
        return read_hf_config(str(path))
    except Exception as err:  # transformers' own message says what is wrong with config.json
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}.path {model.path!r}: its config.json does not load: {first}") from None


def check_model(cfg: SluiceConfig, *, plan_only: bool) -> str:
    """The model builds under the trainer's layout and its weight files are whole. A directory holding config.json
    and no weights is a plan-only directory: enough for a dry run (`plan_only`), refused by a real start."""
    hf_config = model_config(cfg)
    check_shape_flags(cfg, hf_config)
    check_family_flags(cfg, hf_config)
    check_routing(cfg, hf_config)
    check_trainer_model(cfg.trainer, hf_config)
    if cfg.model.path is None:
        return f"model: a tiny random {hf_config.model_type} model is built at start-up (model.path is null)"
    path = Path(cfg.model.path)
    weights = weight_files(cfg.model.path)
    if not weights and plan_only:
        return (f"model: {path} holds config.json and no weight files: a plan-only directory (the plan is computed "
                "from config.json; a run needs the *.safetensors)" + frozen_line(hf_config)
                + fp8_line(cfg.trainer, hf_config, []))
    if not weights:
        raise ConfigError(f"model.path {cfg.model.path!r} holds no *.safetensors or *.bin weight files: copy the "
                          "checkpoint's weights there (a directory with config.json alone serves --dry-run only)")
    check_weight_files(cfg.model.path, weights)
    size = sum(p.stat().st_size for p in weights)
    return (f"model: {path} is a {hf_config.model_type} checkpoint ({len(weights)} weight files, {format_bytes(size)})"
            + frozen_line(hf_config) + fp8_line(cfg.trainer, hf_config, weights))


def frozen_line(hf_config: Any) -> str:
    """What the plan says of the layers the family keeps frozen (MTP): kept, not trained, in every export."""
    frozen = family_of(hf_config).frozen_layers(hf_config)
    if not frozen:
        return ""
    which = ", ".join(f"model.layers.{i}" for i in frozen)
    return (f"; {len(frozen)} multi-token-prediction layer(s) ({which}) kept frozen: not trained or synced, copied "
            "unchanged into every export")


def fp8_line(trainer: Any, hf_config: Any, weights: list[Path]) -> str:
    """What the plan says of a block-FP8 checkpoint (weight_sync.fp8_blocks): dequantized to the trainer's dtype at
    load, and how many bytes its weights take then (from the files' headers: FP8 weights take 1 byte each on disk)."""
    fp8 = block_fp8_of(hf_config)
    if fp8 is None:
        return ""
    precision = resolve_precision(trainer, hf_config)
    loaded = (f" ({format_bytes(dequantized_bytes(weights, 2 if precision == 'bf16' else 4))} once dequantized)"
              if weights and all(p.suffix == ".safetensors" for p in weights) else "")
    return (f"; {fp8.describe()}: dequantized to the trainer's {precision} at load{loaded}, and exported "
            "dequantized")


def dequantized_bytes(weights: list[Path], element_size: int) -> int:
    """The bytes of every tensor in the safetensors `weights` at `element_size` bytes each, the FP8 scales left
    out (they are folded into the weights)."""
    total = 0
    for path in weights:
        for name, info in _safetensors_header(path)[1].items():
            if name != "__metadata__" and not name.endswith(SCALE_SUFFIX):
                total += math.prod(info["shape"]) * element_size
    return total


def check_shape_flags(cfg: SluiceConfig, hf_config: Any) -> None:
    """The model-shape flags given (model.shape: Megatron-LM's / slime's MODEL_ARGS) describe this checkpoint."""
    where = "model.tiny's config" if cfg.model.path is None else f"{cfg.model.path}/config.json"
    try:
        check_shape(cfg.model.shape, hf_config, where)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_family_flags(cfg: SluiceConfig, hf_config: Any) -> None:
    """The megatron-core flags passed through that config.json fixes (the family's fields: its router's score
    function, scaling, shared experts ...) say what config.json says: the engines serve config.json's model, and a
    trainer built otherwise would train another one."""
    family = family_of(hf_config)
    where = "model.tiny's config" if cfg.model.path is None else f"{cfg.model.path}/config.json"
    fields = family.megatron_fields(hf_config)
    if not fields.get("multi_latent_attention"):
        mla = [f for f in cfg.trainer.megatron if f in mla_fields() and cfg.trainer.megatron[f] not in (None, False)]
        if mla:
            raise ConfigError(f"--{mla[0].replace('_', '-')} is a field of multi-latent attention "
                              f"(MLATransformerConfig), and {where} is a {family.name} model without it; drop the flag")
    for field, implied in fields.items():
        given = cfg.trainer.megatron.get(field, implied)
        same = math.isclose(given, implied) if isinstance(implied, float) and isinstance(given, (int, float)) \
            else given == implied
        if not same:
            raise ConfigError(f"--{field.replace('_', '-')} {given} does not match {where}: the {family.name} family "
                              f"reads {field}={implied} from it, and the engines serve that model; drop the flag or "
                              "point model.path at the checkpoint it describes")


def mla_fields() -> set[str]:
    """The pass-through fields only multi-latent attention reads (MLATransformerConfig's own, and its switch)."""
    return {"multi_latent_attention"} | {name for name, f in megatron_fields().items()
                                         if f.owners == ("MLATransformerConfig",)}


def check_routing(cfg: SluiceConfig, hf_config: Any) -> None:
    """MoE routing replay needs a model with routed experts, and the engines' routing to replay."""
    if cfg.trainer.routing_replay and not cfg.rollout.return_routed_experts:
        raise ConfigError("trainer.routing_replay replays the engines' MoE routing: set rollout.return_routed_experts: "
                          "true too")
    if cfg.rollout.return_routed_experts and not num_experts(hf_config):
        which = (f"model.tiny.family is {cfg.model.tiny.family!r} (use qwen3_moe)" if cfg.model.path is None else
                 f"{cfg.model.path!r} is a dense {hf_config.model_type} checkpoint")
        raise ConfigError(f"rollout.return_routed_experts needs a mixture-of-experts model; {which}")


def check_trainer_model(trainer: Any, hf_config: Any) -> None:
    """What megatron-core (and this trainer) would refuse once every rank has started, for this model and the
    trainer's parallel layout (a glue.trainer.config.TrainerConfig): TP, the pipeline split, EP."""
    tp, ep, experts = trainer.tensor_model_parallel_size, trainer.expert_model_parallel_size, num_experts(hf_config)
    try:
        check_tensor_parallel(hf_config, tp)
    except ValueError as err:
        raise ConfigError(f"trainer.{err}") from None
    try:
        planned_stage_layers(hf_config, trainer)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if ep > 1 and not experts:
        raise ConfigError(f"trainer.expert_model_parallel_size={ep} needs a mixture-of-experts model, and the model "
                          f"is a dense {hf_config.model_type}: set --expert-model-parallel-size 1")
    if experts % ep:
        raise ConfigError(f"trainer.expert_model_parallel_size={ep} must divide the model's {experts} experts "
                          "(megatron-core gives every EP rank the same number); choose another EP size")
    fields = family_of(hf_config).megatron_fields(hf_config)
    backend = str(trainer.megatron.get("attention_backend", "auto")).removeprefix("AttnBackend.")
    if (fields.get("softmax_type", "vanilla") != "vanilla" or fields.get("window_size")) and (
            trainer.layer_spec == "te" or backend in ("local", "unfused")):
        raise ConfigError(SINKS_ELSEWHERE)
    etp = fields.get("expert_tensor_parallel_size")
    if etp is not None and (trainer.expert_tensor_parallel_size or tp) != etp:
        raise ConfigError(f"trainer.expert_tensor_parallel_size={trainer.expert_tensor_parallel_size or tp}: "
                          f"megatron-core builds {hf_config.model_type}'s expert biases at expert TP {etp} only; set "
                          f"trainer.expert_tensor_parallel_size: {etp}")
    # megatron-core's MoELayer.forward raises in training when its TP group has > 1 rank without sequence parallelism
    if experts and tp > 1 and not trainer.megatron.get("sequence_parallel"):
        raise ConfigError(f"trainer.tensor_model_parallel_size={tp} with a mixture-of-experts model ({experts} "
                          "experts) needs sequence parallelism, which megatron-core requires to train MoE layers with "
                          "TP > 1: add --sequence-parallel (trainer.megatron.sequence_parallel: true)")
    check_megatron_accepts(trainer, hf_config)  # after the checks that name sluice's own keys


def check_megatron_accepts(trainer: Any, hf_config: Any) -> None:
    """megatron-core's own validation of the config every trainer rank builds (its __post_init__: a field combination
    it rejects), run here so that --dry-run refuses what a real start would. Options that need Transformer Engine are
    validated where it imports (check_transformer_engine says which)."""
    if te_spec.te_options(trainer.megatron):
        return
    import warnings

    precision = "bf16" if trainer.precision == "bf16" else "fp32"
    try:
        with warnings.catch_warnings():  # megatron's deprecation notes are for the ranks' logs, not the plan
            warnings.simplefilter("ignore")
            megatron_config(hf_config, tp_size=trainer.tensor_model_parallel_size,
                            megatron_args=trainer.megatron_values(), precision=precision)
    except (ValueError, AssertionError, TypeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"megatron-core refuses the trainer's model config for this checkpoint and these flags: "
                          f"{first}") from None


def check_layer_spec(trainer: Any, *, elsewhere: bool = False) -> str:
    """`trainer.layer_spec` as this machine resolves it (a glue.trainer.config.TrainerConfig): te is refused where
    transformer_engine does not import, unless the plan is for other nodes (`elsewhere`: check_transformer_engine
    names what they need); auto is reported, each trainer rank resolving it where it runs."""
    if elsewhere and trainer.layer_spec == "te":
        return "layer spec: te (built on the trainer nodes)"
    try:
        spec = resolve_layer_spec(trainer.layer_spec)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if trainer.layer_spec != "auto":
        return f"layer spec: {spec}"
    imports = "imports" if spec == "te" else "does not import"
    return f"layer spec: auto, {spec} here (transformer_engine {imports}; each trainer node resolves it for itself)"


def check_transformer_engine(trainer: Any, *, elsewhere: bool) -> str | None:
    """What the trainer's config runs on Transformer Engine (trainer.layer_spec te, glue.trainer.te_spec.TE_OPTIONS).
    For a plan for other nodes (`elsewhere`) a `requires:` line names it; a run on this machine is refused in one
    line where TE does not import. None when nothing needs TE."""
    needs = (["trainer.layer_spec=te"] if trainer.layer_spec == "te" else []) + te_spec.te_options(trainer.megatron)
    if not needs:
        return None
    here = "imports" if te_spec.te_available() else "does not import"
    if elsewhere:
        return f"requires: transformer-engine on the trainer nodes, for {', '.join(needs)} (it {here} here)"
    try:
        te_spec.check_te_options(trainer.megatron)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return f"transformer-engine: imports here, for {', '.join(needs)}"


REFERENCE_ATTENTION = "megatron DotProductAttention, unfused ([T, T] scores and mask per layer: the reference)"
FAST_ATTENTION = {  # GPU nodes? -> what sluice's core attention runs there
    True: "sluice core attention: FlashAttention varlen (torch.nn.attention.varlen) on packed THD rows in bf16 "
          "(fp32, or a torch without varlen_attn: compiled flex_attention with a document-causal block mask), "
          "causal SDPA on padded rows",
    False: "sluice core attention on CPU: causal SDPA over each packed row's samples as a batch, causal SDPA on "
           "padded rows",
}


SINKS_ATTENTION = ("sluice core attention with sinks and sliding windows (glue.trainer.sinks): SDPA under a mask, the "
                   "sink as one extra key, packed rows' samples as a batch (no FlashAttention varlen or flex kernel)")


def describe_attention(trainer: Any, on_gpus: bool, hf_config: Any = None) -> str:
    """The attention line of `--dry-run`: the kernel every trainer rank runs, from trainer.layer_spec, megatron's
    attention_backend (auto / flash / fused: sluice's fused core attention; local / unfused: megatron's reference),
    whether the trainer nodes have GPUs and whether the model (`hf_config`) has sinks or sliding windows."""
    backend = str(trainer.megatron.get("attention_backend", "auto")).removeprefix("AttnBackend.")
    if backend not in ("auto", "flash", "fused", "local", "unfused"):
        raise ConfigError(f"--attention-backend {backend!r} is not one of auto, flash, fused, local, unfused")
    fields = {} if hf_config is None else family_of(hf_config).megatron_fields(hf_config)
    if fields.get("softmax_type", "vanilla") != "vanilla" or fields.get("window_size"):
        return (f"attention ({backend}): {SINKS_ATTENTION}, every trainer rank")
    if trainer.layer_spec == "te" or resolve_layer_spec(trainer.layer_spec) == "te":
        return "attention: transformer-engine DotProductAttention (packed rows as THD), every trainer rank"
    kernel = REFERENCE_ATTENTION if backend in ("local", "unfused") else FAST_ATTENTION[on_gpus]
    compiled = ("; trainer.compile: RMSNorms, RoPE, SwiGLU and residual adds under torch.compile"
                if trainer.compile and kernel is not REFERENCE_ATTENTION else "")
    return f"attention ({backend}): {kernel}, every trainer rank{compiled}"


SEQUENTIAL_EXPERTS = "megatron SequentialMLP (each expert's products in a Python loop; --moe-grouped-gemm groups them)"


def describe_experts(trainer: Any, on_gpus: bool, hf_config: Any) -> str | None:
    """The experts line of `--dry-run` for an MoE model (None for a dense one): what every trainer rank runs its
    routed experts on, from trainer.layer_spec, `--moe-grouped-gemm`, whether the trainer nodes have GPUs and, on
    CPU, the precision and widths (glue.trainer.grouped_experts.experts_kernel)."""
    if not num_experts(hf_config):
        return None
    grouped = bool(trainer.megatron.get("moe_grouped_gemm"))
    if trainer.layer_spec == "te" or resolve_layer_spec(trainer.layer_spec) == "te":
        kind = "transformer-engine grouped experts (TEGroupedMLP)" if grouped else SEQUENTIAL_EXPERTS
    elif not grouped:
        kind = SEQUENTIAL_EXPERTS
    elif on_gpus:
        kind = ("sluice grouped experts: one torch._grouped_mm for gate/up and one for down per layer where the GPU "
                "runs it for the dtype (bf16 on Hopper and newer), else a batched product over padded experts")
    else:
        from glue.trainer.grouped_experts import experts_kernel  # lazy: imports megatron-core

        precision = resolve_precision(trainer, hf_config)
        etp = trainer.expert_tensor_parallel_size or trainer.tensor_model_parallel_size
        widths = (hf_config.hidden_size, getattr(hf_config, family_of(hf_config).expert_width) // etp)
        kernel = experts_kernel("cpu", {"bf16": torch.bfloat16}.get(precision, torch.float32), widths)
        kind = f"sluice grouped experts on CPU: {kernel}, two per layer, {precision}"
    return f"experts: {kind}, every trainer rank"


def check_weight_files(model_path: str, weights: list[Path]) -> None:
    """No weight file is empty or cut short (a download or copy that did not finish), and every shard the index
    names is there."""
    for path in weights:
        size = path.stat().st_size
        expected = _safetensors_size(path) if size and path.suffix == ".safetensors" else size
        if size == 0 or size != expected:
            what = "is 0 bytes" if size == 0 else f"is cut short ({size} bytes; its header describes {expected})"
            raise ConfigError(f"model.path {model_path!r}: weight file {path.name} {what}: a download or copy that "
                              "did not finish; fetch the checkpoint's weights again")
    folder = weights[0].parent
    for index in SHARD_INDEXES:
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError):
                raise ConfigError(f"model.path {model_path!r}: {index} is not a shard index (no weight_map): copy "
                                  "it again from the checkpoint") from None
            missing = [name for name in shards if not (folder / name).is_file()]
            if missing:
                raise ConfigError(f"model.path {model_path!r}: {index} names {len(shards)} weight files and "
                                  f"{len(missing)} of them are not there ({missing[0]}, ...): copy the whole "
                                  "checkpoint")


def _safetensors_size(path: Path) -> int:
    """The size a safetensors file must have: 8 bytes of header length, the JSON header, then the data up to the
    last tensor's end offset; -1 when the header cannot be read (reported as cut short)."""
    try:
        header_len, header = _safetensors_header(path)
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return -1
    return 8 + header_len + max(ends, default=0)


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """The length and the JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets); ValueError
    when it cannot be read."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if not 0 < header_len <= path.stat().st_size - 8:
            raise ValueError(f"{path.name}: header length {header_len} does not fit the file")
        header = json.loads(f.read(header_len))
    return header_len, header


def has_tokenizer(directory: str) -> bool:
    """Whether `directory` holds files AutoTokenizer can load a tokenizer from."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def weight_files(directory: str) -> list[Path]:
    """The checkpoint's weight files, by name."""
    return sorted(p for p in Path(directory).iterdir() if p.suffix in WEIGHT_SUFFIXES)


def hf_parameters(hf_config: Any) -> dict[str, int]:
    """Every parameter of the HF model `hf_config` describes, name -> elements, counted on the meta device: no
    memory, no weights. A tied lm_head is the embedding, listed once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: p.numel() for name, p in model.named_parameters()}


def format_bytes(nbytes: float) -> str:
    """`470.2 GB`: four significant digits, decimal units."""
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000:
            return f"{nbytes:.4g} {unit}"
        nbytes /= 1000
    return f"{nbytes:.4g} TB"
