"""Bring a run up and down: plan, run directory, model, Ray + placement group, fleet + router, trainer, weight
bridge, then the loop.

Everything started here is stopped here (ExitStack), on success, on error, on Ctrl-C and SIGTERM
(launch.run.stopping: the first signal stops after the step in progress, waiting for it at most run.stop_grace_s, a
second at once).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import threading
from pathlib import Path

from glue.fleet.fleet import ProcessDied
from glue.fleet.repairs import engine_repair, fleet_repair
from glue.fleet.watch import FleetWatch
from glue.loop.batch import build_train_batch, distillation_batch_builder
from glue.loop.buffer import RolloutBuffer
from glue.loop.checkpoint import Checkpoints
from glue.loop.controller import LoopHooks, LoopParts, no_evaluation, run_loop, sync_weights
from glue.loop.cut import never
from glue.loop.evaluation import Evaluator
from glue.loop.replay import NoFleet, ReplayStream, SavingStream, check_replay_source
from glue.loop.staleness import StalenessGate
from glue.loop.stall import StallWarnings
from glue.loop.stream import RolloutStream
from glue.metrics.logger import learning_summary, open_run_logger, read_metrics, run_info
from glue.rewards.models import reward_model_metrics
from glue.rollout.manager import build_task
from launch.config import ConfigError, SluiceConfig, to_dict, write_resolved
from launch.plan.run_plan import RunPlan, resolve
from launch.run.cluster import describe_placement, start_cluster
from launch.run.components import make_phases, start_components
from launch.run.folder import export_final_policy, find_checkpoint, plot_run, prepare_model
from launch.run.folder_lock import RunFolderLock
from launch.run.preflight import preflight
from launch.run.startup import StartupClock
from launch.run.stopping import StopSignals, cancel_tasks
from launch.run.tasks import eval_task, task_args_for, task_metrics
from launch.run.trainer_restart import TrainerRestarts
from launch.run.user_code import record_code


def run(cfg: SluiceConfig) -> Path:
    """Run `cfg` to completion; returns the run directory (metrics.jsonl, config.yaml, logs/, checkpoints/, hf/)."""
    cfg, plan = resolve(cfg)
    if plan.notes:
        raise ConfigError("this build cannot run the plan: " + "; ".join(plan.notes))
    if cfg.run.mode == "sft":
        raise ConfigError("run.mode sft runs through `sluice` (launch.cli.start) or launch.run.sft.run_sft, not the RL runner")
    preflight(cfg, plan)
    check_replay(cfg)
    with RunFolderLock(cfg.run_dir):  # one run per folder, for the run's whole life (launch.run.folder_lock)
        return run_in_folder(cfg, plan)


def run_in_folder(cfg: SluiceConfig, plan: RunPlan) -> Path:
    """`run`, once the run holds its folder: the checkpoint to continue, start-up, the loop, the clean-up."""
    run_dir = cfg.run_dir
    resume_from = find_checkpoint(cfg)
    clock = StartupClock()
    model_path = prepare_model(cfg, run_dir)
    clock("model", f"{model_path}" + (" (a tiny random model)" if cfg.model.path is None else ""))
    with contextlib.ExitStack() as stack:
        placement = start_cluster(cfg, plan, stack, clock)
        clock("placement", describe_placement(plan, placement))
        # after ray.init, which sets a SIGTERM handler of its own
        stop = stack.enter_context(StopSignals(cfg.run.stop_grace_s))
        side_fleets = []  # the teacher's and the judge's, started beside the policy's
        fleet, client, trainer, bridge, manager, loop = start_components(cfg, plan, placement, model_path, run_dir,
                                                                         stack, clock, side_fleets=side_fleets)
        colocation = make_phases(cfg, plan, trainer=trainer, bridge=bridge, fleet=fleet)
        # Start-up succeeded: only now does a previous run's record give way to this one (or get cut back to the
        # checkpoint this run continues from).
        resume_state = restore(cfg, resume_from, trainer=trainer, client=client, colocation=colocation)
        write_resolved(cfg, run_dir / "config.yaml")
        clock.finished(f"{what_runs(cfg)}, metrics in {run_dir / 'metrics.jsonl'}")
        if cfg.run.debug != "train_only":
            print(f"sluice: {group_limits(cfg)}", flush=True)
        progress = stack.enter_context(_progress_bar(cfg))
        watch = fleet_watch(cfg, plan, fleet=fleet, bridge=bridge, client=client, side_fleets=side_fleets,
                            stop_for_fault=stop.for_fault)
        evaluator = make_evaluator(cfg, fn=getattr(manager, "fn", None), client=client, model_path=model_path,
                                   slime=getattr(manager, "slime", None))
        restarts = trainer_restarts(cfg, plan, placement, trainer=trainer, bridge=bridge, watch=watch,
                                    colocation=colocation, started_from=resume_from)
        training = loop.create_task(train_with_restarts(cfg, restarts=restarts, manager=manager, trainer=trainer,
                                                        client=client, colocation=colocation, run_dir=run_dir,
                                                        progress=progress, stop=stop, stop_grace_over=stop.grace_over,
                                                        resume_state=resume_state, watch=watch, evaluator=evaluator))
        stop.armed = True
        try:
            last_step = loop.run_until_complete(training)
        except KeyboardInterrupt:  # let the loop cancel what is generating before the stack stops the processes
            stop.stopping = True
            cancel_tasks(loop)  # every task, not only `training`: the signal may land between them
            raise
        finally:
            stop.stopping = True
    latest = Checkpoints(run_dir / "checkpoints").latest()
    summary = f"{learning_summary(read_metrics(run_dir / 'metrics.jsonl'))}; metrics in {run_dir / 'metrics.jsonl'}"
    summary += plot_run(run_dir)
    if stop.fault is not None:  # the stop a fault asked: its checkpoint is written, the run ends with the fault
        raise ProcessDied(f"{stop.fault}; the run stopped at step {last_step} of {cfg.run.num_steps} with its "
                          f"checkpoint {latest}")
    if stop.requested:
        print(f"sluice: stopped at step {last_step} of {cfg.run.num_steps} on {stop.requested}; every process it "
              f"started is stopped; checkpoint {latest}; the same command resumes it (run.resume=auto); {summary}",
              flush=True)
        return run_dir
    if latest is not None:  # the final policy as a plain HF checkpoint (AutoModelForCausalLM.from_pretrained)
        export_final_policy(latest, run_dir / "hf")
    final = f"; final policy in {run_dir / 'hf'}" if latest is not None else ""  # rollout_only: no trainer
    if latest is not None and (saved := Checkpoints.read_state(latest)["step"]) != last_step:  # the last write failed
        final = f"; the policy of step {saved}, the last checkpoint written, in {run_dir / 'hf'}"
    print(f"sluice: run finished; {summary}{final}", flush=True)
    return run_dir


def group_limits(cfg: SluiceConfig) -> str:
    """The start-up line on how long a group may take: its timeout and when a waiting step speaks."""
    r = cfg.rollout
    limit = ("no group timeout (rollout.group_timeout_s: null): a hung group stalls its step until stopped"
             if r.group_timeout_s is None else
             f"a group still generating after rollout.group_timeout_s={r.group_timeout_s:g} s is cut and counted "
             "failed")
    return (f"{limit}; a step waiting longer than rollout.stall_warning_s={r.stall_warning_s:g} s on groups says so; "
            f"Ctrl-C waits run.stop_grace_s={cfg.run.stop_grace_s:g} s for the step in progress")


def what_runs(cfg: SluiceConfig) -> str:
    """E.g. `training 30 steps (sync)`, and what a run.debug run leaves out."""
    steps = f"{cfg.run.num_steps} steps ({cfg.run.mode})"
    return {"off": f"training {steps}",
            "rollout_only": f"generating {steps} with no trainer (run.debug rollout_only), saved in "
                            f"{cfg.run_dir / 'rollouts'}",
            "train_only": f"training {steps} on the rollouts saved in {cfg.run.replay_from}, with no engines "
                          "(run.debug train_only)"}[cfg.run.debug]


def check_replay(cfg: SluiceConfig) -> None:
    """A train_only run's `run.replay_from` holds the saved groups of every step it trains (checked before anything
    starts) and is another folder than its own."""
    if cfg.run.debug != "train_only":
        return
    if Path(cfg.run.replay_from).resolve() == cfg.run_dir.resolve():
        raise ConfigError(f"run.replay_from={cfg.run.replay_from!r} is this run's own folder; give the replay another "
                          "run.name=...")
    try:
        check_replay_source(cfg.run.replay_from, range(1, cfg.run.num_steps + 1))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def restore(cfg: SluiceConfig, checkpoint: Path | None, *, trainer, client, colocation) -> dict | None:
    """After start-up: load `checkpoint` into the trainer, bring the engines to its weights and cut metrics.jsonl
    back to its step (returns its driver state); or, starting fresh, clear what a previous run left."""
    run_dir, metrics = cfg.run_dir, cfg.run_dir / "metrics.jsonl"
    if checkpoint is None:
        metrics.unlink(missing_ok=True)
        shutil.rmtree(run_dir / "rollouts", ignore_errors=True)  # run.save_rollouts writes them afresh
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


def trainer_restarts(cfg: SluiceConfig, plan: RunPlan, placement, *, trainer, bridge, watch, colocation,
                     started_from: Path | None) -> TrainerRestarts | None:
    """What repairs a trainer rank that dies (launch.run.trainer_restart), or None where there is none to repair
    (a run.debug run: no trainer, or no engines to resync)."""
    if cfg.run.debug != "off":
        return None
    return TrainerRestarts(
        trainer=trainer, bridge=bridge, fleet=watch, colocation=colocation,
        nodes=[placement.node_ip[rank.bundle] for rank in plan.trainer],
        restore=lambda checkpoint: restore(cfg, checkpoint, trainer=trainer, client=watch, colocation=colocation),
        checkpoints=Checkpoints(cfg.run_dir / "checkpoints"), started_from=started_from,
        max_restarts=cfg.run.max_restarts, pause_mode=cfg.sync.pause_mode,
        start_timeout_s=cfg.cluster.placement_timeout_s or None)


async def train_with_restarts(cfg: SluiceConfig, *, restarts: TrainerRestarts | None, resume_state: dict | None,
                              progress, stop=lambda: False, **parts) -> int:
    """`run_training`; when it fails because a trainer rank died, the trainer group is restarted from the newest
    checkpoint and training goes on from that checkpoint's state, as a resumed run would (`restarts`; None: the
    failure ends the run)."""
    while True:
        try:
            return await run_training(cfg, resume_state=resume_state, progress=progress, stop=stop,
                                      restarts=restarts, **parts)
        except Exception:
            death = None if restarts is None or stop() else await asyncio.to_thread(restarts.died)
            if death is None:
                raise
            resume_state = await asyncio.to_thread(restarts.restart, death)
            progress.reset()


async def run_training(cfg: SluiceConfig, *, manager, trainer, client, colocation, run_dir: Path, progress, watch,
                       stop=lambda: False, stop_grace_over=never, resume_state: dict | None = None,
                       evaluator=None, restarts: TrainerRestarts | None = None) -> int:
    """The loop with its staleness gate, buffer and rollout stream built from the config."""
    groups_per_step = cfg.rollout.prompts_per_step
    gate = StalenessGate(groups_per_step=groups_per_step, max_staleness=cfg.sync.max_staleness,
                         interval=cfg.sync.interval, admission=cfg.sync.admission)
    debug = cfg.run.debug
    # rollout_only: the engines keep the initial weights, so every sample is "stale" against the stand-in trainer's
    # step count; it is saved whole either way
    buffer = RolloutBuffer(groups_per_step=groups_per_step,
                           order="group_id" if cfg.run.deterministic else cfg.rollout.buffer_order,
                           stale_policy="keep" if debug == "rollout_only" else cfg.sync.stale_policy)
    stream = ReplayStream(cfg.run.replay_from, gate=gate) if debug == "train_only" else RolloutStream(
        manager=manager, gate=gate, buffer=buffer, max_groups=cfg.run.num_steps * groups_per_step,
        max_concurrent=cfg.rollout.max_concurrent_groups, max_failed_frac=cfg.rollout.max_failed_frac,
        drain_before_sync=cfg.run.deterministic, dynamic_sampling=cfg.rollout.dynamic_sampling,
        max_filtered_frac=cfg.rollout.max_filtered_frac, stalls=StallWarnings(
            after_s=cfg.rollout.stall_warning_s, group_timeout_s=cfg.rollout.group_timeout_s,
            source=f"rollout function {cfg.rollout.function!r}, task {cfg.rollout.task!r}",
            echo=lambda line: progress.write(line, file=sys.stderr)))

    first_step = 1
    if resume_state is not None:
        stream.resume(resume_state, version=resume_state["version"],
                      trained_groups=resume_state["step"] * groups_per_step)
        first_step = resume_state["step"] + 1
        progress.update(resume_state["step"])
    if cfg.run.saves_rollouts:
        stream = SavingStream(stream, run_dir, first_step=first_step)
    resume_step = None if resume_state is None else resume_state["step"]
    logger = open_run_logger(run_dir, loggers=cfg.run.loggers, info=run_info(to_dict(cfg), resume_step=resume_step,
                                                                            code=record_code(cfg, run_dir)),
                             resume_step=resume_step, wandb=to_dict(cfg.run.wandb))

    def on_step(record: dict) -> None:
        if "fault/trainer_recovery_s" in record:
            progress.write(f"sluice: step {record['step']} completed {record['fault/trainer_recovery_s']:.1f} s after "
                           "the trainer rank's death was seen", file=sys.stdout)
        progress.update(1)
        progress.set_postfix(reward=f"{record['rollout/reward_mean']:.3f}", loss=f"{record.get('train/loss', 0):.3f}",
                             stale=f"{record['staleness/max']:.0f}")

    checkpoints = Checkpoints(run_dir / "checkpoints", keep=cfg.run.keep_checkpoints,
                              interval=cfg.run.save_interval, interval_s=cfg.run.save_interval_s,
                              max_failures=cfg.run.max_checkpoint_failures) if debug != "rollout_only" else None
    hooks = LoopHooks(
        on_step=on_step, stop=stop, stop_grace_over=stop_grace_over,
        # rollout_only: nothing to move, the engines keep the weights they started with
        sync_guard=watch.guarded_sync if debug != "rollout_only" else lambda sync: None,
        train_guard=watch.guarded_train,
        extra_metrics=lambda: {**watch.metrics(), **(restarts.metrics() if restarts is not None else {}),
                               **task_metrics(getattr(manager, "task", None)),
                               **reward_model_metrics(manager), **(checkpoints.metrics() if checkpoints else {})},
        evaluate=evaluator.evaluate if evaluator is not None else no_evaluation,
        build_batch=distillation_batch_builder(cfg.teacher) if cfg.teacher is not None else build_train_batch)
    parts = LoopParts(stream=stream, trainer=trainer, fleet=watch, phases=colocation, logger=logger,
                      checkpoints=checkpoints, hooks=hooks)
    training = asyncio.ensure_future(run_loop(parts, num_steps=cfg.run.num_steps, loss_cfg=cfg.loss,
                                              pause_mode=cfg.sync.pause_mode, first_step=first_step))
    try:
        return await watch.run(training, stopping=stop)
    finally:
        logger.close()


def make_evaluator(cfg: SluiceConfig, *, fn, client, model_path: str, slime=None):
    """The held-out evaluation (glue.loop.evaluation) the loop runs every `eval.interval` steps, or None when off."""
    if not cfg.eval.enabled:
        return None
    path, args = eval_task(cfg)
    e = cfg.eval
    return Evaluator(fn=fn, task=build_task(path, task_args_for(path, args, model_path)), client=client,
                     sampling_params=e.sampling.to_sglang(cfg.rollout.sampling.to_sglang()), interval=e.interval,
                     at_start=e.at_start, seed=e.seed, num_prompts=e.num_prompts,
                     samples_per_prompt=e.samples_per_prompt, ks=e.pass_at_k, threshold=e.pass_threshold,
                     group_timeout_s=cfg.rollout.group_timeout_s, slime=slime,
                     reward_fn=slime.reward if slime is not None and slime.reward_fn is not None else None)


def fleet_watch(cfg: SluiceConfig, plan: RunPlan, *, fleet, bridge, client, side_fleets=(), stop_for_fault=None):
    """The watch that keeps engines serving (glue.fleet.watch): a dead or hung engine is replaced and brought to
    the current weights before the router sends it work. Colocated placement ends the run instead (a new engine
    there would have to take its devices back from the trainer mid-step). The fleets beside the policy's
    (`side_fleets`, launch.run.fleets.SideFleetRun: teacher, judge) are watched with it, by the same class, and an
    engine of theirs is replaced on its own bundles (their weights never change, whatever the placement). An
    engine with no room left to start again on asks `stop_for_fault(line)`: the run stops with its checkpoint."""
    if fleet is None:  # run.debug train_only
        return NoFleet()
    r = cfg.rollout
    limits = dict(max_restarts=r.max_engine_restarts, max_router_restarts=r.max_router_restarts,
                  health_interval_s=r.health_check_interval_s, health_timeout_s=r.health_check_timeout_s)
    turn = threading.Lock()  # train steps and a repair's weight gathering (trainer collectives) take turns
    repair = None if plan.placement == "colocated" or bridge is None else engine_repair(
        fleet, bridge, trainer_turn=turn, client=client, pause_mode=cfg.sync.pause_mode)
    beside = [FleetWatch(side.fleet, repair=fleet_repair(side.fleet), client=side.client, **limits)
              for side in side_fleets]
    return FleetWatch(fleet, repair=repair, client=client, trainer_turn=turn, beside=beside,
                      stop_for_fault=stop_for_fault, **limits)


def _progress_bar(cfg: SluiceConfig):
    from tqdm import tqdm

    return tqdm(total=cfg.run.num_steps, desc=f"sluice {cfg.run.name} ({cfg.run.mode})", unit="step",
                file=sys.stdout, dynamic_ncols=True)
