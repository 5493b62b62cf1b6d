"""slime's launch arguments, as slime's scripts write them, turned into a sluice run config: one table (the rows of
launch.slime.table, launch.slime.table_algo and launch.slime.megatron) that the CLI parses (`--<slime flag>` beside
sluice's own options), `sluice --help slime` prints and docs/from_slime.md lists. Rows map a value to config keys,
are refused naming what to use instead, or are derived here from the whole run config (batch sizes, the GPU
layout, the loss family), with slime's defaults where sluice's differ. Imports no backend."""
from __future__ import annotations

import argparse
import copy
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

from glue.rollout.config import RolloutConfig
from launch.slime.megatron import SCHEDULE, SHAPE_ARGS
from launch.slime.spec import SlimeArg
from launch.slime.table import CLUSTER, DATA, EVAL, ROLLOUT, TRAIN
from launch.slime.table_algo import ALGO, CHECKPOINT, DEBUG, LOGGING, OTHER, REWARD

ROWS: list[SlimeArg] = [*CLUSTER, *TRAIN, *ROLLOUT, *DATA, *EVAL, *ALGO, *CHECKPOINT, *REWARD, *LOGGING, *DEBUG,
                        *OTHER, *SCHEDULE, *SHAPE_ARGS]
PASSED_THROUGH = frozenset({"--lr", "--clip-grad"})  # megatron-core fields with slime's meaning: the megatron group parses them
BY_NAME = {row.name: row for row in ROWS}
FLAGS = frozenset(row.flag for row in ROWS) - PASSED_THROUGH  # parsed by the slime group
ENV = {"wandb_key": "WANDB_API_KEY", "wandb_host": "WANDB_BASE_URL"}  # given to sluice's environment, not its config
GROUP_TITLE = "slime (slime's launch arguments as its scripts write them; sluice --help slime)"
ESTIMATORS = {  # slime --advantage-estimator -> (loss.advantage_estimator, loss.policy_loss, clip fields' prefix)
    "grpo": ("grpo", "ppo_clip", "clip"), "gspo": ("grpo", "gspo", "gspo_clip"),
    "cispo": ("grpo", "cispo", "cispo_clip"), "reinforce_plus_plus": ("reinforce_pp", "ppo_clip", "clip"),
    "reinforce_plus_plus_baseline": ("reinforce_pp_baseline", "ppo_clip", "clip"), "ppo": ("gae", "ppo_clip", "clip"),
}
SLIME_DEFAULTS = {"actor_num_nodes": 1, "actor_num_gpus_per_node": 8, "rollout_num_gpus_per_engine": 1,
                  "num_gpus_per_node": 8, "lr": 1e-6}
CLUSTER_FLAGS = ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "num_gpus_per_node", "colocate")
EVAL_FLAGS = frozenset(row.name for row in EVAL)
LOSS_FLAGS = frozenset(row.name for row in ALGO if row.key.startswith("loss."))


def add_slime_flags(parser: argparse.ArgumentParser) -> None:
    """Every row as an option with slime's spelling and arity; values land in dest `slime:<name>`."""
    group = parser.add_argument_group(GROUP_TITLE, "Mapped to sluice config keys; sluice --help slime lists them.")
    for row in (r for r in ROWS if r.flag in FLAGS):
        kwargs: dict[str, Any] = {"dest": f"slime:{row.name}", "default": argparse.SUPPRESS,
                                  "help": f"-> {row.key}".replace("%", "%%")}
        if row.takes == "none":
            kwargs["action"] = "store_true"
        elif row.takes == "negatable":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = row.scalar if row.scalar in (int, float) else str
            kwargs["metavar"] = {int: "INT", float: "FLOAT"}.get(row.scalar, "VALUE")
            if row.takes == "many":
                kwargs["nargs"] = "+"
        group.add_argument(row.flag, **kwargs)


@dataclass
class Translation:
    """What slime values become: `values` set like the other pass-through flags (over the YAML, under the
    overrides), `defaults` set only where the run config has no value (slime's defaults where sluice's differ)."""

    values: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    defaults: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    notes: list[str] = field(default_factory=list)


def environment(given: dict[str, Any]) -> dict[str, str]:
    """The environment variables slime values stand for (--wandb-key -> WANDB_API_KEY, ...)."""
    return {ENV[name]: str(value) for name, value in given.items() if name in ENV}


def translate(given: dict[str, Any], context: dict[str, Any], *, loggers: tuple[str, ...] = ()) -> Translation:
    """`given` (slime values by name) in `context` (the run config mapping with everything else applied: YAML,
    pass-through flags, overrides); `loggers`: run.loggers' default. Raises ValueError naming the flag and what to
    use instead."""
    out = Translation()
    for name, value in given.items():
        row = BY_NAME[name]
        if row.refused:
            raise ValueError(f"{row.flag} (slime) has {row.note.replace('no equivalent: ', 'no sluice equivalent: ')}")
        if row.apply is not None:
            out.values.update(row.apply(value, given))
    here = copy.deepcopy(context)
    for key, value in out.values.items():
        put(here, key, value)
    for derive in (cluster, batches, loss_family):
        out.values.update(derive(given, here, out.notes))
    out.values.update(run_loggers(given, here, loggers))
    out.defaults.update(slime_defaults(given, context))
    return out


