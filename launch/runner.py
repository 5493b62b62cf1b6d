"""Bring a run up and down: plan, run directory, model, Ray + placement group, fleet + router, trainer, weight
bridge, then the loop.

Everything started here is stopped here (ExitStack), on success, on error, on Ctrl-C and SIGTERM
(launch.stopping: the first signal stops after the step in progress, a second at once).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import sys
import threading
from pathlib import Path

from launch.config import ConfigError, SluiceConfig, write_resolved
from launch.plan import RunPlan, resolve
from launch.preflight import preflight
from launch.startup import StartupClock
from launch.stopping import StopSignals


def run(cfg: SluiceConfig) -> Path:
    """Run `cfg` to completion; returns the run directory (metrics.jsonl, config.yaml, logs/, checkpoints/, hf/)."""
    cfg, plan = resolve(cfg)
    if plan.notes:
        raise ConfigError("this build cannot run the plan: " + "; ".join(plan.notes))
    preflight(cfg, plan)
    run_dir = cfg.run_dir
    resume_from = find_checkpoint(cfg)
    clock = StartupClock()
    model_path = prepare_model(cfg, run_dir)
    clock("model", f"{model_path}" + (" (a tiny random model)" if cfg.model.path is None else ""))
    with contextlib.ExitStack() as stack:
        placement = start_ray(cfg, plan, stack)
        clock("ray", f"placement: {describe_placement(plan, placement)}")
        stop = stack.enter_context(StopSignals())  # after ray.init, which sets a SIGTERM handler of its own
        fleet, client, trainer, bridge, manager, loop = start_components(cfg, plan, placement, model_path, run_dir,
                                                                         stack, clock)
        from glue.colocation import make_colocation

        colocation = make_colocation(plan.placement, trainer=trainer, bridge=bridge, engine_urls=fleet.engine_urls,
                                     timeout_s=cfg.sync.timeout_s, api_key=fleet.api_key,
                                     admin_api_key=fleet.admin_api_key)
        # Start-up succeeded: only now does a previous run's record give way to this one (or get cut back to the
        # checkpoint this run continues from).
        resume_state = restore(cfg, resume_from, trainer=trainer, client=client, colocation=colocation)
        write_resolved(cfg, run_dir / "config.yaml")
        clock.finished(f"training {cfg.run.num_steps} steps ({cfg.run.mode}), metrics in {run_dir / 'metrics.jsonl'}")
        progress = stack.enter_context(_progress_bar(cfg))
        watch = fleet_watch(cfg, plan, fleet=fleet, bridge=bridge, client=client)
        evaluator = make_evaluator(cfg, fn=manager.fn, client=client, model_path=model_path)
        training = loop.create_task(run_training(cfg, manager=manager, trainer=trainer, client=client,
                                                 colocation=colocation, run_dir=run_dir, progress=progress, stop=stop,
                                                 resume_state=resume_state, watch=watch, evaluator=evaluator))
        stop.armed = True
        try:
            last_step = loop.run_until_complete(training)
        except KeyboardInterrupt:  # let the loop cancel what is generating before the stack stops the processes
            stop.stopping = True
            training.cancel()
            with contextlib.suppress(BaseException):
                loop.run_until_complete(training)
            raise
        finally:
            stop.stopping = True
    from glue.checkpoint import Checkpoints
    from glue.metrics import learning_summary, read_metrics

    latest = Checkpoints(run_dir / "checkpoints").latest()
    summary = f"{learning_summary(read_metrics(run_dir / 'metrics.jsonl'))}; metrics in {run_dir / 'metrics.jsonl'}"
    summary += plot_run(run_dir)
    if stop.requested:
        print(f"sluice: stopped at step {last_step} of {cfg.run.num_steps} on {stop.requested}; every process it "
              f"started is stopped; checkpoint {latest}; the same command resumes it (run.resume=auto); {summary}",
              flush=True)
        return run_dir
    if latest is not None:  # the final policy as a plain HF checkpoint (AutoModelForCausalLM.from_pretrained)
        shutil.rmtree(run_dir / "hf", ignore_errors=True)
        shutil.copytree(latest / "hf", run_dir / "hf")
    print(f"sluice: run finished; {summary}; final policy in {run_dir / 'hf'}", flush=True)
    return run_dir


def plot_run(run_dir: Path) -> str:
    """Write the run's plots (glue.plots) and say where; a plot that fails costs one warning line, never the run."""
    try:
        from glue.plots import write_plots

        written = write_plots(run_dir)
    except Exception as err:  # plots are a view of metrics.jsonl, which is complete whatever happens here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"sluice: warning: plots not written ({type(err).__name__}: {reason}); try `sluice plot {run_dir}`",
              flush=True)
        return ""
    return f"; {len(written)} plots in {run_dir / 'plots'}" if written else ""


