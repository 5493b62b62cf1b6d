"""Length control on the reward side: DAPO's soft overlong punishment, applied to each finished training group's
rewards before dynamic sampling and advantages see them (`reward:` section, glue.rewards.config.RewardConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from glue.types import Sample, SampleStatus

PENALTY_KEY = "overlong_penalty"  # Sample.metadata entry: what the punishment added to the reward (<= 0)


def overlong_penalty(length: int, *, max_len: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment for a response of `length` tokens: 0 up to `max_len - buffer`, then falling
    linearly to `-penalty` at `max_len`, and `-penalty` beyond it."""
    over = length - (max_len - buffer)
    if over <= 0:
        return 0.0
    return -penalty * min(over / buffer, 1.0)


@dataclass(frozen=True)
class OverlongShaping:
    """Adds `overlong_penalty` of each scored sample's response length to its reward (a dict reward's "score") and
    records it in `metadata["overlong_penalty"]` (0.0 for a sample it spared), which `shaping_metrics` counts."""

    max_len: int
    buffer: int
    penalty: float

    def __call__(self, samples: list[Sample]) -> None:
        for sample in samples:
            if sample.status is SampleStatus.FAILED or sample.reward is None:
                continue
            added = overlong_penalty(len(sample.response_tokens), max_len=self.max_len, buffer=self.buffer,
                                     penalty=self.penalty)
            sample.metadata[PENALTY_KEY] = added
            if isinstance(sample.reward, dict):
                sample.reward = {**sample.reward, "score": sample.scalar_reward + added}
            else:
                sample.reward = float(sample.reward) + added


def make_reward_shaping(*, overlong_buffer: int, overlong_penalty: float, max_len: int) -> OverlongShaping | None:
    """The shaping `reward:` asks for, or None when it is off (`overlong_buffer: 0`)."""
    if overlong_buffer == 0:
        return None
    return OverlongShaping(max_len=max_len, buffer=overlong_buffer, penalty=overlong_penalty)


def shaping_metrics(samples: list[Sample]) -> dict[str, float]:
    """With overlong shaping on: the share of the scored samples it penalised (`reward/overlong_penalized_frac`)
    and the mean it added (`reward/overlong_penalty_mean`); nothing when it is off."""
    added = [s.metadata[PENALTY_KEY] for s in samples if PENALTY_KEY in s.metadata]
    if not added:
        return {}
    return {"reward/overlong_penalized_frac": sum(a < 0 for a in added) / len(added),
            "reward/overlong_penalty_mean": sum(added) / len(added)}
