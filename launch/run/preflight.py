"""What is checked before anything starts, by `sluice --dry-run` and by every run: the rollout function, task and
eval task import; the model directory is a checkpoint the trainer can build under its layout, with whole weight
files, and the layer spec is one this machine builds (launch.plan.model_check); a trainer rank's training state fits
cluster.gpu_memory_gb (launch.plan.memory_lines); no weight group puts two ranks on one device where NCCL would refuse it
(launch.plan.weight_groups); the data files and the tokenizer the tasks read are there; the ports the config fixes are
free here; the placement group fits the local Ray cluster.
Each problem is one `ConfigError` line naming the key and the fix, so a typo costs a second, not a Ray start-up and
a stack of tracebacks."""
from __future__ import annotations

import errno
import inspect
import socket
from pathlib import Path
from typing import Any

from glue.plugins import check_signature, load_object
from glue.rewards.judge import load_parser
from glue.rollout.slime.adapter import load_slime_functions
from launch.config import ConfigError, SluiceConfig
from launch.plan.memory_lines import check_memory
from launch.plan.model_check import (TOKENIZER_FILES, check_layer_spec, check_model, check_transformer_engine,
                                     describe_attention, describe_experts, has_tokenizer, model_config, weight_files)
from launch.plan.run_plan import RunPlan
from launch.plan.weight_groups import check_weight_groups
from launch.run.tasks import build_if_standalone, check_task_args, eval_task
from launch.run.teacher import check_teacher
from launch.run.user_code import plugin_files


def preflight(cfg: SluiceConfig, plan: RunPlan, *, here: bool = True) -> list[str]:
    """Run every check; returns one line per check (the dry run prints them). `here=False` is a dry run, which may
    plan a GPU run on a login node (too few local GPUs is reported, not refused) from a model directory holding
    config.json alone (reported as plan-only; a real start needs the weights); what such a plan for other nodes
    needs there (transformer-engine) is a `requires:` line instead of a check of this machine."""
    elsewhere, trainer = plans_elsewhere(cfg, plan, here=here), cfg.trainer
    checks = [check_plugins(cfg), check_eval(cfg, plan.placement), check_model(cfg, plan_only=not here),
              check_layer_spec(trainer, elsewhere=elsewhere), check_transformer_engine(trainer, elsewhere=elsewhere),
              describe_attention(trainer, cfg.cluster.uses_gpus, model_config(cfg)),
              describe_experts(trainer, cfg.cluster.uses_gpus, model_config(cfg)), check_memory(cfg),
              check_data(cfg), check_weight_groups(cfg, plan), check_tokenizer(cfg, plan_only=not here), check_ports(cfg, plan),
              check_placement(cfg, plan, here=here), check_ref_load(cfg, elsewhere=elsewhere),
              *([check_teacher(cfg)] if cfg.teacher is not None else [])]
    return [line for line in checks if line is not None]


def plans_elsewhere(cfg: SluiceConfig, plan: RunPlan, *, here: bool) -> bool:
    """Whether a dry run plans for other machines than this one: it attaches to a Ray cluster (run.ray_address or
    RAY_ADDRESS), reads a plan-only model directory (config.json, no weights), or asks for more GPUs than this machine
    has. A real start (`here`) runs from this machine, whose venv every node shares."""
    if here:
        return False
    path = cfg.model.path
    if cfg.run.cluster_address is not None or (path is not None and Path(path).is_dir() and not weight_files(path)):
        return True
    gpus = sum(b.get("GPU", 0) for b in plan.bundles)
    return gpus > 0 and gpus > local_gpu_count()


def check_plugins(cfg: SluiceConfig) -> str:
    """Import the rollout function, the task and the eval task, and check the function's signature (and that it
    can record MoE routing when `rollout.return_routed_experts` asks for it)."""
    fn = _load(cfg.rollout.function, "rollout.function")
    try:
        check_signature(fn, ["ctx", "prompt", "num_samples"], what="rollout.function")
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if cfg.rollout.return_routed_experts and getattr(fn, "__module__", None) == "rollout_fns.openai_agent":
        from rollout_fns.openai_agent import NO_ROUTING  # lazy: aiohttp; loaded already when fn comes from it

        raise ConfigError(NO_ROUTING)
    built = []
    for section, task_path, args in task_settings(cfg):
        _load(task_path, f"{section}.task")
        try:
            check_task_args(task_path, args, key=f"{section}.task_args")
            if build_if_standalone(task_path, args, key=f"{section}.task_args"):
                built.append(f"{section}.task")
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None
    slime = check_slime_functions(cfg)
    if cfg.judge is not None:
        try:
            load_parser(cfg.judge.parser)
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None
    found = [f"{key} {path} from {file or 'a module without a file'}" for key, path, file in plugin_files(cfg)]
    tasks = f"; built {' and '.join(built)} from task_args" if built else ""
    return "plugins: " + "; ".join(found) + tasks + slime


