"""The rollout manager: each step draws prompts from the task, runs the user's rollout function once per prompt
(all groups concurrently, generation through the router), and hands validated `Group`s to the controller.
Also the helpers a rollout function uses to turn SGLang's /generate answer into `Sample` fields."""
from __future__ import annotations

import asyncio
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator

from glue.fleet.engine_client import EngineHTTPError, GenerateClient, weight_version_to_int
from glue.plugins import check_signature, load_object
from glue.rollout.errors import RolloutErrors
from glue.rollout.routed_experts import RoutedExpertsLayout, append_routed_experts, lost_routing, start_len_for
from glue.types import Group, Sample, SampleStatus

ROLLOUT_FUNCTION_PARAMS = ["ctx", "prompt", "num_samples"]
FINISH_REASON_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
REWARD_THREADS = 8  # plain (non-async) reward functions scored at once, off the event loop
_reward_threads: ThreadPoolExecutor | None = None
_reward_threads_lock = threading.Lock()


@dataclass(kw_only=True)
class RolloutContext:
    """What a rollout function gets besides the prompt: see rollout_fns/__init__.py for the contract."""

    client: GenerateClient  # `await client.generate(input_ids, sampling_params)` through the router
    sampling_params: dict  # SGLang sampling_params for this run (a copy per group: safe to modify)
    reward_fn: Callable[[Sample], float | dict | Awaitable[float | dict]]  # the task's reward
    group_id: int  # id of the group being generated; put it on every sample
    partial_rollouts: str = "resume"  # an aborted generation: "resume" from the tokens so far, or "restart" it
    # an aborted generation is continued at most this many times (`resume_limit`); one still aborted then is given up
    # (status ABORTED, metadata["resume_limit_hit"] = 1: counted in rollout/resume_limit_drops)
    max_resumes: int = 8
    seed: int | None = None  # set in deterministic mode (run.deterministic): the group's sampling seed
    error_masking: bool = False  # rollout.error_masking: a failed agent turn's tokens get loss_mask 0 (multi_turn)
    task: Any = None  # the task object, for rollout functions that need more than its reward (multi_turn's make_env)
    routed_experts: RoutedExpertsLayout | None = None  # rollout.return_routed_experts: ask for MoE routing (R3)
    resumed: dict[int, Sample] = field(default_factory=dict)  # sample index -> its tokens so far, after a resume
    tracked: dict[int, Sample] = field(default_factory=dict)  # what `track` registered: checkpointed while in flight
    slime: Any = None  # rollout.slime / reward.slime: the run's glue.rollout.slime.adapter.SlimeFunctions, else None
    # the task's next prompt beyond this group's, from any thread (slime's data source draws more when a function
    # asks for more groups than the steps admitted); None where no more can be drawn (evaluation)
    draw_prompt: Callable[[], dict] | None = None
    judge: Any = None  # the run's LLM judge (judge: section, glue.rewards.judge.Judge): `await ctx.judge.judge(SampleText(...))`; None without one
    # reward.on_error: a reward function that raises fails its sample ("fail_sample": FAILED, the group trains on
    # the rest) or the whole group ("fail_group": `score` raises)
    reward_on_error: str = "fail_group"
    errors: RolloutErrors = field(default_factory=RolloutErrors)  # where a failure is reported (console, log file)

    def track(self, sample: Sample) -> Sample:
        """Register a sample being generated, so a checkpoint taken while its group is in flight keeps its tokens
        so far (`resumed` hands them back after a restart; continue from `sample.prompt_tokens +
        sample.response_tokens`). Returns the sample."""
        self.tracked[sample.index] = sample
        return sample

    def sampling_for(self, index: int) -> dict:
        """The sampling_params for sample `index` of this group: a copy, with SGLang's per-request
        `sampling_seed` in deterministic mode (then the same sample draws the same tokens in every run, and when
        continued from its partial tokens)."""
        params = dict(self.sampling_params)
        if self.seed is not None:
            params["sampling_seed"] = (self.seed * 1_000_003 + index) % (2**31 - 1)
        return params

    def routing_request(self, sample: Sample) -> dict[str, int]:
        """Extra keyword arguments for `client.generate` continuing `sample`: with routing replay on, the first
        position whose MoE routing the answer must bring (`routed_experts_start_len`); none otherwise."""
        return {} if self.routed_experts is None else {"routed_experts_start_len": start_len_for(sample)}


