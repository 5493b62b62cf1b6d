"""The reward sections: `reward:` (shaping of the task's rewards), `judge:`, `reward_model:` and `teacher:`.

Light module: imports no backend, so `launch.config` can build and validate a run config anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True)
class SlimeRewardConfig:
    """slime's reward function, run as it is (glue.rollout.slime.adapter)."""

    function: str | None = None  # slime's --custom-rm-path: async def reward_func(args, sample, **kwargs) -> float | dict, in place of the task's reward ('pkg.module:function', 'pkg.module.function' or 'path/to/file.py:function')

    def __post_init__(self) -> None:
        if self.function is not None and (not isinstance(self.function, str) or not self.function.strip()):
            raise ValueError(f"reward.slime.function must be a path like 'pkg.module:function' or "
                             f"'path/to/file.py:function', got {self.function!r}")


@dataclass(kw_only=True)
class RewardConfig:
    """Shaping of the task's rewards for training (glue.rewards.shaping); evaluation sees the task's own rewards."""

    overlong_buffer: int = 0  # DAPO soft overlong punishment: a response of L > max_len - overlong_buffer tokens gets overlong_penalty * (L - (max_len - overlong_buffer)) / overlong_buffer taken off its reward, all of overlong_penalty from max_len on (reward/overlong_penalized_frac); 0: off
    overlong_penalty: float = 1.0  # the most the overlong punishment takes off a reward (DAPO: 1.0)
    overlong_max_len: int | None = None  # max_len of the overlong punishment, in response tokens; null: rollout.sampling.max_new_tokens (set it for multi-turn rollouts, whose response spans several generate calls)
    on_error: Literal["fail_sample", "fail_group"] = "fail_sample"  # a reward function that raises: fail_sample marks that sample FAILED and its group trains on the rest (if two or more are left); fail_group fails the whole group
    slime: SlimeRewardConfig = field(default_factory=SlimeRewardConfig)  # slime's reward function, run unchanged
    task_weight: float = 1.0  # with judge: or reward_model:, the reward's "score" is task_weight x the task's score + each model's weight x its score (0: the models' scores alone)

    def __post_init__(self) -> None:
        if self.on_error not in ("fail_sample", "fail_group"):
            raise ValueError(f"reward.on_error must be 'fail_sample' or 'fail_group', got {self.on_error!r}")
        if self.overlong_buffer < 0:
            raise ValueError(f"reward.overlong_buffer must be >= 0 (0: no overlong punishment), got {self.overlong_buffer}")
        if not self.overlong_penalty > 0:
            raise ValueError(f"reward.overlong_penalty must be > 0, got {self.overlong_penalty} (to turn the "
                             "punishment off set reward.overlong_buffer: 0)")
        if self.overlong_max_len is not None and self.overlong_max_len < 1:
            raise ValueError(f"reward.overlong_max_len must be >= 1 or null, got {self.overlong_max_len}")

    def max_len(self, max_new_tokens: int) -> int:
        """The overlong punishment's max_len: `overlong_max_len`, or the sampling limit."""
        return self.overlong_max_len if self.overlong_max_len is not None else max_new_tokens

    def check_against(self, max_new_tokens: int) -> None:
        """The buffer must fit inside max_len; raises ValueError naming the keys."""
        max_len = self.max_len(max_new_tokens)
        if self.overlong_buffer > max_len:
            where = ("reward.overlong_max_len" if self.overlong_max_len is not None
                     else "rollout.sampling.max_new_tokens")
            raise ValueError(f"reward.overlong_buffer={self.overlong_buffer} must be <= max_len ({where}={max_len}): "
                             "the punishment starts max_len - overlong_buffer tokens into the response")


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
