"""The teacher of on-policy distillation (`teacher:` section, glue.rewards.teacher), brought up beside the policy's fleet:
its checkpoint (a directory, or written by `teacher.build`), its own engines on its own bundles behind its own
sgl-router (launch.run.fleets: the policy's engine program and pass-through flags, its own TP, fresh keys, no weight
bridge: its weights never change), and the rollout manager wrapped so the teacher scores every finished group.
Stopped with the run's ExitStack."""
from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

from glue.rewards.teacher import TeacherScorer, TeacherScoringManager, build_teacher_model, load_build_hook
from launch.config import ConfigError, SluiceConfig
from launch.plan.run_plan import RunPlan
from launch.run.fleets import SideFleetRun, start_side_fleet


def check_teacher(cfg: SluiceConfig) -> str:
    """Preflight (launch.run.preflight, before anything starts): `teacher.path` holds a checkpoint with the policy's
    vocabulary when both are on disk, or `teacher.build` imports with the right signature."""
    import json

    t = cfg.teacher
    if t.build is not None:
        try:
            load_build_hook(t.build)
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None
        return f"teacher: {t.build} builds it at start-up"
    config = Path(t.path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"teacher.path={t.path!r} holds no config.json; point it at the teacher's HF checkpoint")
    vocab = json.loads(config.read_text()).get("vocab_size")
    policy = Path(cfg.model.path) / "config.json" if cfg.model.path else None
    policy_vocab = json.loads(policy.read_text()).get("vocab_size") if policy and policy.is_file() else \
        cfg.model.tiny.vocab_size if cfg.model.path is None else None
    if policy_vocab is not None and vocab != policy_vocab:
        raise ConfigError(f"teacher.path={t.path!r} has vocab_size {vocab}, the policy {policy_vocab}: the teacher "
                          "scores the student's token ids, so both need one tokenizer")
    return f"teacher: {t.path} (vocab_size {vocab})"


def teacher_model(cfg: SluiceConfig, policy_dir: str, run_dir: Path) -> str:
    """The teacher's checkpoint directory (absolute): `teacher.path`, or what `teacher.build` writes into
    <run dir>/teacher_model."""
    t = cfg.teacher
    if t.path is not None:
        if not (Path(t.path) / "config.json").is_file():
            raise ConfigError(f"teacher.path={t.path!r} holds no config.json; point it at the teacher's HF checkpoint")
        return str(Path(t.path).resolve())
    return str(Path(build_teacher_model(t.build, str(run_dir / "teacher_model"), policy_dir)).resolve())


def start_teacher(cfg: SluiceConfig, plan: RunPlan, placement, manager, policy_dir: str, run_dir: Path,
                  stack: contextlib.ExitStack, loop, clock=lambda phase, detail: None,
                  started: list[SideFleetRun] | None = None):
    """Start the teacher's fleet on its bundles (appended to `started`, for the watch) and return `manager` wrapped in
    a `glue.rewards.teacher.TeacherScoringManager`."""
    model = teacher_model(cfg, policy_dir, run_dir)
    side = start_side_fleet(cfg, plan, placement, "teacher", model_path=model, run_dir=run_dir, stack=stack, loop=loop,
                            api_key=secrets.token_hex(24), admin_api_key=secrets.token_hex(24),
                            startup_timeout_s=cfg.teacher.startup_timeout_s, router_args=plan.router_args,
                            started=[] if started is None else started,
                            on_phase=lambda phase, detail: clock(f"teacher {phase}", detail))
    clock("teacher", f"{model} scores every sample's tokens ({cfg.teacher.objective}, kl_coef {cfg.teacher.kl_coef:g})")
    return TeacherScoringManager(manager, TeacherScorer(side.client))
