"""What is checked before anything starts, by `sluice --dry-run` and by every run: the rollout function, task and
eval task import; the model directory is a checkpoint the trainer can build; the ports the config fixes are free
here; the placement group fits the local Ray cluster. Each problem is one `ConfigError` line naming the key and the
fix, so a typo costs a second, not a Ray start-up and a stack of tracebacks."""
from __future__ import annotations

import errno
import socket
from pathlib import Path

from launch.config import ConfigError, SluiceConfig
from launch.plan import RunPlan


def preflight(cfg: SluiceConfig, plan: RunPlan, *, here: bool = True) -> list[str]:
    """Run every check; returns one line per check (the dry run prints them). `here=False` (a dry run, which may
    plan a GPU run on a login node) reports too few local GPUs instead of refusing."""
    return [check_plugins(cfg), check_eval(cfg, plan.placement), check_model(cfg), check_ports(cfg, plan),
            check_placement(cfg, plan, here=here)]


def check_plugins(cfg: SluiceConfig) -> str:
    """Import the rollout function, the task and the eval task, and check the function's signature (and that it
    can record MoE routing when `rollout.return_routed_experts` asks for it)."""
    from glue.plugins import check_signature

    fn = _load(cfg.rollout.function, "rollout.function")
    try:
        check_signature(fn, ["ctx", "prompt", "num_samples"], what="rollout.function")
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if cfg.rollout.return_routed_experts and getattr(fn, "__module__", None) == "rollout_fns.openai_agent":
        from rollout_fns.openai_agent import NO_ROUTING

        raise ConfigError(NO_ROUTING)
    _load(cfg.rollout.task, "rollout.task")
    if cfg.eval.enabled:
        from launch.runner import eval_task

        _load(eval_task(cfg)[0], "eval.task")
    return f"plugins: {cfg.rollout.function} and {cfg.rollout.task} import"


def _load(path: str, what: str):
    """`glue.plugins.load_object`, with whatever importing the user's module raised turned into one line."""
    from glue.plugins import load_object

    try:
        return load_object(path, what=what)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    except Exception as err:  # the module itself failed: a SyntaxError, an exception at import time
        raise ConfigError(f"{what}: importing {path!r} failed: {type(err).__name__}: {err}") from None


def check_eval(cfg: SluiceConfig, placement: str) -> str:
    """Evaluation runs after a step's sync; with colocated placement the engines hold no weights after a step
    without one, so every eval step must be a sync step."""
    e, interval = cfg.eval, cfg.sync.interval
    if e.enabled and placement == "colocated" and e.interval % interval:
        raise ConfigError(f"eval.interval={e.interval} must be a multiple of sync.interval={interval} with "
                          "cluster.placement=colocated (the engines hold weights only after a sync)")
    return f"eval: every {e.interval} steps" if e.enabled else "eval: off"


def check_model(cfg: SluiceConfig) -> str:
    """`model.path` is a local HF checkpoint of a family the trainer builds, with its weight files; null builds
    a tiny random model at start-up. `rollout.return_routed_experts` needs a model with routed experts."""
    if cfg.trainer.routing_replay and not cfg.rollout.return_routed_experts:
        raise ConfigError("trainer.routing_replay replays the engines' MoE routing: set rollout.return_routed_experts: "
                          "true too")
    if cfg.model.path is None:
        if cfg.rollout.return_routed_experts and cfg.model.tiny.family != "qwen3_moe":
            raise ConfigError(f"rollout.return_routed_experts needs a mixture-of-experts model; model.tiny.family is "
                              f"{cfg.model.tiny.family!r} (use qwen3_moe)")
        return "model: a tiny random model is built at start-up (model.path is null)"
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise ConfigError(f"model.path {cfg.model.path!r} {what}: point it at a local HF checkpoint directory "
                          "(config.json, *.safetensors, tokenizer files)")
    from glue.trainer.model import read_hf_config

    try:
        hf_config = read_hf_config(str(path))
    except Exception as err:  # transformers' own message says what is wrong with config.json
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model.path {cfg.model.path!r}: its config.json does not load: {first}") from None
    if cfg.rollout.return_routed_experts and not getattr(hf_config, "num_experts", None):
        raise ConfigError(f"rollout.return_routed_experts needs a mixture-of-experts model; {cfg.model.path!r} is a "
                          f"dense {hf_config.model_type} checkpoint")
    weights = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    if not weights:
        raise ConfigError(f"model.path {cfg.model.path!r} holds no *.safetensors or *.bin weight files")
    return f"model: {path} is a {hf_config.model_type} checkpoint ({len(weights)} weight files)"


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
    """A local Ray cluster (run.ray_address null) gets run.ray_num_cpus CPUs and this machine's GPUs: the
    placement group must fit in them (GPUs: only when the run is to start `here`). An existing cluster is checked
    when the group is reserved."""
    cpus = sum(b.get("CPU", 0) for b in plan.bundles)
    gpus = sum(b.get("GPU", 0) for b in plan.bundles)
    where = f"{len(plan.bundles)} bundles, {cpus:g} CPUs" + (f", {gpus:g} GPUs" if gpus else "")
    if cfg.run.ray_address is not None:
        return f"placement: {where}, reserved on the cluster at {cfg.run.ray_address} at start-up"
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
