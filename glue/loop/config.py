"""The loop's sections: `sync:` (the staleness gate's half; the transport half is weight_sync.config.BridgeConfig,
which `SyncConfig` extends so the YAML section stays one) and `eval:`.

Light module: imports no backend, so `launch.config` can build and validate a run config anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from weight_sync.config import BridgeConfig


@dataclass(kw_only=True)
class SyncConfig(BridgeConfig):
    """The `sync:` section: when weights move and what staleness is allowed (the transport fields are BridgeConfig's)."""

    max_staleness: int | None = None  # versions a trained token may lag the trainer; null: 0 in run.mode sync, 1 in async
    interval: int = 1  # sync once the trainer is this many versions ahead of the engines (<= max_staleness + 1)
    pause_mode: Literal["retract", "abort", "in_place"] | None = None  # how generation pauses for a sync (SGLang's modes): retract recomputes in-flight KV on the new weights, abort returns partial answers the rollout function resumes, in_place keeps old-weight KV (mixes versions); null: retract on embedded engines, abort on SGLang servers (they report one version per request)
    stale_policy: Literal["drop", "keep"] = "drop"  # a sample beyond max_staleness (after faults, or admission off): withhold it from training (still in its group's baseline) or train it anyway
    partial_rollouts: Literal["resume", "restart"] = "resume"  # after an abort-mode pause: resume from prompt + tokens so far (a sample may span versions), or restart from the prompt (the Missing-Old-Logits write-up's interruption route: one version per sample, the aborted tokens are thrown away)
    admission: bool = True  # start a group only if it cannot end up beyond max_staleness; off: unbounded, stale_policy decides

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"sync.max_staleness must be >= 0 (or null for the mode's default), got {self.max_staleness}")
        if self.interval < 1:
            raise ValueError(f"sync.interval must be >= 1, got {self.interval}")
        if self.pause_mode not in (None, "retract", "abort", "in_place"):
            raise ValueError(f"sync.pause_mode must be 'retract', 'abort' or 'in_place', got {self.pause_mode!r}")
        if self.partial_rollouts not in ("resume", "restart"):
            raise ValueError(f"sync.partial_rollouts must be 'resume' or 'restart', got {self.partial_rollouts!r}")
        if self.partial_rollouts == "restart" and self.pause_mode not in (None, "abort"):
            raise ValueError(f"sync.partial_rollouts=restart needs sync.pause_mode=abort (with {self.pause_mode!r} the "
                             "engine keeps requests running across the sync, so a sample spans versions anyway)")
        if self.stale_policy not in ("drop", "keep"):
            raise ValueError(f"sync.stale_policy must be 'drop' or 'keep', got {self.stale_policy!r}")


@dataclass(kw_only=True)
class EvalSamplingConfig:
    """Sampling for evaluation; each null field takes rollout.sampling's value."""

    temperature: float | None = 0.0  # 0 = greedy; null: rollout.sampling.temperature
    top_p: float | None = None  # nucleus sampling mass
    top_k: int | None = None  # top-k sampling, -1 = off
    max_new_tokens: int | None = None  # response length limit per generate call

    def __post_init__(self) -> None:
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval.sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"eval.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"eval.sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def to_sglang(self, base: dict[str, Any]) -> dict[str, Any]:
        """`base` (the training run's sampling_params) with this section's fields that are set."""
        chosen = {k: v for k, v in vars(self).items() if v is not None}
        return {**base, **chosen}


@dataclass(kw_only=True)
class EvalConfig:
    """A held-out evaluation through the same fleet, never through the training buffer (glue.loop.evaluation)."""

    interval: int | None = None  # evaluate after every this many train steps; 0 or null: no evaluation
    at_start: bool = True  # also evaluate the initial weights (logged as step 0)
    task: str | None = None  # task class or object, `module:attr`; null: rollout.task, built with rollout.task_args updated by eval.task_args
    task_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the task class (e.g. {path: test.jsonl})
    seed: int = 1000  # seed of the eval task's prompts(seed): the same num_prompts prompts at every evaluation
    num_prompts: int = 32  # prompts per evaluation
    samples_per_prompt: int = 1  # answers per prompt (pass@k needs k of them)
    pass_at_k: list[int] = field(default_factory=lambda: [1])  # eval/pass@k for each k (unbiased estimator, k <= samples_per_prompt)
    pass_threshold: float = 1.0  # an answer passes when its reward's "correct" entry (dict rewards) or its score is >= this
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)

    def __post_init__(self) -> None:
        if self.interval is not None and self.interval < 0:
            raise ValueError(f"eval.interval must be >= 0 (0 or null: off), got {self.interval}")
        for name in ("num_prompts", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name} must be >= 1, got {getattr(self, name)}")
        bad = [k for k in self.pass_at_k if not isinstance(k, int) or not 1 <= k <= self.samples_per_prompt]
        if bad:
            raise ValueError(f"eval.pass_at_k entries must be integers in [1, eval.samples_per_prompt="
                             f"{self.samples_per_prompt}], got {bad}; raise eval.samples_per_prompt or drop them")
        if self.task is not None and not self.task.replace(":", ".").replace("_", "a").replace(".", "a").isalnum():
            raise ValueError(f"eval.task must be an import path like 'pkg.module:attr', got {self.task!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.interval)