def find_checkpoint(cfg: SluiceConfig) -> Path | None:
    """The checkpoint this run continues from (`run.resume`: auto = the run folder's latest, never, or a path), or
    None for a fresh start. A folder holding a previous run with nothing to continue is refused unless
    `run.overwrite`; nothing in it is touched here."""
    from glue.checkpoint import Checkpoints

    resume = cfg.run.resume
    if resume not in ("auto", "never"):
        try:
            Checkpoints.read_state(resume)
        except FileNotFoundError as err:
            raise ConfigError(f"run.resume={resume!r}: {err}") from None
        return Path(resume).resolve()
    if cfg.run.overwrite:
        return None
    latest = Checkpoints(cfg.run_dir / "checkpoints").latest() if resume == "auto" else None
    if latest is not None:
        return latest
    check_run_dir(cfg)
    return None


def restore(cfg: SluiceConfig, checkpoint: Path | None, *, trainer, client, colocation) -> dict | None:
    """After start-up: load `checkpoint` into the trainer, bring the engines to its weights and cut metrics.jsonl
    back to its step (returns its driver state); or, starting fresh, clear what a previous run left."""
    from glue.checkpoint import Checkpoints
    from glue.controller import sync_weights

    run_dir, metrics = cfg.run_dir, cfg.run_dir / "metrics.jsonl"
    if checkpoint is None:
        metrics.unlink(missing_ok=True)
        if cfg.run.overwrite:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        return None
    state = Checkpoints.read_state(checkpoint)
    version = trainer.load_checkpoint(str(checkpoint))
    sync_weights(client, colocation, version, cfg.sync.pause_mode)
    kept = [line for line in (metrics.read_text().splitlines() if metrics.exists() else [])
            if line.strip() and json.loads(line).get("step", 0) <= state["step"]]
    metrics.write_text("".join(line + "\n" for line in kept))
    print(f"sluice: resuming from {checkpoint} (step {state['step']}, policy version {version}); "
          f"{len(state.get('finished', []))} finished groups back in the buffer, {len(state['reissue'])} that were "
          f"generating issued again ({sum(len(v) for v in state.get('partial', {}).values())} of their samples "
          "continue from the tokens they had)", flush=True)
    return state


async def run_training(cfg: SluiceConfig, *, manager, trainer, client, colocation, run_dir: Path, progress, watch,
                       stop=lambda: False, resume_state: dict | None = None, evaluator=None) -> int:
    """The loop with its staleness gate, buffer and rollout stream built from the config."""
    from glue.buffer import RolloutBuffer
    from glue.checkpoint import Checkpoints
    from glue.controller import no_evaluation, run_loop
    from glue.metrics import open_run_logger, run_info
    from glue.staleness import StalenessGate
    from launch.config import to_dict
    from glue.stream import RolloutStream

    groups_per_step = cfg.rollout.prompts_per_step
    gate = StalenessGate(groups_per_step=groups_per_step, max_staleness=cfg.sync.max_staleness,
                         interval=cfg.sync.interval, admission=cfg.sync.admission)
    buffer = RolloutBuffer(groups_per_step=groups_per_step,
                           order="group_id" if cfg.run.deterministic else cfg.rollout.buffer_order,
                           stale_policy=cfg.sync.stale_policy)
    stream = RolloutStream(manager=manager, gate=gate, buffer=buffer, max_groups=cfg.run.num_steps * groups_per_step,
                           max_concurrent=cfg.rollout.max_concurrent_groups,
                           max_failed_frac=cfg.rollout.max_failed_frac, drain_before_sync=cfg.run.deterministic,
                           dynamic_sampling=cfg.rollout.dynamic_sampling,
                           max_filtered_frac=cfg.rollout.max_filtered_frac)

    first_step = 1
    if resume_state is not None:
        stream.resume(resume_state, version=resume_state["version"],
                      trained_groups=resume_state["step"] * groups_per_step)
        first_step = resume_state["step"] + 1
        progress.update(resume_state["step"])
    resume_step = None if resume_state is None else resume_state["step"]
    logger = open_run_logger(run_dir, loggers=cfg.run.loggers, info=run_info(to_dict(cfg), resume_step=resume_step),
                             resume_step=resume_step, wandb=to_dict(cfg.run.wandb))

    def on_step(record: dict) -> None:
        progress.update(1)
        progress.set_postfix(reward=f"{record['rollout/reward_mean']:.3f}", loss=f"{record.get('train/loss', 0):.3f}",
                             stale=f"{record['staleness/max']:.0f}")

    training = asyncio.ensure_future(run_loop(
        num_steps=cfg.run.num_steps, stream=stream, trainer=trainer, fleet=watch, phases=colocation,
        loss_cfg=cfg.loss, logger=logger, pause_mode=cfg.sync.pause_mode,
        on_step=on_step, stop=stop, first_step=first_step,
        checkpoints=Checkpoints(run_dir / "checkpoints", keep=cfg.run.keep_checkpoints,
                                interval=cfg.run.save_interval),
        sync_guard=watch.guarded_sync, train_guard=watch.guarded_train,
        extra_metrics=lambda: {**watch.metrics(), **task_metrics(manager.task)},
        evaluate=evaluator.evaluate if evaluator is not None else no_evaluation))
    try:
        return await watch.run(training)
    finally:
        logger.close()


