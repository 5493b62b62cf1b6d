"""Megatron pass-through: one `--<field-name>` flag per field of megatron-core's ModelParallelConfig,
TransformerConfig, DistributedDataParallelConfig and OptimizerConfig (generated, typed, with megatron's own field
docs as help), routed into the `trainer:` section: the fields TrainerConfig declares itself (the parallel sizes the
glue reads, the AdamW settings) by name, every other one into `trainer.megatron` unchanged.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any

from glue.trainer.config import TrainerConfig
from glue.trainer.megatron_fields import MegatronField, check_value, megatron_fields
from glue.trainer.te_spec import TE_OPTIONS

# Megatron spellings of TrainerConfig fields whose name differs.
TRAINER_ALIASES = {"clip_grad": "grad_clip"}
# Model shape comes from the HF checkpoint the engines also load; a different value would build another model.
CHECKPOINT_FIELDS = {
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim", "ffn_hidden_size": "intermediate_size",
    "layernorm_epsilon": "rms_norm_eps", "add_qkv_bias": "attention_bias / model_type", "qk_layernorm": "model_type",
    "num_moe_experts": "num_experts", "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size", "normalization": "model_type", "gated_linear_unit": "model_type",
    "activation_func": "hidden_act", "add_bias_linear": "mlp_bias",
}
GROUP_TITLE = "megatron-core (generated from ModelParallelConfig, TransformerConfig, DDP and optimizer configs)"


def trainer_field_of(name: str) -> str | None:
    """The TrainerConfig field a megatron field is routed to, or None when it goes into trainer.megatron."""
    own = {f.name for f in dataclasses.fields(TrainerConfig)} - {"megatron"}
    name = TRAINER_ALIASES.get(name, name)
    return name if name in own else None


def add_megatron_flags(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One flag per megatron field; parsed values land in dest `megatron:<field>`. Flags in `skip` are another
    group's (slime's table: launch.slime.args, which reads the model-shape and schedule ones its own way)."""
    group = parser.add_argument_group(GROUP_TITLE, "Megatron-LM spellings; values reach the trainer's megatron-core "
                                      "configs unchanged (YAML: trainer.megatron.<field>).")
    for spec in megatron_fields().values():
        if "--" + spec.name.replace("_", "-") in skip:
            continue
        kwargs: dict[str, Any] = {"dest": f"megatron:{spec.name}", "default": argparse.SUPPRESS,
                                  "help": _help(spec)}
        if spec.kind == "flag":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = spec.scalar if spec.scalar in (int, float) else str
            if spec.choices:
                kwargs["choices"] = spec.choices
            if spec.kind == "list":
                kwargs["nargs"] = "+"
            if spec.kind == "object":
                kwargs["metavar"] = "MODULE:ATTR"
            elif not spec.choices:
                kwargs["metavar"] = {int: "INT", float: "FLOAT"}.get(spec.scalar, "STR")
        group.add_argument("--" + spec.name.replace("_", "-"), **kwargs)


def _help(spec: MegatronField) -> str:
    text = spec.help.split(". ")[0].rstrip(".").replace("%", "%%")
    if len(text) > 160:
        text = text[:157].rsplit(" ", 1)[0] + "..."
    where = trainer_field_of(spec.name)
    target = f"trainer.{where}" if where else f"trainer.megatron.{spec.name}"
    default = "" if spec.default is None else f"; default {spec.default}"
    runs = ("; not run by sluice" if spec.name in NOT_RUN else
            "; needs transformer-engine on the trainer nodes" if spec.name in TE_OPTIONS else "")
    return f"{text} [{'/'.join(spec.owners)} -> {target}{default}{runs}]"


def route(values: dict[str, Any]) -> dict[str, Any]:
    """Parsed flag values {field: value} -> the nested `trainer:` overrides they stand for."""
    trainer: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, list) and megatron_fields()[name].allows_scalar and len(value) == 1:
            value = value[0]
        target = trainer_field_of(name)
        if target:
            trainer[target] = value
        else:
            trainer.setdefault("megatron", {})[name] = value
    return {"trainer": trainer}


def check_megatron(values: dict[str, Any]) -> dict[str, Any]:
    """Validate `trainer.megatron` against megatron-core's fields: unknown names (with a did-you-mean), fields sluice
    owns, value kinds, fields the trainer never runs (NOT_RUN). Raises ValueError naming the key and the fix; returns
    the checked values."""
    fields = megatron_fields()
    out = {}
    for name, value in values.items():
        where = f"trainer.megatron.{name}"
        if name not in fields:
            guess = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean {guess[0]!r} (--{guess[0].replace('_', '-')})?" if guess else ""
            raise ValueError(f"unknown megatron-core config field {where}{hint}")
        if trainer_field_of(name):
            raise ValueError(f"{where} is a trainer setting: use trainer.{trainer_field_of(name)} "
                             f"(--{name.replace('_', '-')}) instead")
        if name in CHECKPOINT_FIELDS:
            raise ValueError(f"{where} (--{name.replace('_', '-')}) comes from the checkpoint's config.json "
                             f"({CHECKPOINT_FIELDS[name]}); change model.path (or model.tiny) instead")
        out[name] = check_value(fields[name], value, where)
        if not_run(name, out[name]):
            raise ValueError(f"{where} (--{name.replace('_', '-')}) is not run by this trainer: {NOT_RUN[name]}; "
                             "drop it")
    return out


# megatron-core fields this trainer never runs, and why: refused wherever the run is planned (those that need
# Transformer Engine on the trainer nodes are glue.trainer.te_spec.TE_OPTIONS; every other one reaches megatron).
NOT_RUN = {
    "optimizer": "the trainer runs Adam (set the Adam fields: trainer.lr, adam_beta1/2, adam_eps, weight_decay)",
    "overlap_param_gather": "the trainer's forward-only passes (old logprobs, snapshots) run the bare model, which "
                            "would miss the deferred parameter all-gather",
    "overlap_grad_reduce": "the trainer finalises gradients after the schedule (megatron's finalize_model_grads); "
                           "overlapped reduction is not wired into its schedules yet",
    "use_megatron_fsdp": "the trainer uses megatron's DistributedDataParallel with the distributed optimizer",
    "moe_use_legacy_grouped_gemm": "megatron's legacy GroupedMLP holds every expert in one transposed tensor, which "
                                   "the HF converter does not read (--moe-grouped-gemm alone builds grouped experts "
                                   "whose names it reads: TE's on the te spec, sluice's on the local one)",
}


def not_run(name: str, value: Any) -> bool:
    """Whether megatron field `name` set to `value` asks for something this trainer never runs (NOT_RUN);
    `--optimizer adam` is what it runs anyway."""
    return name in NOT_RUN and value not in (False, None) and not (name == "optimizer" and value == "adam")
