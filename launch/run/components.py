"""The run's parts, started by `launch.run.runner` under its ExitStack: engines behind the router and their client,
the megatron-core trainer on Ray, the weight bridge, the rollout manager, and who holds the devices in each phase.
`run.debug` leaves a side out (glue.loop.replay stands in for it)."""
from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path

from glue.fleet.engine_client import EngineClient
from glue.fleet.fleet import RolloutFleet
from glue.loop.colocation import Disaggregated, make_colocation
from glue.loop.replay import NoTrainer
from glue.rewards.shaping import make_reward_shaping
from glue.rollout.errors import ROLLOUT_ERRORS_LOG, RolloutErrors
from glue.rollout.manager import RolloutManager, resume_limit
from glue.rollout.routed_experts import RoutedExpertsLayout
from glue.rollout.slime.adapter import SlimeFunctions
from glue.trainer.group import TrainerGroup
from glue.trainer.reference import check_same_shapes, resolve_ref_load
from launch.config import SluiceConfig
from launch.plan.ipc_sources import plan_sources, slot_sources
from launch.plan.run_plan import RunPlan
from launch.run.cluster import check_paths
from launch.run.fleets import (SideFleetRun, check_whole_nodes, engine_env, engine_host_options,
                               node_rank_options, planned_devices_env)
from launch.run.reward_models import start_model_rewards
from launch.run.stopping import close_loop
from launch.run.tasks import task_args_for
from launch.run.teacher import start_teacher
from launch.slime.namespace import run_values, tokens_per_gpu
import weight_sync


def make_phases(cfg: SluiceConfig, plan: RunPlan, *, trainer, bridge, fleet):
    """Who holds the devices around each phase (glue.loop.colocation). A run.debug run moves no weights: its engines or
    its trainer, whichever it has, stay resident."""
    if cfg.run.debug != "off":
        return Disaggregated(bridge=None)
    return make_colocation(plan.placement, trainer=trainer, bridge=bridge, engine_urls=fleet.engine_urls,
                           timeout_s=cfg.sync.timeout_s, api_key=fleet.api_key, admin_api_key=fleet.admin_api_key)


def trainer_actor_options(cfg: SluiceConfig, plan: RunPlan, placement) -> list[dict]:
    """Each trainer rank pinned to its bundle: a whole GPU on GPU, `trainer.num_cpus_per_worker` CPUs on CPU; with
    modeled devices, the device its bundle stands for (`planned_devices_env`)."""
    gpu = 1 if plan.device == "gpu" else 0
    options = [placement.actor_options(r.bundle, num_cpus=0 if gpu else cfg.trainer.num_cpus_per_worker, num_gpus=gpu)
               for r in plan.trainer]
    if plan.models_devices:
        for rank, option in zip(plan.trainer, options):
            option["runtime_env"] = {"env_vars": planned_devices_env(plan, [rank.bundle])}
    return options


def start_components(cfg: SluiceConfig, plan: RunPlan, placement, model_path: str, run_dir: Path,
                     stack: contextlib.ExitStack, clock=lambda phase, detail: None,
                     side_fleets: list[SideFleetRun] | None = None):
    """Fleet, engine client, trainer, weight bridge, rollout manager and the event loop. `run.debug` leaves one
    side out: train_only starts no engines (fleet, client, bridge and manager are None), rollout_only no trainer
    and no bridge (glue.loop.replay.NoTrainer stands in for the trainer). The fleets beside the policy's (teacher,
    judge) are appended to `side_fleets`, for the watch."""
    side_fleets = [] if side_fleets is None else side_fleets
    check_paths(placement, {"the model directory": model_path, **reference_paths(cfg, model_path)})
    loop = asyncio.new_event_loop()
    stack.callback(close_loop, loop)  # its pending tasks cancelled first: no asyncio noise on any exit
    fleet = client = bridge = manager = None
    if cfg.run.debug != "train_only":
        fleet, client = start_fleet(cfg, plan, placement, model_path, run_dir, stack, loop, clock)
    trainer = start_trainer(cfg, plan, placement, model_path, stack, clock) if cfg.run.debug != "rollout_only" \
        else NoTrainer()
    if cfg.run.debug == "off":
        bridge = start_bridge(cfg, plan, trainer, fleet, run_dir, stack, clock)
    if fleet is not None:
        manager = make_manager(cfg, client, model_path, start_model_rewards(
            cfg, plan, placement, model_path, run_dir, stack, loop, clock, started=side_fleets))
        if manager.slime is not None:  # before the fleet stops: a slime rollout call in progress may finish
            stack.callback(manager.slime.close)
    if fleet is not None and cfg.teacher is not None:  # on-policy distillation: the teacher scores every group
        manager = start_teacher(cfg, plan, placement, manager, model_path, run_dir, stack, loop, clock,
                                started=side_fleets)
    return fleet, client, trainer, bridge, manager, loop


def reference_paths(cfg: SluiceConfig, model_path: str) -> dict[str, str]:
    """`trainer.ref_load` when the KL term reads it, checked here (one line, before any actor starts) for every node
    to see."""
    if cfg.trainer.ref_load is None or not cfg.loss.kl_loss_coef > 0:
        return {}
    ref = resolve_ref_load(cfg.trainer.ref_load)
    check_same_shapes(ref, model_path)
    return {"trainer.ref_load": ref.path}