def resume_limit(max_staleness: int) -> int:
    """How often a run continues an aborted generation (`RolloutContext.max_resumes`): each of the
    `max_staleness + 1` versions a group may live through can pause it twice, for its sync and for a checkpoint. A
    sample that spans more syncs holds tokens too stale to train anyway, so the limit never drops a long answer that
    could still be trained (a fixed limit dropped exactly the longest ones)."""
    return 2 * (max_staleness + 1)


async def score(ctx: RolloutContext, sample: Sample) -> None:
    """Set `sample.reward` from the task's reward function. An async one runs on the event loop; a plain function
    runs on one of `REWARD_THREADS` threads, so a slow verifier (Math-Verify, a sandbox call) never stalls the
    other groups' generation, and must therefore be safe to call from several threads at once. A reward function
    that raises is reported with its traceback (`ctx.errors`); with `ctx.reward_on_error == "fail_sample"` the
    sample is marked FAILED (metadata "error", "reward_error") instead of the error failing the group."""
    try:
        await _score(ctx, sample)
    except Exception as err:  # noqa: BLE001 - reward.on_error fail_sample: a verifier bug costs its sample
        if ctx.reward_on_error != "fail_sample":
            raise
        where = f"reward function {_name(ctx.reward_fn)}"
        line = ctx.errors.record(err, where=where, group_id=ctx.group_id, sample_index=sample.index)
        sample.status, sample.reward = SampleStatus.FAILED, None
        sample.metadata.update(error=line, reward_error=1)


async def _score(ctx: RolloutContext, sample: Sample) -> None:
    if inspect.iscoroutinefunction(ctx.reward_fn):
        reward = await ctx.reward_fn(sample)
    else:
        reward = await asyncio.get_running_loop().run_in_executor(reward_threads(), ctx.reward_fn, sample)
        if inspect.isawaitable(reward):
            reward = await reward
    sample.reward = reward


def reward_threads() -> ThreadPoolExecutor:
    """The threads plain reward functions run on (started on first use, shared by every loop of the process)."""
    global _reward_threads
    with _reward_threads_lock:
        if _reward_threads is None:
            _reward_threads = ThreadPoolExecutor(max_workers=REWARD_THREADS, thread_name_prefix="reward")
        return _reward_threads


def append_generation(sample: Sample, output: dict, routed_experts: RoutedExpertsLayout | None = None) -> None:
    """Append one /generate answer to `sample`: response tokens, their rollout logprobs, the weight version of
    each token (SGLang's `meta_info.weight_versions` spans when present, else `meta_info.weight_version`, counted
    in `metadata["single_version_answers"]`: right only for an answer no weight change split, which `EngineClient`
    checks and other clients may not), the status from `meta_info.finish_reason`, and with a `routed_experts`
    layout the MoE routing of the positions the answer ran (`meta_info.routed_experts`, asked for with `RolloutContext.routing_request`). An aborted answer
    without that routing (SGLang's abort from its waiting queue) adds nothing: the sample stays aborted and its
    tokens are generated again (`metadata["aborts_without_routing"]`, `metadata["discarded_tokens"]`)."""
    tokens = list(output.get("output_ids") or [])
    meta = output.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError(f"engine answer has no meta_info object: {str(output)[:300]}")
    if routed_experts is not None and lost_routing(meta):  # its tokens are generated again, routing and all
        if tokens:
            sample.metadata["aborts_without_routing"] = sample.metadata.get("aborts_without_routing", 0) + 1
            sample.metadata["discarded_tokens"] = sample.metadata.get("discarded_tokens", 0) + len(tokens)
        sample.status = SampleStatus.ABORTED
        return
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError("engine answer has no meta_info.output_token_logprobs; call generate with return_logprob=True")
    if len(entries) != len(tokens):
        raise ValueError(f"engine answer: {len(entries)} output_token_logprobs for {len(tokens)} output_ids")
    if any(int(e[1]) != t for e, t in zip(entries, tokens)):
        raise ValueError("engine answer: output_token_logprobs token ids differ from output_ids")
    logprobs = [float(e[0]) for e in entries]
    if tokens and not meta.get("weight_versions"):  # stamped from the answer's one version: counted, not hidden
        sample.metadata["single_version_answers"] = sample.metadata.get("single_version_answers", 0) + 1
    for version, start, end in _version_spans(meta, len(tokens)):
        sample.append_response(tokens[start:end], logprobs[start:end], version)
    if routed_experts is not None:
        append_routed_experts(sample, meta, routed_experts, new_tokens=len(tokens))
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in FINISH_REASON_STATUS:
        raise ValueError(f"engine answer: unknown meta_info.finish_reason {finish!r}; expected type stop, length or abort")
    sample.status = FINISH_REASON_STATUS[kind]


