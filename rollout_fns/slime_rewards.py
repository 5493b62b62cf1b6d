"""slime's rule-based rewards (`--rm-type`) as a text task's reward function: `rm_hub_reward(response_text, label,
sample, rm_type=...)` scores with glue.rollout.slime.rm_hub, the rules slime's own rm_hub applies, and returns the
reward as a dict: {"score": the number} (dapo's dict keeps "score" and "acc" as 0 / 1)."""
from __future__ import annotations

from typing import Any

from glue.rollout.slime.rm_hub import rule_reward
from glue.types import Sample


def rm_hub_reward(response_text: str, label: Any, sample: Sample | None = None, *, rm_type: str) -> dict[str, float]:
    """The reward slime's `--rm-type rm_type` gives this response (sample.metadata is the rule's metadata: gpqa's
    choices, ifbench's instructions)."""
    metadata = dict(sample.metadata) if sample is not None else {}
    reward = rule_reward(rm_type, response_text, label, metadata)
    if isinstance(reward, dict):
        return {k: float(v) for k, v in reward.items() if isinstance(v, (int, float))}
    return {"score": float(reward)}