def check_slime_functions(cfg: SluiceConfig) -> str:
    """rollout.slime's and reward.slime's functions import and fit slime's contracts ('' when none is set)."""
    paths = {"generate_function": cfg.rollout.slime.generate_function,
             "rollout_function": cfg.rollout.slime.rollout_function, "reward_function": cfg.reward.slime.function}
    if not any(paths.values()):
        return ""
    if cfg.rollout.return_routed_experts and cfg.rollout.slime.enabled:
        raise ConfigError("rollout.return_routed_experts: slime functions post /generate themselves and their samples "
                          "carry no MoE routing to sluice; turn the key off or use rollout_fns.single_turn or "
                          "rollout_fns.multi_turn")
    try:
        load_slime_functions(*paths.values())
    except (ImportError, AttributeError, OSError, TypeError, ValueError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    except Exception as err:  # the module itself failed at import
        raise ConfigError(f"slime function: importing failed: {type(err).__name__}: {err}") from None
    return "; slime functions " + ", ".join(p for p in paths.values() if p) + " fit slime's contracts"


def _load(path: str, what: str):
    """`glue.plugins.load_object`, with whatever importing the user's module raised turned into one line."""
    try:
        return load_object(path, what=what)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    except Exception as err:  # the module itself failed: a SyntaxError, an exception at import time
        raise ConfigError(f"{what}: importing {path!r} failed: {type(err).__name__}: {err}") from None


def check_ref_load(cfg: SluiceConfig, *, elsewhere: bool = False) -> str | None:
    """`trainer.ref_load` (the KL term's reference policy) is a checkpoint the trainer can read, of the policy's
    architecture. A dry run planning for other machines reports a folder it cannot see instead of refusing it."""
    from glue.trainer.reference import check_same_shapes, resolve_ref_load  # lazy: torch

    path = cfg.trainer.ref_load
    if path is None:
        return "reference: the initial policy, model.path (KL loss)" if cfg.loss.kl_loss_coef > 0 else None
    if not cfg.loss.kl_loss_coef > 0:
        return f"reference: trainer.ref_load={path} not read (loss.kl_loss_coef is 0: no KL loss term)"
    if elsewhere and not Path(path).exists():
        return f"reference: trainer.ref_load={path} is not on this machine; checked at start-up"
    try:
        ref = resolve_ref_load(path)
        if cfg.model.path is not None:
            check_same_shapes(ref, cfg.model.path)
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from None
    return f"reference: {ref.kind} checkpoint {ref.path} (trainer.ref_load)"


def check_eval(cfg: SluiceConfig, placement: str) -> str:
    """Evaluation runs after a step's sync; with colocated placement the engines hold no weights after a step
    without one, so every eval step must be a sync step."""
    e, interval = cfg.eval, cfg.sync.interval
    if e.enabled and placement == "colocated" and e.interval % interval:
        raise ConfigError(f"eval.interval={e.interval} must be a multiple of sync.interval={interval} with "
                          "cluster.placement=colocated (the engines hold weights only after a sync)")
    return f"eval: every {e.interval} steps" if e.enabled else "eval: off"


def task_settings(cfg: SluiceConfig) -> list[tuple[str, str, dict[str, Any]]]:
    """(config section, task import path, its task_args) of the training task and, when evaluation is on, the eval
    task; `eval.task_args` of an eval without its own task update the training task's."""
    tasks = [("rollout", cfg.rollout.task, dict(cfg.rollout.task_args))]
    if cfg.eval.enabled:
        tasks.append(("eval", *eval_task(cfg)))
    return tasks


def _arg_key(cfg: SluiceConfig, section: str, key: str) -> str:
    """The config key a task argument came from (an eval without its own task inherits rollout.task_args)."""
    inherited = section == "eval" and cfg.eval.task is None and key not in cfg.eval.task_args
    return f"{'rollout' if inherited else section}.task_args.{key}"


def check_data(cfg: SluiceConfig) -> str:
    """The data files the tasks read when they are built exist: a task class lists the task_args naming such files
    in `data_file_args` (rollout_fns.text_data.TextDataTask: `path`)."""
    files = []
    for section, task_path, args in task_settings(cfg):
        task = _load(task_path, f"{section}.task")
        for name in getattr(task, "data_file_args", ()):
            if name in args and not Path(str(args[name])).is_file():
                raise ConfigError(f"{_arg_key(cfg, section, name)}={args[name]!r}: no such file; {task_path} reads "
                                  "it at start-up, so point it at an existing local data file")
            if name in args:
                files.append(str(args[name]))
    return f"data: {', '.join(dict.fromkeys(files))} found" if files else "data: the tasks read no data files"


def tokenizer_readers(cfg: SluiceConfig) -> list[tuple[str, str | None]]:
    """(who, the directory given for it or None for the model's own) for each part of the run that loads a
    tokenizer: a task class taking `tokenizer` (launch.run.tasks.task_args_for gives it the model's), and the
    OpenAI-agent rollout, whose chat requests the engines tokenize with the model's."""
    readers = []
    for section, task_path, args in task_settings(cfg):
        task = _load(task_path, f"{section}.task")
        if inspect.isclass(task) and "tokenizer" in inspect.signature(task).parameters:
            readers.append((f"{section}.task {task_path}", args.get("tokenizer")))
    if cfg.rollout.function.startswith("rollout_fns.openai_agent:"):
        readers.append((f"rollout.function {cfg.rollout.function} (chat requests)", None))
    if cfg.judge is not None or cfg.reward_model is not None:  # they read the policy's prompts and responses as text
        readers.append(("judge: / reward_model: (decoding the policy's responses)", None))
    return readers


def check_tokenizer(cfg: SluiceConfig, *, plan_only: bool) -> str:
    """Whatever loads a tokenizer finds one: in the directory given for it, else in model.path (a tiny model needs
    model.tiny.tokenizer). A plan-only model directory (no weights) is not checked in a dry run. A given name that is
    no directory may be a cached hub id, left to the loader."""
    readers = tokenizer_readers(cfg)
    if not readers:
        return "tokenizer: nothing loads one"
    path = cfg.model.path
    plan_only_dir = path is not None and plan_only and not weight_files(path)
    for who, given in readers:
        if given is None and path is None and not cfg.model.tiny.tokenizer:
            raise ConfigError(f"{who} loads the model's tokenizer, but the tiny model has none: set "
                              "model.tiny.tokenizer: true (with model.tiny.vocab_size >= 260)")
        directory = given if given is not None else None if plan_only_dir else path
        if directory is not None and Path(directory).is_dir() and not has_tokenizer(directory):
            raise ConfigError(f"{who} loads a tokenizer from {directory!r}, which holds none of "
                              f"{', '.join(TOKENIZER_FILES)}: copy the checkpoint's tokenizer files there")
    if plan_only_dir:
        return f"tokenizer: not checked in the plan-only directory {path}"
    where = sorted({given or path or "the tiny model" for _, given in readers})
    return f"tokenizer: {', '.join(where)} (for {', '.join(who for who, _ in readers)})"


def fixed_ports(cfg: SluiceConfig, plan: RunPlan) -> dict[str, int]:
    """The ports the config fixes and which process would listen on this machine: the router's (it runs beside
    the driver) and, on one node, the trainer's rendezvous port. Everything else sluice picks free at start-up."""
    ports = {}
    args = plan.router_args
    for flag, value in zip(args, args[1:]):
        if flag.startswith("--") and flag.endswith("-port") and value.isdigit():
            ports[f"router.{flag[2:].replace('-', '_')}"] = int(value)
    if cfg.trainer.master_port and cfg.cluster.num_nodes == 1:
        ports["trainer.master_port"] = cfg.trainer.master_port
    return ports


def check_ports(cfg: SluiceConfig, plan: RunPlan) -> str:
    for key, port in fixed_ports(cfg, plan).items():
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as err:
                if err.errno != errno.EADDRINUSE:
                    raise
                raise ConfigError(f"{key}={port}: the port is in use on this machine; pick another one, or leave "
                                  f"it unset and sluice picks a free port") from None
    return "ports: " + (", ".join(f"{k}={v} free" for k, v in fixed_ports(cfg, plan).items()) or
                        "all picked free at start-up")


def check_placement(cfg: SluiceConfig, plan: RunPlan, *, here: bool = True) -> str:
    """A local Ray cluster (run.ray_address and RAY_ADDRESS unset) gets run.ray_num_cpus CPUs and this machine's GPUs: the
    placement group must fit in them (GPUs: only when the run is to start `here`). An existing cluster is checked
    when the group is reserved."""
    cpus = sum(b.get("CPU", 0) for b in plan.bundles)
    gpus = sum(b.get("GPU", 0) for b in plan.bundles)
    where = f"{len(plan.bundles)} bundles, {cpus:g} CPUs" + (f", {gpus:g} GPUs" if gpus else "")
    if cfg.run.cluster_address is not None:
        return (f"placement: {where}, reserved on the cluster at {cfg.run.cluster_address} "
                f"({cfg.run.cluster_address_source}) at start-up")
    if cpus > cfg.run.ray_num_cpus:
        raise ConfigError(f"the placement group needs {cpus:g} CPUs ({len(plan.bundles)} bundles x "
                          f"cluster.cpus_per_bundle) but the local Ray cluster gets run.ray_num_cpus="
                          f"{cfg.run.ray_num_cpus}; raise run.ray_num_cpus or lower cluster.cpus_per_bundle")
    if gpus:
        have = local_gpu_count()
        if gpus > have and not here:
            return (f"placement: {where}; this machine has {have} GPUs, so the run must start on a node (or attach "
                    "to a cluster, run.ray_address) that has them")
        if gpus > have:
            raise ConfigError(f"the placement group needs {gpus:g} GPUs (trainer + engines) but this machine has "
                              f"{have}; lower cluster.gpus_per_node / the parallel sizes, or attach to a cluster "
                              "with run.ray_address")
    return f"placement: {where}, fits the local Ray cluster"


def local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
