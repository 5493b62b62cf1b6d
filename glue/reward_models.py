"""Rewards served by models, beside generation: each finished group's responses go to an LLM judge (its own engine
fleet, glue.judge) and/or a scalar reward model (a sequence-classification checkpoint, glue.scalar_rm) before the
group reaches the buffer; their scores join the task's reward. Settings (`judge:`, `reward_model:`) live here too.

Light module: imports no backend, so `launch.config` can build a run config anywhere.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

DEFAULT_JUDGE_TEMPLATE = ("Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\nAnswer: {response}\n"
                          "Reply with 'Score: N'.")
PLACEHOLDERS = ("{prompt}", "{response}", "{label}")
FAILURE_POLICIES = ("zero", "drop_group")


@dataclass(kw_only=True)
class JudgeConfig:
    """An LLM judge: its own engines behind its own sgl-router (the judge's checkpoint is `judge.model`)."""

    num_engines: int = 1  # judge engines behind the judge's router
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE  # the judge's user message; {prompt}, {response} (the policy's, decoded) and {label} (the prompt's label, if any) are filled in
    apply_chat_template: bool = True  # wrap the filled template in the judge tokenizer's chat template as one user turn (false: plain text)
    parser: str = "rollout_fns.judge:score_parser"  # `module:fn`, fn(judge_text) -> float; raising ValueError marks the answer unparsable (reward/judge_parse_failures)
    temperature: float = 0.0  # the judge's sampling temperature (0: greedy, the same answer for the same input)
    max_new_tokens: int = 16  # the judge's answer length limit
    timeout_s: float = 30.0  # a judge request still running this long after it was sent is cut (reward/judge_timeouts)
    max_concurrency: int = 16  # judge requests in flight at once, over all groups
    on_failure: Literal["zero", "drop_group"] = "zero"  # a timed-out, failed or unparsable judgement: the sample's judge score is 0, or its whole group fails (rollout/failed_groups, replaced by another prompt)
    weight: float = 1.0  # the judge score's weight in the reward's "score" (see reward.task_weight)

    def __post_init__(self) -> None:
        if self.num_engines < 1 or self.max_concurrency < 1 or self.max_new_tokens < 1:
            raise ValueError(f"judge.num_engines, judge.max_concurrency and judge.max_new_tokens must be >= 1, got "
                             f"{self.num_engines}, {self.max_concurrency} and {self.max_new_tokens}")
        if not self.timeout_s > 0:
            raise ValueError(f"judge.timeout_s must be > 0, got {self.timeout_s}")
        if self.temperature < 0:
            raise ValueError(f"judge.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if "{response}" not in self.prompt_template:
            raise ValueError("judge.prompt_template must contain {response} (the answer being judged); "
                             f"placeholders: {', '.join(PLACEHOLDERS)}")
        _check_policy("judge", self.on_failure)
        _check_path("judge.parser", self.parser)

    def sampling_params(self) -> dict[str, Any]:
        """SGLang's sampling_params for judge requests."""
        return {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens}


@dataclass(kw_only=True)
class RewardModelConfig:
    """A scalar reward model: an HF sequence-classification checkpoint with one label (`reward_model.model`),
    run in a worker thread of the driver beside generation."""

    batch_size: int = 16  # responses scored in one forward (from one group or several that finished together)
    max_length: int = 1024  # tokens of prompt + response the model reads (longer inputs keep their first tokens)
    apply_chat_template: bool = True  # read the prompt and response as a user and an assistant turn of the model's chat template (false, or no template: prompt + response as plain text)
    timeout_s: float = 60.0  # a response not scored this long after it was queued gets the failure policy (reward/rm_timeouts)
    on_failure: Literal["zero", "drop_group"] = "zero"  # a response not scored in time: its rm score is 0, or its whole group fails
    weight: float = 1.0  # the rm score's weight in the reward's "score" (see reward.task_weight)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_length < 2:
            raise ValueError(f"reward_model.batch_size must be >= 1 and reward_model.max_length >= 2, got "
                             f"{self.batch_size} and {self.max_length}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward_model.timeout_s must be > 0, got {self.timeout_s}")
        _check_policy("reward_model", self.on_failure)


def _check_policy(section: str, value: str) -> None:
    if value not in FAILURE_POLICIES:
        raise ValueError(f"{section}.on_failure must be one of {list(FAILURE_POLICIES)}, got {value!r}")


def _check_path(key: str, path: str) -> None:
    if not isinstance(path, str) or not path.replace(":", ".").replace("_", "a").replace(".", "a").isalnum():
        raise ValueError(f"{key} must be an import path like 'pkg.module:attr', got {path!r}")


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
        from glue.types import SampleStatus

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
