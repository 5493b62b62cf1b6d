"""On-policy distillation on the driver's side: a teacher model served by its own fleet (engines behind its own
sgl-router, never synced) scores the response tokens of every finished group with SGLang's prompt-logprob request,
the scores ride on each `Sample` (`teacher_logprobs`) into the `TrainBatch`, and each step's advantages get the
per-token reverse KL to the teacher (loss.distill). The `teacher:` section is `TeacherConfig`; launch.teacher starts
the fleet. Imports no backend at import time."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

from glue.types import Group, Sample, SampleStatus

# `teacher.build`'s contract: write the teacher's HF checkpoint into out_dir, given the policy's checkpoint directory
BUILD_PARAMS = ["out_dir", "policy_dir"]


@dataclass(kw_only=True)
class TeacherConfig:
    """The `teacher:` section: who teaches, on how many engines, and how its signal enters the advantages."""

    path: str | None = None  # the teacher's HF checkpoint directory (same vocabulary as the policy)
    build: str | None = None  # instead of path: `pkg.module:function(out_dir, policy_dir)` writing the teacher's HF checkpoint at start-up (the demo's rollout_fns.echo_teacher:build_echo_teacher)
    num_engines: int = 1  # engines of the teacher's fleet, behind its own sgl-router (same engine program and --sglang-* flags as the policy's)
    kl_coef: float = 1.0  # each response token's advantage gets -kl_coef * (log pi_student - log pi_teacher) of that token
    objective: Literal["reverse_kl", "reverse_kl_plus_task"] = "reverse_kl"  # reverse_kl: the teacher's signal alone (the task reward is only logged); reverse_kl_plus_task: added to the task reward's advantage
    center: bool = True  # subtract the step's mean reverse-KL advantage over its trained tokens (a baseline; off, a student worse than the teacher everywhere pushes down every token it sampled: docs/distillation.md compares both)
    startup_timeout_s: float = 120  # how long the teacher's engines may take to serve /health

    def __post_init__(self) -> None:
        if (self.path is None) == (self.build is None):
            raise ValueError("teacher: set exactly one of teacher.path (an HF checkpoint directory) and teacher.build "
                             f"(pkg.module:function writing one), got path={self.path!r}, build={self.build!r}")
        if self.num_engines < 1:
            raise ValueError(f"teacher.num_engines must be >= 1, got {self.num_engines}")
        if not self.kl_coef > 0:
            raise ValueError(f"teacher.kl_coef must be > 0 (it scales the reverse-KL advantage), got {self.kl_coef}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"teacher.startup_timeout_s must be > 0, got {self.startup_timeout_s}")


def load_build_hook(build: str) -> Callable[[str, str], None]:
    """`teacher.build`'s function, checked against its contract (`fn(out_dir, policy_dir)`)."""
    import inspect

    from glue.plugins import load_object

    fn = load_object(build, what="teacher.build")
    params = [p.name for p in inspect.signature(fn).parameters.values()][:2] if callable(fn) else []
    if params != BUILD_PARAMS:
        raise TypeError(f"teacher.build {build!r} must be a function ({', '.join(BUILD_PARAMS)}), got {fn!r}")
    return fn


def build_teacher_model(build: str, out_dir: str, policy_dir: str) -> str:
    """Run `teacher.build` to write the teacher's checkpoint; returns out_dir."""
    from pathlib import Path

    load_build_hook(build)(out_dir, policy_dir)
    if not (Path(out_dir) / "config.json").is_file():
        raise FileNotFoundError(f"teacher.build {build!r} wrote no config.json into {out_dir}")
    return out_dir


class TeacherScorer:
    """Scores samples with the teacher: one `/generate` per sample through the teacher's router, over prompt +
    response with `max_new_tokens: 0`, `return_logprob` and `logprob_start_len = len(prompt) - 1` (SGLang answers
    None for the token at logprob_start_len, so the response's first token needs the position before it)."""

    def __init__(self, client: Any):
        self.client = client  # glue.engine_client.EngineClient of the teacher's fleet
        self.scored_samples = 0

    async def score(self, sample: Sample) -> None:
        p, response = len(sample.prompt_tokens), sample.response_tokens
        out = await self.client.generate(sample.prompt_tokens + response, {"max_new_tokens": 0},
                                         return_logprob=True, logprob_start_len=p - 1)
        entries = out["meta_info"]["input_token_logprobs"][1:]
        if [e[1] for e in entries] != response:
            raise ValueError(f"teacher answered input_token_logprobs for tokens {[e[1] for e in entries][:8]}... "
                             f"where sample {sample.group_id}/{sample.index} has response {response[:8]}...; is the "
                             "teacher an SGLang-compatible engine that honours logprob_start_len?")
        sample.teacher_logprobs = [float(e[0]) for e in entries]
        self.scored_samples += 1

    async def score_group(self, group: Group) -> Group:
        """Every sample that can be trained on and has response tokens; failed groups pass through untouched."""
        await asyncio.gather(*(self.score(s) for s in group.samples
                               if s.status is not SampleStatus.FAILED and s.response_tokens))
        return group


class TeacherScoringManager:
    """The rollout manager with each finished group scored by the teacher before the buffer sees it; everything
    else (checkpoint state, resume, the task, the rollout function) is the wrapped manager's."""

    def __init__(self, manager: Any, scorer: TeacherScorer):
        self.manager, self.scorer = manager, scorer

    def next_group(self) -> tuple[int, Awaitable[Group]]:
        group_id, generating = self.manager.next_group()
        return group_id, self._scored(generating)

    async def _scored(self, generating: Awaitable[Group]) -> Group:
        return await self.scorer.score_group(await generating)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)


def distillation_batch_builder(cfg: TeacherConfig) -> Callable[..., tuple[Any, dict[str, float]]]:
    """`glue.batch.build_train_batch` whose advantages then get the teacher's term (loss.distill), with its
    `distill/*` metrics: what the loop calls each step when a run has a teacher."""
    from glue.batch import build_train_batch
    from loss.distill import distillation_advantages

    def build(groups: list[Group], loss_cfg: Any, **kwargs: Any) -> tuple[Any, dict[str, float]]:
        batch, metrics = build_train_batch(groups, loss_cfg, **kwargs)
        if batch.teacher_logprobs is None:
            raise RuntimeError("a distillation step has no teacher logprobs on its samples: the teacher scores "
                               "finished groups as they arrive (or a run.replay_from run must have had a teacher)")
        batch.advantages, distill = distillation_advantages(
            batch.advantages, student_logprobs=batch.rollout_logprobs, teacher_logprobs=batch.teacher_logprobs,
            mask=batch.logprob_mask, coef=cfg.kl_coef, objective=cfg.objective, center=cfg.center)
        return batch, {**metrics, **distill}

    return build