def cluster(given: dict[str, Any], here: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """slime's GPU layout -> placement, engines and the trainer's DP (slime derives DP, as Megatron-LM does)."""
    if not any(name in given for name in (*CLUSTER_FLAGS, "rollout_num_gpus_per_engine")):
        return {}
    v = {**SLIME_DEFAULTS, **given}
    per_engine = v["rollout_num_gpus_per_engine"]
    if not any(name in given for name in CLUSTER_FLAGS):
        return {"cluster.engine_tensor_parallel_size": per_engine}
    colocate, trainer_gpus = bool(v.get("colocate")), v["actor_num_nodes"] * v["actor_num_gpus_per_node"]
    engine_gpus = v.get("rollout_num_gpus") or (trainer_gpus if colocate else None)
    if engine_gpus is None:
        raise ValueError("--rollout-num-gpus is needed without --colocate: the engines' GPUs (slime's rollout GPUs)")
    if engine_gpus % per_engine:
        raise ValueError(f"--rollout-num-gpus {engine_gpus} must be a multiple of --rollout-num-gpus-per-engine "
                         f"{per_engine}")
    t = here.get("trainer", {})
    dense = math.prod(t.get(f"{n}_size", 1) or 1 for n in ("tensor_model_parallel", "pipeline_model_parallel",
                                                            "context_parallel"))
    if trainer_gpus % dense:
        raise ValueError(f"the trainer's {trainer_gpus} GPUs (--actor-num-nodes x --actor-num-gpus-per-node) are not a "
                         f"multiple of TP x PP x CP = {dense}")
    node_gpus = given.get("num_gpus_per_node") or (v["actor_num_gpus_per_node"] if colocate else
                                                   max(v["actor_num_gpus_per_node"], v["num_gpus_per_node"]))
    total = trainer_gpus if colocate else trainer_gpus + engine_gpus
    return {"cluster.placement": "colocated" if colocate else "disaggregated",
            "cluster.num_nodes": math.ceil(total / node_gpus), "cluster.gpus_per_node": node_gpus,
            "cluster.trainer_gpus": trainer_gpus, "cluster.engine_gpus": engine_gpus,
            "cluster.engine_tensor_parallel_size": per_engine, "rollout.num_engines": engine_gpus // per_engine,
            "trainer.data_parallel_size": trainer_gpus // dense}


def batches(given: dict[str, Any], here: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """--global-batch-size (samples per optimizer step) -> optimizer steps per rollout; dynamic batch size ->
    packed micro-batches."""
    out: dict[str, Any] = {}
    if "global_batch_size" in given:
        r, gbs = here.get("rollout", {}), given["global_batch_size"]
        prompts = r.get("prompts_per_step", RolloutConfig.prompts_per_step)
        group = r.get("samples_per_prompt", RolloutConfig.samples_per_prompt)
        if gbs < 1 or (prompts * group) % gbs:
            raise ValueError(f"--global-batch-size {gbs} must divide the {prompts} x {group} = {prompts * group} samples "
                             "of a rollout (--rollout-batch-size x --n-samples-per-prompt)")
        steps = prompts * group // gbs
        if given.get("num_steps_per_rollout", steps) != steps:
            raise ValueError(f"--num-steps-per-rollout {given['num_steps_per_rollout']} disagrees with "
                             f"--global-batch-size {gbs} ({prompts * group} samples / {gbs} = {steps} steps)")
        out["trainer.num_mini_batches"] = steps
    if given.get("use_dynamic_batch_size"):
        if "max_tokens_per_gpu" not in given:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu (the tokens of one packed "
                             "micro-batch), as slime asserts")
        out["trainer.max_tokens_per_micro_batch"] = given["max_tokens_per_gpu"]
    elif "max_tokens_per_gpu" in given:
        notes.append("--max-tokens-per-gpu is read only with --use-dynamic-batch-size, as in slime: not used")
    return out


def loss_family(given: dict[str, Any], here: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """--advantage-estimator names an estimator and, for gspo / cispo, the policy loss, whose clip fields then take
    --eps-clip / --eps-clip-high; --kl-loss-coef counts only with --use-kl-loss."""
    out: dict[str, Any] = {}
    name = given.get("advantage_estimator")
    if name is not None:
        if name not in ESTIMATORS:
            raise ValueError(f"--advantage-estimator {name}: choose one of {', '.join(ESTIMATORS)}")
        out["loss.advantage_estimator"], out["loss.policy_loss"], _ = ESTIMATORS[name]
    prefix = ESTIMATORS.get(name or "grpo", ESTIMATORS["grpo"])[2]
    if "eps_clip" in given:
        out[f"loss.{prefix}_low"] = given["eps_clip"]
    high = given.get("eps_clip_high", given.get("eps_clip"))
    if high is not None:
        out[f"loss.{prefix}_high"] = high
    if given.get("use_kl_loss"):
        out["loss.kl_loss_coef"] = given.get("kl_loss_coef", 0.0)
    elif "kl_loss_coef" in given:
        notes.append("--kl-loss-coef counts only with --use-kl-loss, as in slime: no KL loss")
    return out


def run_loggers(given: dict[str, Any], here: dict[str, Any], default: tuple[str, ...]) -> dict[str, Any]:
    """--use-wandb / --use-tensorboard add their logger to run.loggers (`default` when the run config has none)."""
    wanted = [name for flag, name in (("use_tensorboard", "tensorboard"), ("use_wandb", "wandb")) if given.get(flag)]
    if not wanted:
        return {}
    current = list(here.get("run", {}).get("loggers") or default)
    return {"run.loggers": current + [name for name in wanted if name not in current]}


def slime_defaults(given: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    """slime's defaults where sluice's differ, for the parts of the run slime's arguments describe: set only where
    the run config has no value of its own."""
    out: dict[str, Any] = {}
    if "prompt_data" in given:
        out.update({"rollout.task_args.prompt_key": "input", "rollout.task_args.apply_chat_template": False,
                    "rollout.task_args.shuffle": False})
    if EVAL_FLAGS & set(given):
        out["eval.sampling.temperature"] = None  # null: the rollout's temperature, as slime's eval defaults to
    if LOSS_FLAGS & set(given) and "preset" not in context.get("loss", {}):
        out["loss.aggregation"] = "seq_mean_token_mean"  # slime averages each sample's token mean
        if given.get("use_kl_loss") or given.get("kl_coef"):
            out["loss.kl_estimator"] = "k1"
    if given.get("use_wandb"):
        out["run.wandb.mode"] = "online"
    if "hf_checkpoint" in given:
        out["trainer.lr"] = SLIME_DEFAULTS["lr"]
    return out


def apply(raw: dict[str, Any], translation: Translation) -> None:
    """Set the translation's values in `raw`, then its defaults where `raw` has none."""
    for key, value in translation.values.items():
        put(raw, key, value)
    for key, value in translation.defaults.items():
        if not has(raw, key):
            put(raw, key, value)


MISSING = object()


def check_same_keys(given: dict[str, Any], flags: dict[str, Any]) -> None:
    """A slime (Megatron-LM) flag and a pass-through flag that set one config key (--decoder-first-pipeline-num-layers
    and --num-layers-in-first-pipeline-stage) must agree: two values on one command line are refused naming both."""
    for name, value in given.items():
        row = BY_NAME[name]
        for key, mine in (row.apply(value, given) if row.apply is not None else {}).items():
            node: Any = flags
            for part in key.split("."):
                node = node.get(part, MISSING) if isinstance(node, dict) else MISSING
            if node is MISSING or node == mine:
                continue
            flag = key.rsplit(".", 1)[1].replace("_", "-")
            other = f"--{'' if node else 'no-'}{flag}" if isinstance(node, bool) else f"--{flag} {node}"
            raise ValueError(f"{row.flag if row.takes == 'none' else f'{row.flag} {value}'} and {other} set one "
                             f"config key, {key}, to different values; give one of them")


def check_label_key(raw: dict[str, Any], given: dict[str, Any]) -> None:
    """slime's --prompt-data has no label key by default; sluice's text task scores every answer against one."""
    if "prompt_data" in given and not has(raw, "rollout.task_args.label_key"):
        raise ValueError("--prompt-data needs --label-key (the row field holding the answer the reward compares "
                         "with), or rollout.task_args.label_key")


def put(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = copy.deepcopy(value)


def has(raw: dict[str, Any], dotted: str) -> bool:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def help_table(width: int = 118) -> str:
    """`sluice --help slime`: every row by slime's group, its sluice key and note."""
    lines = ["slime's launch arguments in sluice (docs/from_slime.md): flag -> sluice config key; \"-\" with "
             "\"no equivalent\" is refused naming what to use. Megatron-core config fields (--tensor-model-parallel-size, "
             "--recompute-*, ...) pass through as before (sluice --help megatron); --sglang-* as before.", ""]
    for group in dict.fromkeys(row.group for row in ROWS):
        lines.append(f"{group}:")
        for row in (r for r in ROWS if r.group == group):
            lines.append(f"  {row.flag:<44} {row.key}")
            if row.note:
                lines += textwrap.wrap(row.note, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
        lines.append("")
    return "\n".join(lines)


def markdown_table() -> str:
    """The table of docs/from_slime.md: one row per argument, by slime's group (a test keeps the docs equal to it)."""
    lines = ["| slime argument | sluice config key | note |", "|---|---|---|"]
    for group in dict.fromkeys(row.group for row in ROWS):
        lines.append(f"| **{group}** | | |")
        for row in (r for r in ROWS if r.group == group):
            note = row.note.replace("|", "\\|")
            lines.append(f"| `{row.flag}` | {row.key if row.key == '-' else f'`{row.key}`'} | {note} |")
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m launch.slime.args`: the table of docs/from_slime.md
    print(markdown_table())