def task_metrics(task) -> dict[str, float]:
    """What a task counts itself: `rollout/filtered_prompts` (e.g. TextDataTask's rows over max_prompt_tokens)."""
    count = getattr(task, "filtered_prompts", None)
    return {"rollout/filtered_prompts": float(count)} if isinstance(count, (int, float)) else {}


def task_args_for(task_path: str, task_args: dict, model_path: str) -> dict:
    """`task_args`, with `tokenizer: <model_path>` added when the task is a class whose constructor takes a
    tokenizer and none was given: a text task reads the policy's own tokenizer and chat template by default."""
    import inspect

    from glue.plugins import load_object

    task = load_object(task_path, what="task")
    if "tokenizer" in task_args or not inspect.isclass(task):
        return dict(task_args)
    takes_tokenizer = "tokenizer" in inspect.signature(task).parameters
    return {**task_args, "tokenizer": model_path} if takes_tokenizer else dict(task_args)


def eval_task(cfg: SluiceConfig) -> tuple[str, dict]:
    """The eval task's import path and arguments: `eval.task` with `eval.task_args`, or with no `eval.task` the
    training task with `rollout.task_args` updated by `eval.task_args` (e.g. another data file)."""
    if cfg.eval.task is None:
        return cfg.rollout.task, {**cfg.rollout.task_args, **cfg.eval.task_args}
    return cfg.eval.task, dict(cfg.eval.task_args)


def make_evaluator(cfg: SluiceConfig, *, fn, client, model_path: str):
    """The held-out evaluation (glue.evaluation) the loop runs every `eval.interval` steps, or None when off."""
    if not cfg.eval.enabled:
        return None
    from glue.evaluation import Evaluator
    from glue.rollout import build_task

    path, args = eval_task(cfg)
    e = cfg.eval
    return Evaluator(fn=fn, task=build_task(path, task_args_for(path, args, model_path)), client=client,
                     sampling_params=e.sampling.to_sglang(cfg.rollout.sampling.to_sglang()), interval=e.interval,
                     at_start=e.at_start, seed=e.seed, num_prompts=e.num_prompts,
                     samples_per_prompt=e.samples_per_prompt, ks=e.pass_at_k, threshold=e.pass_threshold,
                     group_timeout_s=cfg.rollout.group_timeout_s)


def fleet_watch(cfg: SluiceConfig, plan: RunPlan, *, fleet, bridge, client):
    """The watch that keeps engines serving (glue.fleet_watch): a dead or hung engine is replaced and brought to
    the current weights before the router sends it work. Colocated placement ends the run instead (a new engine
    there would have to take its devices back from the trainer mid-step)."""
    from glue.fleet_watch import FleetWatch, engine_repair

    r = cfg.rollout
    turn = threading.Lock()  # train steps and a repair's weight gathering (trainer collectives) take turns
    repair = None if plan.placement == "colocated" else engine_repair(fleet, bridge, trainer_turn=turn, client=client,
                                                                      pause_mode=cfg.sync.pause_mode)
    return FleetWatch(fleet, repair=repair, client=client, trainer_turn=turn,
                      max_restarts=r.max_engine_restarts, health_interval_s=r.health_check_interval_s,
                      health_timeout_s=r.health_check_timeout_s)


