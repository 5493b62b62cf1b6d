"""Typed settings for the parts of the loop glue owns: the rollout fleet, reward shaping and the weight sync.

Light module: imports no backend, so `launch.config` can build and validate a run config anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0  # sampling temperature; the trainer scales logits by the same value
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # top-k sampling, -1 = off
    max_new_tokens: int = 8  # response length limit per generate call
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides the model's eos

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"rollout.sampling.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def to_sglang(self) -> dict[str, Any]:
        """SGLang's `sampling_params` JSON object."""
        params = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "max_new_tokens": self.max_new_tokens}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


@dataclass(kw_only=True)
class RolloutConfig:
    num_engines: int = 2  # inference engines behind the router
    function: str = "rollout_fns.single_turn:generate_group"  # rollout function, `module:attr`
    task: str = "rollout_fns.toy_tasks:EchoTask"  # task object/class with prompts() and reward(), `module:attr`
    task_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the task class
    prompts_per_step: int = 8  # groups per training step
    samples_per_prompt: int = 8  # group size (GRPO's G)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_concurrent_groups: int | None = None  # groups generating at once (e.g. the sandboxes an agent task has); null: as many as the staleness gate admits
    buffer_order: Literal["fifo", "newest_first"] = "fifo"  # which finished groups a step takes first once those due by the staleness bound are in (newest_first surfaces fresh data)
    router_policy: str = "round_robin"  # sgl-router load-balancing policy
    engine_startup_timeout_s: float = 120.0  # an engine not healthy by then fails the run with its log tail
    group_timeout_s: float | None = 3600.0  # a group still generating after this is cut and counted FAILED; null: no limit
    error_masking: bool = False  # multi-turn: a failed turn (malformed tool call, tool error, environment exception) is not trained on, the turns after it are (rollout/masked_error_turns)
    max_failed_frac: float = 0.5  # the run stops when more than this share of a step's groups fail (raise or time out)
    max_engine_restarts: int = 3  # engines that die or hang are restarted this many times per run, then the run stops
    health_check_interval_s: float = 10.0  # how often each engine is asked to generate a token (GET /health_generate)
    health_check_timeout_s: float = 60.0  # an engine that fails 3 checks in a row, each waiting this long, is restarted
    dynamic_sampling: bool = False  # DAPO: a group whose rewards are all equal (no advantage) is dropped when it finishes and another prompt drawn in its place
    return_routed_experts: bool = False  # MoE routing replay (R3): the single-turn and multi-turn rollouts ask engines for the experts every token was routed to (sent to engines directly: sgl-router drops the field; the OpenAI-agent path refuses the key) and samples carry them to the train batch; SGLang engines also need sglang.enable_return_routed_experts: true
    max_filtered_frac: float = 0.9  # with dynamic_sampling, the run stops when more than this share of the groups finished while collecting a step were dropped

    def __post_init__(self) -> None:
        for name in ("num_engines", "prompts_per_step", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_concurrent_groups is not None and self.max_concurrent_groups < 1:
            raise ValueError(f"rollout.max_concurrent_groups must be >= 1 or null, got {self.max_concurrent_groups}")
        if self.buffer_order not in ("fifo", "newest_first"):
            raise ValueError(f"rollout.buffer_order must be 'fifo' or 'newest_first', got {self.buffer_order!r}")
        if self.max_engine_restarts < 0:
            raise ValueError(f"rollout.max_engine_restarts must be >= 0, got {self.max_engine_restarts}")
        for name in ("health_check_interval_s", "health_check_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.{name} must be > 0, got {getattr(self, name)}")
        if self.group_timeout_s is not None and not self.group_timeout_s > 0:
            raise ValueError(f"rollout.group_timeout_s must be > 0 or null, got {self.group_timeout_s}")
        if not 0 <= self.max_filtered_frac < 1:
            raise ValueError(f"rollout.max_filtered_frac must be in [0, 1), got {self.max_filtered_frac} (at 1 a task "
                             "whose every group has equal rewards would draw prompts forever)")
        if not 0 <= self.max_failed_frac < 1:
            raise ValueError(f"rollout.max_failed_frac must be in [0, 1), got {self.max_failed_frac} (at 1 a task "
                             "whose every group fails would draw prompts forever)")
        if self.samples_per_prompt < 2:
            raise ValueError("rollout.samples_per_prompt must be >= 2: group-relative advantages need at least two samples")
        for name in ("function", "task"):
            path = getattr(self, name)
            if not isinstance(path, str) or not path.replace(":", ".").replace("_", "a").replace(".", "a").isalnum():
                raise ValueError(f"rollout.{name} must be an import path like 'pkg.module:attr', got {path!r}")


@dataclass(kw_only=True)
class RewardConfig:
    """Shaping of the task's rewards for training (glue.reward_shaping); evaluation sees the task's own rewards."""

    overlong_buffer: int = 0  # DAPO soft overlong punishment: a response of L > max_len - overlong_buffer tokens gets overlong_penalty * (L - (max_len - overlong_buffer)) / overlong_buffer taken off its reward, all of overlong_penalty from max_len on (reward/overlong_penalized_frac); 0: off
    overlong_penalty: float = 1.0  # the most the overlong punishment takes off a reward (DAPO: 1.0)
    overlong_max_len: int | None = None  # max_len of the overlong punishment, in response tokens; null: rollout.sampling.max_new_tokens (set it for multi-turn rollouts, whose response spans several generate calls)
    task_weight: float = 1.0  # with judge: or reward_model:, the reward's "score" is task_weight x the task's score + each model's weight x its score (0: the models' scores alone)

    def __post_init__(self) -> None:
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


@dataclass(kw_only=True)
class SyncConfig:
    transport: Literal["broadcast", "ipc", "disk"] = "broadcast"  # broadcast (weight group), ipc (colocated, shared memory / CUDA IPC), disk (safetensors, the slow reference)
    backend: Literal["gloo", "nccl"] = "gloo"  # collective backend of the weight group (nccl on GPU); nccl also makes ipc share CUDA buffers
    bucket_bytes: int = 512 * 1024**2  # weights travel in flat buckets of at most this many bytes
    pipeline: bool | None = None  # pack bucket k+1 while bucket k is on the wire (two reused buffers, smaller buckets); null: on with nccl, off with gloo (on 2 shared CPU cores the packing thread competes with gloo; bench medians were 0.41-0.67 of a raw gloo broadcast either way, within the noise, and ipc was slower pipelined)
    sources: Literal["one", "parallel"] | None = None  # broadcast: one (trainer rank 0 sends every bucket) or parallel (each pipeline stage and expert group sends its own through its own weight group); null: parallel when the trainer has several stages / expert groups
    delta: bool = False  # broadcast, embedded engines: after a sync every engine confirmed, send each bucket as its changed elements (positions + values) where that is smaller; any failure or fleet change makes the next sync whole. Costs each source rank a CPU copy of the weights it sends (2 bytes/param in bf16)
    verify: Literal["auto", "checksum", "full", "off"] = "auto"  # after every sync each engine's version is checked; checksum: also every bucket, both sides (engines that report bucket checksums: sluice's embedded engine); full: also every engine tensor vs the trainer's (embedded engine); auto: checksum where every engine reports bucket checksums, else versions only (SGLang)
    master_address: str | None = None  # address trainer rank 0 hosts the weight group on; null: its node's address as Ray reports it (set it on machines with several networks)
    disk_dir: str | None = None  # where the disk transport writes checkpoints; null: a temporary directory
    timeout_s: float = 300.0  # a sync that takes longer fails the run
    max_staleness: int | None = None  # versions a trained token may lag the trainer; null: 0 in run.mode sync, 1 in async
    interval: int = 1  # sync once the trainer is this many versions ahead of the engines (<= max_staleness + 1)
    pause_mode: Literal["retract", "abort", "in_place"] | None = None  # how generation pauses for a sync (SGLang's modes): retract recomputes in-flight KV on the new weights, abort returns partial answers the rollout function resumes, in_place keeps old-weight KV (mixes versions); null: retract on embedded engines, abort on SGLang servers (they report one version per request)
    stale_policy: Literal["drop", "keep"] = "drop"  # a sample beyond max_staleness (after faults, or admission off): withhold it from training (still in its group's baseline) or train it anyway
    partial_rollouts: Literal["resume", "restart"] = "resume"  # after an abort-mode pause: resume from prompt + tokens so far (a sample may span versions), or restart from the prompt (seed 001's interruption route: one version per sample, the aborted tokens are thrown away)
    admission: bool = True  # start a group only if it cannot end up beyond max_staleness; off: unbounded, stale_policy decides

    def __post_init__(self) -> None:
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
        if self.transport not in ("broadcast", "ipc", "disk"):
            raise ValueError(f"sync.transport must be 'broadcast', 'ipc' or 'disk', got {self.transport!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"sync.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.sources not in (None, "one", "parallel"):
            raise ValueError(f"sync.sources must be 'one' or 'parallel' (or null: parallel when the trainer has "
                             f"several stages / expert groups), got {self.sources!r}")
        if self.sources == "parallel" and self.transport != "broadcast":
            raise ValueError(f"sync.sources: parallel needs sync.transport: broadcast (got {self.transport!r}); "
                             "set sync.sources: one")
        if self.delta and self.transport != "broadcast":
            raise ValueError(f"sync.delta: true needs sync.transport: broadcast (got {self.transport!r}): ipc copies "
                             "in memory and disk is the reference path; set sync.delta: false")
        if self.verify not in ("auto", "checksum", "full", "off"):
            raise ValueError(f"sync.verify must be 'auto', 'checksum', 'full' or 'off', got {self.verify!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"sync.bucket_bytes must be >= 1 (default 512 MiB = 536870912), got {self.bucket_bytes}")


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
    """A held-out evaluation through the same fleet, never through the training buffer (glue.evaluation)."""

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