def start_fleet(cfg: SluiceConfig, plan: RunPlan, placement, model_path: str, run_dir: Path,
                stack: contextlib.ExitStack, loop, clock):
    """The engines behind the router, and the client the rollout functions reach them with."""
    # Every engine and the router ask for keys (SGLang's --api-key / --admin-api-key, new per run unless set under
    # sglang:): weight, memory and pause routes take the admin key only, which no one outside this run holds.
    check_whole_nodes(placement, plan.engines)
    api_key = cfg.sglang.get("api_key") or secrets.token_hex(24)
    admin_api_key = cfg.sglang.get("admin_api_key") or secrets.token_hex(24)
    fleet = RolloutFleet(model_path=model_path, num_engines=cfg.rollout.num_engines,
                         router_policy=cfg.rollout.router_policy,
                         engine_startup_timeout_s=cfg.rollout.engine_startup_timeout_s, log_dir=run_dir / "logs",
                         engine_command=plan.engine_command, engine_args=plan.engine_args, seed=plan.engine_seed,
                         router_args=plan.router_args,
                         engine_env=[engine_env(plan, placement, e) for e in plan.engines],
                         engine_hosts=[engine_host_options(placement, e) for e in plan.engines],
                         **node_rank_options(placement, plan.engines, plan.engine_nodes),
                         api_key=api_key, admin_api_key=admin_api_key,
                         engine_bind="127.0.0.1" if cfg.cluster.num_nodes == 1 else None,  # one node: loopback only
                         placement_timeout_s=cfg.cluster.placement_timeout_s or None)  # 0: as long as it takes
    stack.callback(fleet.stop)
    fleet.start(on_phase=clock)
    # the serving engines: a replacement joins (for direct R3 requests and pauses) once it holds the fleet's weights
    client = EngineClient(fleet.router_url, fleet.serving_urls, api_key=api_key, admin_api_key=admin_api_key)
    stack.callback(lambda: loop.run_until_complete(client.close()))
    return fleet, client


def start_trainer(cfg: SluiceConfig, plan: RunPlan, placement, model_path: str, stack: contextlib.ExitStack, clock):
    trainer = TrainerGroup(model_path, cfg.trainer, cfg.loss, actor_options=trainer_actor_options(cfg, plan, placement),
                           keep_versions=cfg.sync.max_staleness + 1, log_dir=trainer_log_dir(cfg),
                           placement_timeout_s=cfg.cluster.placement_timeout_s or None)
    stack.callback(trainer.shutdown)
    t = cfg.trainer
    clock("trainer", f"{t.world_size} megatron-core ranks (TP {t.tensor_model_parallel_size} x PP "
                     f"{t.pipeline_model_parallel_size} x EP {t.expert_model_parallel_size} x DP "
                     f"{t.data_parallel_size}) hold the policy; {trainer.output_line()}")
    return trainer


def trainer_log_dir(cfg: SluiceConfig) -> Path:
    """The run's logs/ folder, made here so that every rank whose node sees it writes `trainer_<rank>.log` there."""
    logs = cfg.run_dir.resolve() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def start_bridge(cfg: SluiceConfig, plan: RunPlan, trainer, fleet, run_dir: Path, stack: contextlib.ExitStack,
                 clock):
    bridge = weight_sync.make_bridge(cfg.sync, source=trainer, engine_urls=fleet.engine_urls,
                                     disk_dir=str(run_dir / "weights"),
                                     engine_tp_size=cfg.cluster.engine_tensor_parallel_size,
                                     api_key=fleet.api_key, admin_api_key=fleet.admin_api_key,
                                     ipc_sources=slot_sources(plan_sources(plan), fleet.engine_urls))
    stack.callback(bridge.close)
    where = "" if getattr(bridge.transport, "address", None) is None else \
        ": weight group hosted by trainer rank 0 at {}:{}".format(*bridge.transport.address)
    clock("weights", f"{cfg.sync.transport} bridge to {cfg.rollout.num_engines} engines{where}")
    return bridge


def make_slime_functions(cfg: SluiceConfig, client, model_path: str):
    """rollout.slime's and reward.slime's functions (glue.rollout.slime.adapter), or None when neither is set."""
    if not cfg.rollout.slime.enabled and cfg.reward.slime.function is None:
        return None
    return SlimeFunctions(client=client, model_path=model_path, sampling_params=cfg.rollout.sampling.to_sglang(),
                          samples_per_prompt=cfg.rollout.samples_per_prompt,
                          prompts_per_step=cfg.rollout.prompts_per_step, seed=cfg.run.seed,
                          generate_function=cfg.rollout.slime.generate_function,
                          rollout_function=cfg.rollout.slime.rollout_function,
                          reward_function=cfg.reward.slime.function,
                          max_context_len=cfg.rollout.slime.max_context_len, rm_type=cfg.rollout.slime.rm_type,
                          context_parallel_size=cfg.trainer.context_parallel_size,
                          max_tokens_per_gpu=tokens_per_gpu(cfg.trainer.max_tokens_per_micro_batch),
                          run_values=run_values(cfg))


def make_manager(cfg: SluiceConfig, client, model_path: str, group_rewards=None):
    slime = make_slime_functions(cfg, client, model_path)
    return RolloutManager(slime=slime, reward_fn=slime.reward if slime is not None and slime.reward_fn else None,
                          function_path=cfg.rollout.function, task_path=cfg.rollout.task,
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
                              max_len=cfg.reward.max_len(cfg.rollout.sampling.max_new_tokens)),
                          group_rewards=group_rewards, reward_on_error=cfg.reward.on_error,
                          errors=RolloutErrors(cfg.run_dir / "logs" / ROLLOUT_ERRORS_LOG))
