"""The `rollout:` section: the fleet's size, the rollout function and task, sampling, and how groups are run.

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
    stop: list[str] = field(default_factory=list)  # stop strings (SGLang's sampling_params.stop; slime's --rollout-stop): the engines need the model's tokenizer

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"rollout.sampling.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"rollout.sampling.stop must be a list of non-empty strings, got {self.stop!r}")

    def to_sglang(self) -> dict[str, Any]:
        """SGLang's `sampling_params` JSON object."""
        params = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "max_new_tokens": self.max_new_tokens}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            params["stop"] = list(self.stop)
        return params


DEFAULT_FUNCTION = "rollout_fns.single_turn:generate_group"
SLIME_FUNCTION = "rollout_fns.slime_functions:generate_group"  # runs rollout.slime's function (docs/rollout_functions.md)


@dataclass(kw_only=True)
class SlimeRolloutConfig:
    """slime's rollout functions, run as they are (glue.rollout.slime.adapter); paths 'pkg.module:function',
    'pkg.module.function' or 'path/to/file.py:function'."""

    generate_function: str | None = None  # slime's --custom-generate-function-path: async def generate(args, sample, sampling_params) -> Sample | list[Sample], called once per sample
    rollout_function: str | None = None  # slime's --rollout-function-path: a generate function as above, or slime's def generate_rollout(args, rollout_id, data_source, evaluation=False), called once per group (with generate_function also set it must be the latter, which finds that one in args.custom_generate_function_path, as in slime)
    max_context_len: int | None = None  # slime's --rollout-max-context-len: args.rollout_max_context_len (and eval_max_context_len), the prompt-plus-response budget slime's multi-turn functions cap their turns by; null: none, as slime's default
    eval_max_context_len: int | None = None  # slime's --eval-max-context-len: args.eval_max_context_len; null: max_context_len, as slime's default
    rm_type: str | None = None  # slime's --rm-type as the functions see it (args.rm_type); the reward itself is reward.slime.function or the task's
    over_sampling_batch_size: int | None = None  # slime's --over-sampling-batch-size as the functions see it (args.over_sampling_batch_size, prompts a rollout function submits at a time); null: prompts_per_step, as slime's default

    def __post_init__(self) -> None:
        for name in ("max_context_len", "eval_max_context_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
                raise ValueError(f"rollout.slime.{name} must be an integer >= 2 (a prompt token and a response "
                                 f"token) or null, got {value!r}")
        size = self.over_sampling_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"rollout.slime.over_sampling_batch_size must be a positive integer or null, got {size!r}")
        for name in ("generate_function", "rollout_function"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"rollout.slime.{name} must be a path like 'pkg.module:function' or "
                                 f"'path/to/file.py:function', got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.generate_function is not None or self.rollout_function is not None


@dataclass(kw_only=True)
class RolloutConfig:
    num_engines: int = 2  # inference engines behind the router
    function: str = DEFAULT_FUNCTION  # rollout function, `module:attr` (with rollout.slime set: rollout_fns.slime_functions:generate_group)
    task: str = "rollout_fns.toy_tasks:EchoTask"  # task object/class with prompts() and reward(), `module:attr`
    task_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the task class
    prompts_per_step: int = 8  # groups per training step
    samples_per_prompt: int = 8  # group size (GRPO's G)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_concurrent_groups: int | None = None  # groups generating at once (e.g. the sandboxes an agent task has); null: as many as the staleness gate admits
    buffer_order: Literal["fifo", "newest_first"] = "fifo"  # which finished groups a step takes first once those due by the staleness bound are in (newest_first surfaces fresh data)
    router_policy: str = "round_robin"  # sgl-router load-balancing policy
    engine_startup_timeout_s: float = 120.0  # an engine not healthy by then fails the run with its log tail
    group_timeout_s: float | None = 600.0  # a group still generating after this is cut and counted FAILED (said at start-up); null: no limit
    stall_warning_s: float = 60.0  # a step that has waited this long on groups says how many are outstanding, the oldest one's age, and the rollout function and task; again after 2x, 4x, ... as long
    error_masking: bool = False  # multi-turn: a failed turn (malformed tool call, tool error, environment exception) is not trained on, the turns after it are (rollout/masked_error_turns)
    max_failed_frac: float = 0.5  # the run stops when more than this share of a step's groups fail (raise or time out)
    max_engine_restarts: int = 3  # engines that die or hang are restarted this many times per run, then the run stops
    max_router_restarts: int = 3  # a router that dies or hangs is replaced on its port this many times per run, then the run stops
    health_check_interval_s: float = 10.0  # how often each engine is asked to generate a token (GET /health_generate) and the router for GET /health
    health_check_timeout_s: float = 60.0  # an engine (or the router) that fails 3 checks in a row, each waiting this long, is restarted
    dynamic_sampling: bool = False  # DAPO: a group whose rewards are all equal (no advantage) is dropped when it finishes and another prompt drawn in its place
    return_routed_experts: bool = False  # MoE routing replay (R3): the single-turn and multi-turn rollouts ask engines for the experts every token was routed to (sent to engines directly: sgl-router drops the field; the OpenAI-agent path refuses the key) and samples carry them to the train batch; SGLang engines also need sglang.enable_return_routed_experts: true
    slime: SlimeRolloutConfig = field(default_factory=SlimeRolloutConfig)  # slime's rollout functions, run unchanged
    max_filtered_frac: float = 0.9  # with dynamic_sampling, the run stops when more than this share of the groups finished while collecting a step were dropped

    def __post_init__(self) -> None:
        for name in ("num_engines", "prompts_per_step", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_concurrent_groups is not None and self.max_concurrent_groups < 1:
            raise ValueError(f"rollout.max_concurrent_groups must be >= 1 or null, got {self.max_concurrent_groups}")
        if self.buffer_order not in ("fifo", "newest_first"):
            raise ValueError(f"rollout.buffer_order must be 'fifo' or 'newest_first', got {self.buffer_order!r}")
        for name in ("max_engine_restarts", "max_router_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"rollout.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("health_check_interval_s", "health_check_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.{name} must be > 0, got {getattr(self, name)}")
        if self.group_timeout_s is not None and not self.group_timeout_s > 0:
            raise ValueError(f"rollout.group_timeout_s must be > 0 or null, got {self.group_timeout_s}")
        if not self.stall_warning_s > 0:
            raise ValueError(f"rollout.stall_warning_s must be > 0 (seconds a step waits on groups before it says "
                             f"so), got {self.stall_warning_s}")
        if not 0 <= self.max_filtered_frac < 1:
            raise ValueError(f"rollout.max_filtered_frac must be in [0, 1), got {self.max_filtered_frac} (at 1 a task "
                             "whose every group has equal rewards would draw prompts forever)")
        if not 0 <= self.max_failed_frac < 1:
            raise ValueError(f"rollout.max_failed_frac must be in [0, 1), got {self.max_failed_frac} (at 1 a task "
                             "whose every group fails would draw prompts forever)")
        if self.samples_per_prompt < 2:
            raise ValueError("rollout.samples_per_prompt must be >= 2: group-relative advantages need at least two samples")
        self._resolve_slime_function()
        for name in ("function", "task"):
            path = getattr(self, name)
            if not isinstance(path, str) or not path.replace(":", ".").replace("_", "a").replace(".", "a").isalnum():
                raise ValueError(f"rollout.{name} must be an import path like 'pkg.module:attr', got {path!r}")

    def _resolve_slime_function(self) -> None:
        """rollout.slime's function runs through rollout_fns.slime_functions, which becomes rollout.function."""
        if self.slime.enabled:
            if self.function not in (DEFAULT_FUNCTION, SLIME_FUNCTION):
                key = "generate_function" if self.slime.generate_function else "rollout_function"
                raise ValueError(f"rollout.slime.{key} is the rollout function, so rollout.function={self.function!r} "
                                 "cannot apply too; drop one of them")
            self.function = SLIME_FUNCTION
        elif self.function == SLIME_FUNCTION:
            raise ValueError(f"rollout.function={SLIME_FUNCTION} runs slime's functions: set "
                             "rollout.slime.generate_function or rollout.slime.rollout_function")
