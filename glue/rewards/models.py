"""Rewards served by models, beside generation: each finished group's responses go to an LLM judge (its own engine
fleet, glue.rewards.judge) and/or a scalar reward model (a sequence-classification checkpoint, glue.rewards.scalar_rm) before the
group reaches the buffer; their scores join the task's reward. Settings (`judge:`, `reward_model:`) live here too.

Light module: imports no backend, so `launch.config` can build a run config anywhere.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from glue.types import SampleStatus


class ModelRewardFailed(RuntimeError):
    """A reward model could not score a sample and its `on_failure` is drop_group: the group fails."""


class Scorer(Protocol):
    """What a reward model offers the group hook: a verdict per text (its "score" None where it failed, "error"
    saying why) and counters."""

    name: str  # the reward dict key its score goes under ("judge", "rm")
    section: str  # its config section ("judge", "reward_model")
    weight: float
    on_failure: str

    async def score(self, texts: list["SampleText"]) -> list[dict]: ...  # per text {"score": float | None, ...}
    def metrics(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class SampleText:
    """What a reward model reads of a sample: the prompt and response decoded by the policy's tokenizer, and the
    prompt's label when the task gave one (else "")."""

    prompt: str
    response: str
    label: str


class ModelRewards:
    """The rollout manager's group hook (`RolloutManager(group_rewards=...)`): after a group's rollout function
    returns, every sample that was not FAILED is scored by each reward model, all samples and models at once, and its
    reward becomes a dict: the task's keys, the task's score under "task", one key per model ("judge", "rm"),
    and "score" = task_weight x task score + the sum of weight x model score. `metrics()` are the models' counters
    since the previous call (reward/*)."""

    def __init__(self, *, scorers: list[Scorer], tokenizer: Any, task_weight: float = 1.0):
        if not scorers:
            raise ValueError("ModelRewards needs at least one reward model")
        self.scorers, self.tokenizer, self.task_weight = list(scorers), tokenizer, task_weight

    @property
    def judge(self) -> Any:
        """The LLM judge among the scorers (what rollout functions get as `ctx.judge`), or None."""
        return next((s for s in self.scorers if s.section == "judge"), None)

    def text_of(self, sample: Any) -> SampleText:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        label = sample.metadata.get("label")
        return SampleText(prompt=decode(sample.prompt_tokens), response=decode(sample.response_tokens),
                          label="" if label is None else str(label))

    async def __call__(self, samples: list[Any]) -> None:
        scored = [s for s in samples if s.status is not SampleStatus.FAILED]
        if not scored:
            return
        texts = [self.text_of(s) for s in scored]
        results = await asyncio.gather(*(scorer.score(texts) for scorer in self.scorers))
        for scorer, verdicts in zip(self.scorers, results):
            for sample, verdict in zip(scored, verdicts):
                sample.metadata[scorer.name] = verdict
            failed = [v for v in verdicts if v["score"] is None]
            if failed and scorer.on_failure == "drop_group":
                raise ModelRewardFailed(f"{scorer.name} could not score {len(failed)} of {len(scored)} samples "
                                        f"(first: {failed[0].get('error')}); {scorer.section}.on_failure: drop_group")
        for i, sample in enumerate(scored):
            scores = {sc.name: (v[i]["score"] if v[i]["score"] is not None else 0.0, sc.weight)
                      for sc, v in zip(self.scorers, results)}
            sample.reward = self.combine(sample.reward, scores)

    def combine(self, task_reward: Any, model_scores: dict[str, tuple[float, float]]) -> dict[str, float]:
        """The sample's reward dict from the task's reward and each model's (score, weight)."""
        if isinstance(task_reward, dict):
            reward = {k: float(v) for k, v in task_reward.items()}
            task_score = reward.pop("score")
        else:
            task_score, reward = float(task_reward), {}
        reward["task"] = task_score
        total = self.task_weight * task_score
        for name, (value, weight) in model_scores.items():
            if not math.isfinite(value):
                raise ValueError(f"{name} returned a non-finite score {value!r}")
            reward[name] = value
            total += weight * value
        return {**reward, "score": total}

    def metrics(self) -> dict[str, float]:
        return {k: v for scorer in self.scorers for k, v in scorer.metrics().items()}

    async def aclose(self) -> None:
        for scorer in self.scorers:
            closing = getattr(scorer, "aclose", None)
            if closing is not None:
                await closing()


def reward_model_metrics(manager: Any) -> dict[str, float]:
    """The reward/* counters of a rollout manager's model rewards (none when it has none)."""
    rewards = getattr(manager, "group_rewards", None)
    return rewards.metrics() if isinstance(rewards, ModelRewards) else {}


@dataclass
class Counters:
    """Per-step counts of one reward model, read and reset by `take()`: calls, failures by kind, latency."""

    prefix: str
    counts: dict[str, float] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)

    def add(self, name: str, n: float = 1.0) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + n

    def take(self, names: tuple[str, ...]) -> dict[str, float]:
        out = {f"reward/{self.prefix}_{n}": self.counts.get(n, 0.0) for n in names}
        if self.seconds:
            out[f"reward/{self.prefix}_s"] = sum(self.seconds) / len(self.seconds)
            out[f"reward/{self.prefix}_s_max"] = max(self.seconds)
        self.counts, self.seconds = {}, []
        return out