def _progress_bar(cfg: SluiceConfig):
    from tqdm import tqdm

    return tqdm(total=cfg.run.num_steps, desc=f"sluice {cfg.run.name} ({cfg.run.mode})", unit="step",
                file=sys.stdout, dynamic_ncols=True)


def check_run_dir(cfg: SluiceConfig) -> None:
    """A folder that holds a previous run is refused unless `run.overwrite`; nothing in it is touched here."""
    run_dir = cfg.run_dir
    metrics = run_dir / "metrics.jsonl"
    if cfg.run.overwrite or not (metrics.exists() or (run_dir / "config.yaml").exists()):
        return
    steps = sum(1 for line in metrics.open() if line.strip()) if metrics.exists() else 0
    raise ConfigError(f"{run_dir} holds a previous run ({steps} steps in metrics.jsonl); start this one under "
                      "another run.name=..., or set run.overwrite=true to replace it (its files are replaced only "
                      "once the new run has started)")


def prepare_model(cfg: SluiceConfig, run_dir: Path) -> str:
    """The HF checkpoint directory engines and trainer load, as an absolute path (engines and trainer ranks may run
    in other folders, or on other nodes that mount the same file system): the configured one, or a tiny random
    model written into the run directory."""
    if cfg.model.path is not None:  # checked by launch.preflight
        return str(Path(cfg.model.path).resolve())
    from dataclasses import asdict

    from transformers.utils import logging as hf_logging

    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.tiny_text_model import save_tiny_text_model

    tiny = asdict(cfg.model.tiny)
    save = save_tiny_text_model if tiny.pop("tokenizer") else save_tiny_model
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar, for a few kilobytes
    return str(Path(save(str(run_dir / "init_model"), **tiny)).resolve())


def start_ray(cfg: SluiceConfig, plan: RunPlan, stack: contextlib.ExitStack):
    """Start or attach to Ray and reserve the plan's placement group (a launch.cluster.Placement)."""
    from launch import cluster

    cluster.start_ray(address=cfg.run.ray_address, num_cpus=cfg.run.ray_num_cpus, node_ip=cfg.cluster.node_ip,
                      stack=stack)
    if cfg.run.ray_address is not None and cfg.cluster.num_nodes > 1:
        nodes = cluster.wait_for_nodes(cfg.cluster.num_nodes, cfg.cluster.node_wait_s)
        print(f"sluice: {len(nodes)}/{cfg.cluster.num_nodes} nodes joined: {', '.join(nodes)}", flush=True)
    return cluster.reserve(plan, stack)


def describe_placement(plan: RunPlan, placement) -> str:
    """Which engines and trainer ranks landed on which node, e.g. `10.0.0.1: engine 0, engine 1; 10.0.0.2: trainer
    rank 0`."""
    by_node: dict[str, list[str]] = {}
    for e in plan.engines:
        by_node.setdefault(placement.node_ip[e.bundles[0]], []).append(f"engine {e.index}")
    for r in plan.trainer:
        by_node.setdefault(placement.node_ip[r.bundle], []).append(f"trainer rank {r.rank}")
    return "; ".join(f"{ip}: {', '.join(items)}" for ip, items in by_node.items())


def trainer_actor_options(cfg: SluiceConfig, plan: RunPlan, placement) -> list[dict]:
    """Each trainer rank pinned to its bundle: a whole GPU on GPU, `trainer.num_cpus_per_worker` CPUs on CPU."""
    gpu = 1 if plan.device == "gpu" else 0
    return [placement.actor_options(r.bundle, num_cpus=0 if gpu else cfg.trainer.num_cpus_per_worker, num_gpus=gpu)
            for r in plan.trainer]


def engine_host_options(placement, engine) -> dict:
    """An engine's host actor sits on its first bundle and reserves nothing: the engine process uses the bundle's
    devices through CUDA_VISIBLE_DEVICES, and in colocated placement the trainer rank holds the bundle's GPU."""
    return placement.actor_options(engine.bundles[0], num_cpus=0)


