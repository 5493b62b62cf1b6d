"""Environments for the multi-turn rollout function (`rollout_fns.multi_turn`): the protocol an environment speaks,
the `Action` it is handed each assistant turn and the `StepResult` it answers with. Example: `envs.calculator`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, kw_only=True)
class Action:
    """One assistant turn as the environment sees it."""

    turn: int  # 0-based index of the assistant turn in the episode
    tokens: list[int]  # the engine's output ids of this turn, exactly as generated (may end with the stop token)
    text: str  # those tokens decoded with special tokens skipped; "" when the task has no tokenizer
    parsed: Any = None  # what the task's `parse_action(text)` hook returned; None without a hook


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The environment's answer to one action.

    observation: text is put in a chat turn of the task's `observation_role` ("tool" or "user") by the tokenizer's
    chat template and tokenized; a list of ints is appended as it is (the environment did the templating); None
    appends nothing. Either way the observation tokens get loss_mask 0.
    reward: this step's reward (the task's reward decides how steps combine; by default they are summed).
    done: the episode is over; a final observation is not appended.
    error: the environment's own report that this turn failed (a tool error, a bad argument). The turn is counted
    in `metadata["error_turns"]` and, with `rollout.error_masking`, its assistant tokens are not trained on.
    """

    observation: str | list[int] | None = None
    reward: float = 0.0
    done: bool = False
    error: str | None = None


@runtime_checkable
class Environment(Protocol):
    """What `rollout_fns.multi_turn` drives, one instance per episode (the task's `make_env(prompt)` builds it).

    An exception from `step` (or a step slower than the task's `turn_timeout_s`) makes that turn a failed turn: the
    episode goes on with an "error: ..." observation. `close` is optional; when defined it is awaited once the
    episode ends, however it ends.
    """

    async def reset(self, prompt: dict) -> list[int] | None:
        """Start an episode for `prompt` (the task's prompt dict). Return the prompt token ids to start from, or
        None to use `prompt["prompt_tokens"]`."""
        ...

    async def step(self, action: Action) -> StepResult | tuple:
        """Act on one assistant turn; a `StepResult`, or a tuple `(observation, reward, done)`."""
        ...


def as_step_result(value: Any, env: Any) -> StepResult:
    """An environment's `step` answer as a StepResult; raise TypeError naming the environment when it is neither a
    StepResult nor an (observation, reward, done) tuple of the right types."""
    if isinstance(value, tuple) and len(value) == 3:
        value = StepResult(observation=value[0], reward=value[1], done=value[2])
    if not isinstance(value, StepResult):
        raise TypeError(f"environment {type(env).__name__}.step must return a StepResult or a tuple (observation, "
                        f"reward, done), got {type(value).__name__}")
    obs = value.observation
    if not (obs is None or isinstance(obs, str)
            or (isinstance(obs, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in obs))):
        raise TypeError(f"environment {type(env).__name__}.step: observation must be text, a list of token ids or "
                        f"None, got {str(obs)[:100]}")
    if isinstance(value.reward, bool) or not isinstance(value.reward, (int, float)):
        raise TypeError(f"environment {type(env).__name__}.step: reward must be a number, got {value.reward!r}")
    return value
