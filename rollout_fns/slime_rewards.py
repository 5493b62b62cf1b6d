"""slime's rule-based rewards (`--rm-type`) as a text task's reward function: `rm_hub_reward(response_text, label,
sample, rm_type=...)` scores with glue.rollout.slime.rm_hub, the rules slime's own rm_hub applies, and returns the
reward as a dict: {"score": the number} (dapo's dict keeps "score" and "acc" as 0 / 1)."""
from __future__ import annotations

from typing import Any

from glue.rollout.slime.rm_hub import rule_reward
from glue.types import Sample


def rm_hub_reward(response_text: str, label: Any, sample: Sample | None = None, *, rm_type: str,
                  max_response_chars: int | None = None, length_penalty: float = 0.0) -> dict[str, float]:
    """The reward slime's `--rm-type rm_type` gives this response (sample.metadata is the rule's metadata: gpqa's
    choices, ifbench's instructions). `max_response_chars` / `length_penalty`: the built-in verifiers' length penalty
    (rollout_fns.verifiers), taken off the score of a response longer than that ("too_long" 1)."""
    metadata = dict(sample.metadata) if sample is not None else {}
    reward = rule_reward(rm_type, response_text, label, metadata)
    if isinstance(reward, dict):
        scored = {k: float(v) for k, v in reward.items() if isinstance(v, (int, float))}
    else:
        scored = {"score": float(reward)}
    if max_response_chars is not None:
        is_too_long = len(response_text) > max_response_chars
        scored["score"] -= length_penalty if is_too_long else 0.0
        scored["too_long"] = float(is_too_long)
    return scored
