"""On-policy distillation on the driver's side: a teacher model served by its own fleet (engines behind its own
sgl-router, never synced) scores the response tokens of every finished group with SGLang's prompt-logprob request,
the scores ride on each `Sample` (`teacher_logprobs`) into the `TrainBatch`, and each step's advantages get the
per-token reverse KL to the teacher (loss.distill). The `teacher:` section is `TeacherConfig`; launch.run.teacher starts
the fleet. Imports no backend at import time."""
from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any, Awaitable, Callable

from glue.fleet.engine_client import EngineHTTPError
from glue.plugins import load_object
from glue.rewards.config import BUILD_PARAMS
from glue.types import Group, Sample, SampleStatus


def load_build_hook(build: str) -> Callable[[str, str], None]:
    """`teacher.build`'s function, checked against its contract (`fn(out_dir, policy_dir)`)."""
    fn = load_object(build, what="teacher.build")
    params = [p.name for p in inspect.signature(fn).parameters.values()][:2] if callable(fn) else []
    if params != BUILD_PARAMS:
        raise TypeError(f"teacher.build {build!r} must be a function ({', '.join(BUILD_PARAMS)}), got {fn!r}")
    return fn


def build_teacher_model(build: str, out_dir: str, policy_dir: str) -> str:
    """Run `teacher.build` to write the teacher's checkpoint; returns out_dir."""
    load_build_hook(build)(out_dir, policy_dir)
    if not (Path(out_dir) / "config.json").is_file():
        raise FileNotFoundError(f"teacher.build {build!r} wrote no config.json into {out_dir}")
    return out_dir


class TeacherScorer:
    """Scores samples with the teacher: one `/generate` per sample through the teacher's router, over prompt +
    response with `max_new_tokens: 0`, `return_logprob` and `logprob_start_len = len(prompt) - 1` (SGLang answers
    None for the token at logprob_start_len, so the response's first token needs the position before it)."""

    def __init__(self, client: Any):
        self.client = client  # glue.fleet.engine_client.EngineClient of the teacher's fleet
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
    else (checkpoint state, resume, the task, the rollout function) is the wrapped manager's. A group the teacher's
    fleet cannot score (its engines gone past the client's retries, while the watch replaces them) fails, as a group
    whose generation failed does: counted in rollout/failed_groups and replaced by another prompt, not the run's end."""

    def __init__(self, manager: Any, scorer: TeacherScorer):
        self.manager, self.scorer = manager, scorer

    def next_group(self) -> tuple[int, Awaitable[Group]]:
        group_id, generating = self.manager.next_group()
        return group_id, self._scored(generating)

    async def _scored(self, generating: Awaitable[Group]) -> Group:
        group = await generating
        try:
            return await self.scorer.score_group(group)
        except (ConnectionError, EngineHTTPError) as err:
            return unscored(group, f"the teacher could not score it: {(str(err).strip().splitlines() or [''])[0]}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)


def unscored(group: Group, error: str) -> Group:
    """`group` with every sample FAILED for `error` (the scores some samples got are dropped with them)."""
    for sample in group.samples:
        sample.status, sample.teacher_logprobs = SampleStatus.FAILED, []
        sample.metadata["error"] = error
    group.error, group.lost = error, True
    return group