def _version_spans(meta: dict, n: int) -> list[tuple[int, int, int]]:
    """[(version, start, end)] covering response tokens [0, n)."""
    spans = meta.get("weight_versions")
    if spans:
        out = [(weight_version_to_int(s["version"]), int(s["start"]), min(int(s["end"]), n)) for s in spans]
        covered = [i for _, a, b in out for i in range(a, b)]
        if covered != list(range(n)):
            raise ValueError(f"engine answer: meta_info.weight_versions spans {spans} do not cover the {n} tokens")
        return out
    if "weight_version" not in meta:
        raise ValueError("engine answer has no meta_info.weight_version; sluice needs it to track staleness")
    # One version for the whole answer: the client refuses answers a sync may have split (EngineClient.generate);
    # append_generation counts these answers (rollout/single_version_answers).
    return [(weight_version_to_int(meta["weight_version"]), 0, n)]


class RolloutManager:
    """Loads the rollout function and the task by import path, then `await generate_step()` once per step."""

    def __init__(self, *, function_path: str, task_path: str, client: GenerateClient, sampling_params: dict,
                 prompts_per_step: int, samples_per_prompt: int, seed: int, task_args: dict | None = None,
                 partial_rollouts: str = "resume", group_timeout_s: float | None = None, max_resumes: int = 8,
                 deterministic: bool = False, error_masking: bool = False,
                 routed_experts: RoutedExpertsLayout | None = None,
                 reward_shaping: Callable[[list[Sample]], None] | None = None,
                 group_rewards: Callable[[list[Sample]], Awaitable[None]] | None = None,
                 reward_on_error: str = "fail_sample", errors: RolloutErrors | None = None,
                 reward_fn: Callable[[Sample], Any] | None = None, slime: Any = None):
        self.function_path, self.task_path = function_path, task_path
        self.fn = load_object(function_path, what="rollout function")
        check_signature(self.fn, ROLLOUT_FUNCTION_PARAMS, what=f"rollout function {function_path!r}")
        self.task = build_task(task_path, task_args or {})
        self.client, self.sampling_params = client, dict(sampling_params)
        self.prompts_per_step, self.samples_per_prompt = prompts_per_step, samples_per_prompt
        self.partial_rollouts, self.group_timeout_s = partial_rollouts, group_timeout_s
        self.max_resumes = max_resumes  # RolloutContext.max_resumes of every group
        self.seed, self.deterministic = seed, deterministic
        self.error_masking = error_masking
        self.routed_experts = routed_experts  # rollout.return_routed_experts: the model's routing layout, or None
        self.reward_shaping = reward_shaping  # reward: section (glue.rewards.shaping), applied to each scored group
        self.group_rewards = group_rewards  # judge: / reward_model: (glue.rewards.models), awaited on each group first
        self.reward_on_error = reward_on_error  # reward.on_error: "fail_sample" or "fail_group"
        self.errors = errors if errors is not None else RolloutErrors()  # console + rollout_errors.log
        self.reward_fn = reward_fn or self.task.reward  # the task's reward, unless reward.slime.function replaces it
        self.slime = slime  # rollout.slime / reward.slime: glue.rollout.slime.adapter.SlimeFunctions, or None
        self._prompts: Iterator[dict] = iter(self.task.prompts(seed))
        self._drawing = threading.Lock()  # next_group on the event loop, `draw_prompt` from a function's thread
        self._next_group_id = 0
        self._reissue: list[tuple[int, dict]] = []  # (group id, prompt) to issue again after a resume
        self._resumed: dict[int, dict[int, Sample]] = {}  # group id -> its checkpointed partial samples by index
        self._contexts: dict[int, RolloutContext] = {}  # groups whose rollout function is running

    def next_group(self) -> tuple[int, Awaitable[Group]]:
        """The next prompt's group id and the coroutine that generates and scores its group (groups to re-issue
        after a resume first, with their original ids)."""
        if self._reissue:
            group_id, prompt = self._reissue.pop(0)
            return group_id, self._generate_group(group_id, prompt)
        group_id, self._next_group_id = self._next_group_id, self._next_group_id + 1
        return group_id, self._generate_group(group_id, self._next_prompt())

    @property
    def groups_drawn(self) -> int:
        """Prompts taken from the task so far (group ids 0 .. groups_drawn - 1): the task's cursor."""
        return self._next_group_id

    def partial_samples(self, group_ids: list[int]) -> dict[int, list[dict]]:
        """The samples with tokens that the rollout functions of these in-flight groups registered with `ctx.track`,
        as dicts (for a checkpoint): tokens, logprobs and versions so far."""
        held = {gid: [s.to_dict() for s in self._contexts[gid].tracked.values() if s.response_tokens]
                for gid in group_ids if gid in self._contexts}
        return {gid: samples for gid, samples in held.items() if samples}

    def resume(self, groups_drawn: int, reissue: list[int], partial: dict[int, list[dict]] | None = None) -> None:
        """Continue a checkpointed run: skip the `groups_drawn` prompts it took (the task's prompts are seeded, so
        they are the same ones) and issue the groups in `reissue` again first, the ones drawn but never trained,
        with the partial samples checkpointed for them (`ctx.resumed`)."""
        self._resumed = {int(gid): {d["index"]: Sample.from_dict(d) for d in samples}
                         for gid, samples in (partial or {}).items()}
        pending = set(reissue)
        self._prompts, self._next_group_id, self._reissue = iter(self.task.prompts(self.seed)), 0, []
        for group_id in range(groups_drawn):
            prompt = self._next_prompt()
            if group_id in pending:
                self._reissue.append((group_id, prompt))
        self._next_group_id = groups_drawn

    async def generate_step(self) -> list[Group]:
        """`prompts_per_step` groups, all concurrent (tests and tools; the loop streams groups with next_group)."""
        coros = [self.next_group()[1] for _ in range(self.prompts_per_step)]
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:  # one failed group fails the step: do not leave the others generating
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def draw_prompt(self) -> dict:
        """The task's next prompt, from any thread (`RolloutContext.draw_prompt`)."""
        return self._next_prompt()

    def _next_prompt(self) -> dict:
        try:
            with self._drawing:
                prompt = next(self._prompts)
        except StopIteration:
            raise RuntimeError(f"task {self.task_path!r} ran out of prompts; make prompts(seed) yield more "
                               "(or loop over the data set)") from None
        tokens = prompt.get("prompt_tokens") if isinstance(prompt, dict) else None
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"task {self.task_path!r}: each prompt must be a dict with a non-empty list of int "
                             f"'prompt_tokens', got {str(prompt)[:200]}")
        return prompt

    async def _generate_group(self, group_id: int, prompt: dict) -> Group:
        """Run the rollout function for one prompt. If it raises, returns something that is not a group of valid
        samples, or runs past `group_timeout_s`, the group comes back with every sample FAILED and `error` set
        (reported by `self.errors`: the traceback on the console for the first of its kind, every one in the
        log): one bad group does not end the run. So does a group whose reward failures (reward.on_error
        fail_sample) left fewer than two samples to train."""
        where = f"rollout function {self.function_path!r} (task {self.task_path!r}, group {group_id})"
        try:
            samples = await asyncio.wait_for(self._run_function(group_id, prompt, where), self.group_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            line = f"{where} timed out after rollout.group_timeout_s={self.group_timeout_s:g} s"
            self.errors.record_line(line, group_id=group_id, kind="group_timeout")
            return self._failed(group_id, prompt, line)
        except Exception as err:  # noqa: BLE001 - any error of user code fails its group, not the run
            line = self.errors.record(err, where=where, group_id=group_id)
            return self._failed(group_id, prompt, line, lost=is_fleet_error(err))
        reward_failures = sum(1 for s in samples if s.metadata.get("reward_error"))
        left = sum(1 for s in samples if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED))
        if reward_failures and left < 2:
            line = (f"{where}: {reward_failures} of its {len(samples)} rewards failed, leaving {left} sample(s) to "
                    "train (a group needs two); first: " + next(s.metadata["error"] for s in samples
                                                              if s.metadata.get("reward_error")))
            self.errors.record_line(line, group_id=group_id, kind="too_few_scored")
            return self._failed(group_id, prompt, line)
        empty = sum(1 for s in samples if not s.response_tokens
                    and s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED))
        if empty:
            self.errors.warn_empty(group_id, empty)
        return Group(group_id=group_id, samples=samples)

    async def _run_function(self, group_id: int, prompt: dict, where: str) -> list[Sample]:
        ctx = RolloutContext(client=self.client, sampling_params=dict(self.sampling_params),
                             reward_fn=self.reward_fn, group_id=group_id, partial_rollouts=self.partial_rollouts,
                             max_resumes=self.max_resumes,
                             seed=(self.seed * 1_000_003 + group_id) % (2**31 - 1) if self.deterministic else None,
                             error_masking=self.error_masking, task=self.task, routed_experts=self.routed_experts,
                             resumed=self._resumed.pop(group_id, {}),
                             judge=getattr(self.group_rewards, "judge", None), slime=self.slime,
                             draw_prompt=self.draw_prompt,
                             reward_on_error=self.reward_on_error, errors=self.errors)
        self._contexts[group_id] = ctx
        try:
            return await self._call_function(ctx, prompt)
        finally:
            self._contexts.pop(group_id, None)

    async def _call_function(self, ctx: RolloutContext, prompt: dict) -> list[Sample]:
        samples = await self.fn(ctx, prompt, self.samples_per_prompt)
        if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
            raise TypeError(f"must return a list of glue.types.Sample, got {_describe(samples)}")
        if len(samples) < self.samples_per_prompt:  # more is fine: an agent run may split into several trajectories
            raise ValueError(f"returned {len(samples)} samples; expected at least num_samples="
                             f"{self.samples_per_prompt} (mark failed ones status=FAILED instead of dropping them)")
        for index, sample in enumerate(samples):
            sample.group_id, sample.index = ctx.group_id, index
            sample.validate()
        if self.group_rewards is not None:
            await self.group_rewards(samples)
        if self.reward_shaping is not None:
            self.reward_shaping(samples)
        return samples

    def _failed(self, group_id: int, prompt: dict, error: str, lost: bool = False) -> Group:
        first_line = (error.strip().splitlines() or [""])[0]
        samples = [Sample(prompt_tokens=list(prompt["prompt_tokens"]), group_id=group_id, index=i,
                          status=SampleStatus.FAILED, metadata={"error": first_line})
                   for i in range(self.samples_per_prompt)]
        return Group(group_id=group_id, samples=samples, error=first_line, lost=lost)


