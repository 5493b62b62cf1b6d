"""Start-up of the run's reward models (`judge:`, `reward_model:`): their checkpoints (a tiny random one written
into the run folder when no path is given), the judge's own fleet of engines on its own bundles behind its own
sgl-router (launch.run.fleets), the scalar reward model's worker, and the group hook (glue.rewards.models.ModelRewards)
the rollout manager awaits."""
from __future__ import annotations

import contextlib
import secrets
from dataclasses import asdict
from pathlib import Path

from glue.rewards.judge import Judge, load_parser, save_tiny_judge_model
from glue.rewards.models import ModelRewards
from glue.rewards.scalar_rm import ScalarRewardModel, save_tiny_reward_model
from launch.config import ModelConfig, SluiceConfig
from launch.plan.run_plan import RunPlan
from launch.run.fleets import SideFleetRun, start_side_fleet


def checkpoint_dir(model: ModelConfig, out: Path, save) -> str:
    """`model.path` as an absolute path, or a tiny random model written by `save(out, **tiny)` (once: a run that
    resumes finds it there)."""
    if model.path is not None:
        return str(Path(model.path).resolve())
    tiny = asdict(model.tiny)
    tiny.pop("tokenizer")
    if not (out / "config.json").exists():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        save(str(out), **tiny)
    return str(out.resolve())


def start_model_rewards(cfg: SluiceConfig, plan: RunPlan, placement, policy_path: str, run_dir: Path,
                        stack: contextlib.ExitStack, loop, clock=lambda phase, detail: None,
                        started: list[SideFleetRun] | None = None):
    """The group hook for the rollout manager, or None when the run has neither a judge nor a reward model. The
    judge's fleet is appended to `started` (for the watch)."""
    if cfg.judge is None and cfg.reward_model is None:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(policy_path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"judge: / reward_model: read the policy's responses as text, but the policy at "
                         f"{policy_path} has no tokenizer ({type(err).__name__}); use a model with one (e.g. "
                         "model.tiny.tokenizer: true)") from None
    scorers = []
    if cfg.judge is not None:
        scorers.append(start_judge(cfg, plan, placement, run_dir, stack, loop, clock,
                                   started=[] if started is None else started))
    if cfg.reward_model is not None:
        scorers.append(start_scalar_rm(cfg, run_dir, stack, loop, clock))
    rewards = ModelRewards(scorers=scorers, tokenizer=tokenizer, task_weight=cfg.reward.task_weight)
    stack.callback(lambda: loop.run_until_complete(rewards.aclose()))
    return rewards


def start_judge(cfg: SluiceConfig, plan: RunPlan, placement, run_dir: Path, stack: contextlib.ExitStack, loop, clock,
                started: list[SideFleetRun] | None = None):
    """The judge's engines on their own bundles and its router (launch.run.fleets.start_side_fleet: the policy's engine
    program and pass-through options, its own TP), and a `glue.rewards.judge.Judge` reaching them through an
    `EngineClient`."""
    from transformers import AutoTokenizer

    j = cfg.judge
    parser = load_parser(j.parser)  # a typo fails here, before any engine starts
    path = checkpoint_dir(j.model, run_dir / "judge_model", save_tiny_judge_model)
    side = start_side_fleet(cfg, plan, placement, "judge", model_path=path, run_dir=run_dir, stack=stack, loop=loop,
                            api_key=secrets.token_hex(24), admin_api_key=secrets.token_hex(24),
                            startup_timeout_s=cfg.rollout.engine_startup_timeout_s,
                            router_args=["--log-level", "warn"], started=[] if started is None else started)
    clock("judge", f"{j.num_engines} judge engines ({path}) behind sgl-router at {side.fleet.router_url}, "
                   f"parser {j.parser}")
    return Judge(client=side.client, tokenizer=AutoTokenizer.from_pretrained(path, local_files_only=True), parser=parser,
                 prompt_template=j.prompt_template, sampling_params=j.sampling_params(), timeout_s=j.timeout_s,
                 max_concurrency=j.max_concurrency, apply_chat_template=j.apply_chat_template, weight=j.weight,
                 on_failure=j.on_failure)


def start_scalar_rm(cfg: SluiceConfig, run_dir: Path, stack: contextlib.ExitStack, loop, clock):
    r = cfg.reward_model
    path = checkpoint_dir(r.model, run_dir / "reward_model", save_tiny_reward_model)
    rm = ScalarRewardModel(path=path, batch_size=r.batch_size, max_length=r.max_length, timeout_s=r.timeout_s,
                           apply_chat_template=r.apply_chat_template, weight=r.weight, on_failure=r.on_failure)
    clock("reward_model", f"{path} scores up to {r.batch_size} responses per forward")
    return rm