def start_components(cfg: SluiceConfig, plan: RunPlan, placement, model_path: str, run_dir: Path,
                     stack: contextlib.ExitStack, clock=lambda phase, detail: None):
    from launch.cluster import check_paths

    check_paths(placement, {"the model directory": model_path})
    from glue.engine_client import EngineClient
    from glue.fleet import RolloutFleet
    from glue.reward_shaping import make_reward_shaping
    from glue.rollout import RolloutManager, resume_limit
    from glue.routed_experts import RoutedExpertsLayout
    from glue.trainer.group import TrainerGroup
    import weight_sync

    # Every engine and the router ask for keys (SGLang's --api-key / --admin-api-key, new per run unless set under
    # sglang:): weight, memory and pause routes take the admin key only, which no one outside this run holds.
    api_key = cfg.sglang.get("api_key") or secrets.token_hex(24)
    admin_api_key = cfg.sglang.get("admin_api_key") or secrets.token_hex(24)
    fleet = RolloutFleet(model_path=model_path, num_engines=cfg.rollout.num_engines,
                         router_policy=cfg.rollout.router_policy,
                         engine_startup_timeout_s=cfg.rollout.engine_startup_timeout_s, log_dir=run_dir / "logs",
                         engine_command=plan.engine_command, engine_args=plan.engine_args,
                         router_args=plan.router_args, engine_env=[placement.engine_env(e) for e in plan.engines],
                         engine_hosts=[engine_host_options(placement, e) for e in plan.engines],
                         api_key=api_key, admin_api_key=admin_api_key,
                         engine_bind="127.0.0.1" if cfg.cluster.num_nodes == 1 else None)  # one node: loopback only
    stack.callback(fleet.stop)
    fleet.start(on_phase=clock)
    trainer = TrainerGroup(model_path, cfg.trainer, cfg.loss, actor_options=trainer_actor_options(cfg, plan, placement),
                           keep_versions=cfg.sync.max_staleness + 1)
    stack.callback(trainer.shutdown)
    t = cfg.trainer
    clock("trainer", f"{t.world_size} megatron-core ranks (TP {t.tensor_model_parallel_size} x PP "
                     f"{t.pipeline_model_parallel_size} x EP {t.expert_model_parallel_size} x DP "
                     f"{t.data_parallel_size}) hold the policy")
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    # the serving engines: a replacement joins (for direct R3 requests and pauses) once it holds the fleet's weights
    client = EngineClient(fleet.router_url, fleet.serving_urls, api_key=api_key, admin_api_key=admin_api_key)
    stack.callback(lambda: loop.run_until_complete(client.close()))
    bridge = weight_sync.make_bridge(cfg.sync, source=trainer, engine_urls=fleet.engine_urls,
                                     disk_dir=str(run_dir / "weights"),
                                     engine_tp_size=cfg.cluster.engine_tensor_parallel_size,
                                     api_key=api_key, admin_api_key=admin_api_key)
    stack.callback(bridge.close)
    where = "" if getattr(bridge.transport, "address", None) is None else \
        ": weight group hosted by trainer rank 0 at {}:{}".format(*bridge.transport.address)
    clock("weights", f"{cfg.sync.transport} bridge to {cfg.rollout.num_engines} engines{where}")
    manager = RolloutManager(function_path=cfg.rollout.function, task_path=cfg.rollout.task,
                             task_args=task_args_for(cfg.rollout.task, cfg.rollout.task_args, model_path),
                             client=client,
                             sampling_params=cfg.rollout.sampling.to_sglang(),
                             prompts_per_step=cfg.rollout.prompts_per_step,
                             samples_per_prompt=cfg.rollout.samples_per_prompt, seed=cfg.run.seed,
                             partial_rollouts=cfg.sync.partial_rollouts,
                             max_resumes=resume_limit(cfg.sync.max_staleness),
                             group_timeout_s=cfg.rollout.group_timeout_s, deterministic=cfg.run.deterministic,
                             error_masking=cfg.rollout.error_masking,
                             routed_experts=RoutedExpertsLayout.from_model_dir(model_path)
                             if cfg.rollout.return_routed_experts else None,
                             reward_shaping=make_reward_shaping(
                                 overlong_buffer=cfg.reward.overlong_buffer,
                                 overlong_penalty=cfg.reward.overlong_penalty,
                                 max_len=cfg.reward.max_len(cfg.rollout.sampling.max_new_tokens)))
    return fleet, client, trainer, bridge, manager, loop