def is_fleet_error(err: BaseException) -> bool:
    """Did generation fail because no engine could serve it (connection lost, the router's 5xx), as opposed to
    the rollout function or task failing? Such samples count as lost (`rollout/lost_samples`)."""
    import aiohttp

    for _ in range(8):  # the error and what it was raised from
        if isinstance(err, (ConnectionError, aiohttp.ClientError)) or (
                isinstance(err, EngineHTTPError) and err.status >= 500):
            return True
        err = err.__cause__ or err.__context__
        if err is None:
            return False
    return False


def build_task(task_path: str, task_args: dict) -> Any:
    """A task is a class (instantiated with task_args) or a ready object with prompts(seed) and reward(sample)."""
    obj = load_object(task_path, what="task")
    if inspect.isclass(obj):
        try:
            obj = obj(**task_args)
        except TypeError as err:
            raise TypeError(f"task {task_path!r}: cannot build it from task_args {task_args}: {err}") from err
    elif task_args:
        raise ValueError(f"task {task_path!r} is an object, not a class, so task_args {task_args} cannot apply; "
                         "remove task_args or point the path at the class")
    missing = [m for m in ("prompts", "reward") if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(f"task {task_path!r} lacks {missing}; a task needs prompts(seed) -> Iterator[dict] and "
                        "reward(sample) -> float")
    return obj


def _name(fn: Any) -> str:
    """`module:qualname` of a function or bound method, for messages."""
    target = getattr(fn, "__func__", fn)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(fn).__name__)}"


def _describe(value: Any) -> str:
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(kinds) or 'nothing'}"
    return type(value).__name__
