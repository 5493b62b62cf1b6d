"""Held-out evaluation: every `eval.interval` train steps (and at the start) the loop awaits `evaluate(step)`, which
runs the rollout function on a fixed set of the eval task's prompts through the same client, never through the
training buffer or the staleness gate, and returns `eval/*` metrics for the step's record."""
from __future__ import annotations

import asyncio
import math
import sys
import time
from itertools import islice
from typing import Any, Awaitable, Callable

from glue.loop.batch import reward_key_means
from glue.rollout.manager import RolloutContext
from glue.types import Group, Sample, SampleStatus


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt answered `n` times, `c` of them passing: the chance that `k` answers drawn
    without replacement from the `n` include at least one that passes, 1 - C(n - c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def passes(sample: Sample, threshold: float) -> bool:
    """A scored answer passes when its reward's "correct" entry (dict rewards) or its score reaches `threshold`."""
    if sample.status is SampleStatus.FAILED:
        return False
    reward = sample.reward
    value = reward.get("correct", sample.scalar_reward) if isinstance(reward, dict) else sample.scalar_reward
    return float(value) >= threshold


def eval_metrics(groups: list[Group], *, ks: list[int], threshold: float) -> dict[str, float]:
    """`eval/*` from the evaluated groups: mean reward (and each extra key of dict rewards), pass@k averaged over
    prompts, response length, and the oldest and newest weight version that produced an answer token. A failed
    group's answers count as not passing; its rewards are not in the means."""
    samples = [s for g in groups for s in g.samples]
    scored = [s for s in samples if s.status is not SampleStatus.FAILED]
    versions = [v for s in scored for v in s.versions]
    out = {
        "eval/reward_mean": _mean([s.scalar_reward for s in scored]),
        "eval/response_len_mean": _mean([len(s.response_tokens) for s in scored]),
        "eval/truncated_frac": _mean([float(s.status is SampleStatus.TRUNCATED) for s in scored]),
        "eval/num_samples": float(len(samples)),
        "eval/failed_groups": float(sum(g.error is not None for g in groups)),
        "eval/weight_version": float(min(versions)) if versions else float("nan"),
        "eval/weight_version_max": float(max(versions)) if versions else float("nan"),
        **reward_key_means(scored, prefix="eval/reward/"),
    }
    for k in ks:
        out[f"eval/pass@{k}"] = _mean([pass_at_k(len(g.samples), sum(passes(s, threshold) for s in g.samples), k)
                                       for g in groups])
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class Evaluator:
    """`await evaluate(step)` returns `eval/*` metrics when `step` is due (every `interval` steps; step 0 when
    `at_start`), else {}. The prompts are the first `num_prompts` of `task.prompts(seed)`, drawn once, so every
    evaluation answers the same ones. Eval groups carry negative ids (-1, -2, ...), apart from training groups."""

    def __init__(self, *, fn: Callable[..., Awaitable[list[Sample]]], task: Any, client: Any, sampling_params: dict,
                 interval: int | None, at_start: bool = True, seed: int = 1000, num_prompts: int = 32,
                 samples_per_prompt: int = 1, ks: list[int] = (1,), threshold: float = 1.0,
                 group_timeout_s: float | None = None, reward_fn: Callable | None = None, slime: Any = None):
        self.fn, self.task, self.client, self.sampling_params = fn, task, client, dict(sampling_params)
        self.reward_fn, self.slime = reward_fn or task.reward, slime  # reward.slime / rollout.slime, as in training
        self.interval, self.at_start, self.seed = interval or 0, at_start, seed
        self.num_prompts, self.samples_per_prompt = num_prompts, samples_per_prompt
        self.ks, self.threshold, self.group_timeout_s = list(ks), threshold, group_timeout_s
        self._prompts: list[dict] | None = None
        self.evaluations = 0

    def is_due(self, step: int) -> bool:
        if not self.interval:
            return False
        return self.at_start if step == 0 else step % self.interval == 0

    def prompts(self) -> list[dict]:
        if self._prompts is None:
            prompts = list(islice(self.task.prompts(self.seed), self.num_prompts))
            if len(prompts) < self.num_prompts:
                raise ValueError(f"eval task gave {len(prompts)} prompts, fewer than eval.num_prompts="
                                 f"{self.num_prompts}; lower it or give the eval task more data")
            self._prompts = prompts
        return self._prompts

    async def evaluate(self, step: int) -> dict[str, float]:
        if not self.is_due(step):
            return {}
        started = time.perf_counter()
        groups = await asyncio.gather(*(self._run_group(-1 - i, p) for i, p in enumerate(self.prompts())))
        self.evaluations += 1
        return {**eval_metrics(list(groups), ks=self.ks, threshold=self.threshold),
                "eval/time_s": time.perf_counter() - started}

    async def _run_group(self, group_id: int, prompt: dict) -> Group:
        """One prompt's answers. A rollout function that raises, times out or returns something else than
        `samples_per_prompt` Samples fails only this group (eval/failed_groups), as in training."""
        ctx = RolloutContext(client=self.client, sampling_params=dict(self.sampling_params),
                             reward_fn=self.reward_fn, group_id=group_id, task=self.task, slime=self.slime)
        try:
            samples = await asyncio.wait_for(self.fn(ctx, prompt, self.samples_per_prompt), self.group_timeout_s)
            if (not isinstance(samples, list) or len(samples) != self.samples_per_prompt
                    or not all(isinstance(s, Sample) for s in samples)):
                raise TypeError(f"expected a list of {self.samples_per_prompt} glue.types.Sample")
            for index, sample in enumerate(samples):
                sample.group_id, sample.index = group_id, index
                sample.validate()
        except Exception as err:  # noqa: BLE001 - a bad eval group is counted, the run goes on
            error = f"{type(err).__name__}: {err}".strip().splitlines()[0]
            print(f"sluice: eval group {group_id} failed: {error}", file=sys.stderr, flush=True)
            samples = [Sample(prompt_tokens=list(prompt["prompt_tokens"]), group_id=group_id, index=i,
                              status=SampleStatus.FAILED) for i in range(self.samples_per_prompt)]
            return Group(group_id=group_id, samples=samples, error=error)
        return Group(group_id=group_id, samples=samples)
