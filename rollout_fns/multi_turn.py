"""The built-in multi-turn rollout function: one environment per sample, driven turn by turn through the router.
Token-in, token-out: the engine's output ids are appended as generated and never re-encoded; only the environment's
observations are tokenized (as chat turns, loss_mask 0). Turns are spans over `response_tokens` in
`sample.metadata["turns"]`. With MoE routing replay on, each request also brings the routing of the positions the
sample has none for yet: the previous turn's last token, the observation after it and the new turn."""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

from glue.plugins import load_object
from glue.rollout.manager import RolloutContext, append_generation, score
from glue.rollout.routed_experts import fill_unrun_positions
from glue.types import Sample, SampleStatus
from rollout_fns.envs import Action, Environment, StepResult, as_step_result
from rollout_fns.text_data import TextDataTask

OBSERVATION_ROLES = ("tool", "user")


@dataclass(kw_only=True)
class EpisodeConfig:
    """The limits of one episode and how its turns are read; a multi-turn task holds one as `task.episode`."""

    max_turns: int = 4  # assistant turns per episode; an episode not done after them ends TRUNCATED
    max_total_tokens: int | None = None  # response tokens (generated + observations) per episode; null: no cap
    turn_timeout_s: float | None = None  # a generation or environment step longer than this fails its turn
    observation_role: Literal["tool", "user"] = "tool"  # the chat role text observations are templated as
    parse_action: Callable[[str], Any] | None = None  # fn(turn_text) -> Action.parsed; ValueError: a malformed turn

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"episode max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"episode max_total_tokens must be >= 1 or null, got {self.max_total_tokens}")
        if self.turn_timeout_s is not None and not self.turn_timeout_s > 0:
            raise ValueError(f"episode turn_timeout_s must be > 0 or null, got {self.turn_timeout_s}")
        if self.observation_role not in OBSERVATION_ROLES:
            raise ValueError(f"episode observation_role must be one of {OBSERVATION_ROLES}, "
                             f"got {self.observation_role!r}")
        if self.parse_action is not None and not callable(self.parse_action):
            raise ValueError(f"episode parse_action must be a function of the turn's text, got {self.parse_action!r}")


class MultiTurnTask(Protocol):
    """What `generate_group` needs of the task (`ctx.task`), besides prompts(seed) and reward(sample)."""

    episode: EpisodeConfig
    tokenizer: Any  # a HF tokenizer with a chat template (decodes turns, templates text observations), or None

    def make_env(self, prompt: dict) -> Environment:
        """A fresh environment for one episode of `prompt`."""
        ...


class ChatTurns:
    """Text observations as tokens, in the tokenizer's own chat template: what closes the assistant's turn, the
    observation's turn, and the next assistant turn's opening. Rendered once from placeholder messages, so only the
    observation text is ever tokenized."""

    ASSISTANT, OBSERVATION = "\x00assistant-turn\x00", "\x00observation\x00"

    def __init__(self, tokenizer: Any, role: str):
        self.tokenizer = tokenizer
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": self.ASSISTANT}]
        base = tokenizer.apply_chat_template(chat, tokenize=False)
        full = tokenizer.apply_chat_template(chat + [{"role": role, "content": self.OBSERVATION}], tokenize=False,
                                             add_generation_prompt=True)
        if self.ASSISTANT not in base or not full.startswith(base) or full[len(base):].count(self.OBSERVATION) != 1:
            raise ValueError(f"the chat template cannot append a {role!r} turn after an assistant turn without "
                             "re-rendering the conversation; have the environment return observation token ids")
        self.closing = base[base.index(self.ASSISTANT) + len(self.ASSISTANT):]  # e.g. "<|im_end|>\n"
        self.before, self.after = full[len(base):].split(self.OBSERVATION)

    def tokens(self, text: str, stop_token: int | None) -> list[int]:
        """The tokens to append after an assistant turn that ended with `stop_token` (None: it was cut short, so
        the template's whole closing is added)."""
        closing = self.closing
        stop_text = self.tokenizer.decode([stop_token]) if stop_token is not None else ""
        if stop_text and closing.startswith(stop_text):
            closing = closing[len(stop_text):]  # the model wrote its end-of-turn token itself
        return list(self.tokenizer(closing + self.before + text + self.after, add_special_tokens=False).input_ids)


async def generate_group(ctx: RolloutContext, prompt: dict, num_samples: int) -> list[Sample]:
    """`num_samples` concurrent episodes of `prompt`, each with its own environment from `ctx.task.make_env`."""
    task = ctx.task
    missing = [name for name in ("make_env", "episode", "tokenizer") if not hasattr(task, name)]
    if missing or not isinstance(task.episode, EpisodeConfig):
        raise TypeError(f"rollout_fns.multi_turn needs a task with make_env(prompt), an EpisodeConfig `episode` and "
                        f"a `tokenizer` (None allowed), e.g. rollout_fns.multi_turn:EnvTask; "
                        f"{type(task).__name__} lacks {missing or ['an EpisodeConfig episode']}")
    tasks = [asyncio.ensure_future(run_episode(ctx, task, prompt, i)) for i in range(num_samples)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:  # one failed episode fails the group: close the others' environments now
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def run_episode(ctx: RolloutContext, task: MultiTurnTask, prompt: dict, index: int) -> Sample:
    """One episode: reset, then generate / step turn after turn until done or a limit; scored with the task."""
    env = task.make_env(prompt)
    try:
        start = await env.reset(prompt)
        tokens = prompt["prompt_tokens"] if start is None else start
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            raise TypeError(f"environment {type(env).__name__}.reset must return None or a non-empty list of "
                            f"prompt token ids, got {str(start)[:100]}")
        sample = Sample(prompt_tokens=list(tokens), group_id=ctx.group_id, index=index,
                        metadata={k: v for k, v in prompt.items() if k != "prompt_tokens"})
        await Episode(ctx, task, sample).run(env)
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            await close()
    await score(ctx, sample)
    return sample


class Episode:
    """The bookkeeping of one episode: the sample being built, its turn spans and error counts."""

    def __init__(self, ctx: RolloutContext, task: MultiTurnTask, sample: Sample):
        self.ctx, self.cfg, self.tokenizer, self.sample = ctx, task.episode, task.tokenizer, sample
        self.meta = sample.metadata
        self.meta.update(turns=[], env_rewards=[], error_turns=0, masked_error_turns=0)
        self._chat: ChatTurns | None = None

    async def run(self, env: Environment) -> None:
        for turn in range(self.cfg.max_turns):
            if self.budget_left() == 0:
                return self.finish("max_total_tokens", SampleStatus.TRUNCATED)
            start = len(self.sample.response_tokens)
            try:
                await asyncio.wait_for(self.generate_turn(start), self.cfg.turn_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                self.truncate(start)
                self.record_turn(turn, start, None, f"generation timed out after {self.cfg.turn_timeout_s:g} s")
                return self.finish("generation_timeout", SampleStatus.TRUNCATED)
            if self.sample.status is SampleStatus.ABORTED:
                self.record_turn(turn, start, None, None)
                return self.finish("aborted", SampleStatus.ABORTED)
            stopped = self.sample.status is SampleStatus.COMPLETED
            result, error = await self.step(env, turn, self.sample.response_tokens[start:])
            self.record_turn(turn, start, float(result.reward), error)
            if result.done:
                return self.finish("done", SampleStatus.COMPLETED)
            if turn + 1 == self.cfg.max_turns:
                break
            observation = self.observation_tokens(result.observation, stopped)
            left = self.budget_left()
            if left is not None and len(observation) >= left:  # no room for the observation and a next turn
                return self.finish("max_total_tokens", SampleStatus.TRUNCATED)
            self.append_observation(turn, observation)
        self.finish("max_turns", SampleStatus.TRUNCATED)

    async def generate_turn(self, start: int) -> None:
        """Generate one assistant turn from prompt + response so far, continuing it after an abort (or, with
        partial_rollouts "restart", generating the turn again). With `ctx.routed_experts` each request asks for the
        routing from the first position the sample has none for, so the observation tokens it prefills get theirs.
        At most `ctx.max_resumes` continuations per turn."""
        for _ in range(1 + self.ctx.max_resumes):
            params = self.ctx.sampling_for(self.sample.index)
            limit = self.turn_limit(start)
            if limit is not None:
                params["max_new_tokens"] = limit
            output = await self.ctx.client.generate(self.sample.prompt_tokens + self.sample.response_tokens, params,
                                                    **self.ctx.routing_request(self.sample))
            append_generation(self.sample, output, self.ctx.routed_experts)
            if self.sample.status is not SampleStatus.ABORTED:
                return
            if self.ctx.partial_rollouts == "restart":
                discarded = len(self.sample.response_tokens) - start
                self.meta["discarded_tokens"] = self.meta.get("discarded_tokens", 0) + discarded
                self.truncate(start)
            elif self.turn_limit(start) == 0:
                self.sample.status = SampleStatus.TRUNCATED
                return
        self.meta["resume_limit_hit"] = 1  # still aborted after ctx.max_resumes continuations: given up

    async def step(self, env: Environment, turn: int, tokens: list[int]) -> tuple[StepResult, str | None]:
        """Parse the turn and step the environment; (its result, why the turn failed or None). A malformed turn,
        an environment exception or a step past turn_timeout_s is a failed turn with an "error: ..." observation."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        parsed = None
        if self.cfg.parse_action is not None:
            try:
                parsed = self.cfg.parse_action(text)
            except ValueError as err:  # the hook's way of saying the turn is malformed
                return StepResult(observation=f"error: {err}"), f"malformed action: {err}"
        action = Action(turn=turn, tokens=list(tokens), text=text, parsed=parsed)
        try:
            answer = await asyncio.wait_for(env.step(action), self.cfg.turn_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            error = f"environment step timed out after {self.cfg.turn_timeout_s:g} s"
            return StepResult(observation=f"error: {error}"), error
        except Exception as err:  # noqa: BLE001 - an environment exception fails its turn (counted), not the episode
            error = f"environment raised {type(err).__name__}: {err}"
            return StepResult(observation=f"error: {type(err).__name__}: {err}"), error
        result = as_step_result(answer, env)
        if result.error is not None and result.observation is None:
            result = StepResult(observation=f"error: {result.error}", reward=result.reward, done=result.done,
                                error=result.error)
        return result, result.error

    def record_turn(self, turn: int, start: int, reward: float | None, error: str | None) -> None:
        """Record the assistant span [start, end); a failed turn is counted and, with error masking, not trained."""
        end = len(self.sample.response_tokens)
        masked = error is not None and self.ctx.error_masking and end > start
        if error is not None:
            self.meta["error_turns"] += 1
        if masked:
            self.sample.loss_mask[start:end] = [0] * (end - start)
            self.meta["masked_error_turns"] += 1
        if reward is not None:
            self.meta["env_rewards"].append(reward)
        self.meta["turns"].append({"turn": turn, "role": "assistant", "start": start, "end": end,
                                   "versions": self.sample.versions[start:end], "reward": reward, "error": error,
                                   "masked": masked})

    def observation_tokens(self, observation: str | list[int] | None, stopped: bool) -> list[int]:
        if observation is None:
            return []
        if isinstance(observation, list):
            return list(observation)
        if self.tokenizer is None:
            raise ValueError("a text observation needs the task's tokenizer; give the task one or have the "
                             "environment return token ids")
        if self._chat is None:
            self._chat = ChatTurns(self.tokenizer, self.cfg.observation_role)
        stop_token = self.sample.response_tokens[-1] if stopped and self.sample.response_tokens else None
        return self._chat.tokens(observation, stop_token)

    def append_observation(self, turn: int, tokens: list[int]) -> None:
        """Append observation tokens untrained, at the version of the last generated token."""
        start = len(self.sample.response_tokens)
        version = self.sample.versions[-1] if self.sample.versions else 0
        self.sample.append_response(tokens, [0.0] * len(tokens), version, trainable=False)
        self.meta["turns"].append({"turn": turn, "role": self.cfg.observation_role, "start": start,
                                   "end": len(self.sample.response_tokens), "versions": [version] * len(tokens)})

    def budget_left(self) -> int | None:
        if self.cfg.max_total_tokens is None:
            return None
        return max(0, self.cfg.max_total_tokens - len(self.sample.response_tokens))

    def turn_limit(self, start: int) -> int | None:
        """max_new_tokens for the rest of the turn begun at `start`: the run's per-turn limit, within the budget."""
        limits = [self.budget_left()]
        per_turn = self.ctx.sampling_params.get("max_new_tokens")
        if per_turn is not None:
            limits.append(max(0, per_turn - (len(self.sample.response_tokens) - start)))
        limits = [n for n in limits if n is not None]
        return min(limits) if limits else None

    def truncate(self, start: int) -> None:
        """Drop the response from `start` on, with the routing rows of the positions that go (the routing of the
        tokens kept stays; the next request asks again from the first position without it)."""
        s = self.sample
        del s.response_tokens[start:], s.loss_mask[start:], s.rollout_logprobs[start:], s.versions[start:]
        if s.routed_experts is not None:
            s.routed_experts = s.routed_experts[:len(s.prompt_tokens) + start - 1]

    def finish(self, reason: str, status: SampleStatus) -> None:
        self.sample.status, self.meta["stop_reason"] = status, reason
        if self.ctx.routed_experts is not None:  # an episode may end before a request ran its last observation
            fill_unrun_positions(self.sample, self.ctx.routed_experts)


def env_return(response_text: str, label: Any, sample: Sample, *, how: str = "sum") -> float:
    """A reward function for TextDataTask-style tasks: the environment's step rewards of the episode, summed
    (`how="sum"`) or the last one (`how="last"`). EnvTask's default reward."""
    rewards = sample.metadata.get("env_rewards", [])
    if how == "sum":
        return float(sum(rewards))
    if how == "last":
        return float(rewards[-1]) if rewards else 0.0
    raise ValueError(f"env_return: how must be 'sum' or 'last', got {how!r}")


class EnvTask(TextDataTask):
    """A multi-turn task built from task_args: prompts from a data set (as TextDataTask), an environment by import
    path, built per episode with `env_args`, the episode limits, and the reward (the env's summed step rewards
    unless `reward` names another `fn(response_text, label, sample, **reward_args)`)."""

    def __init__(self, *, env: str, path: str, tokenizer: str, env_args: dict | None = None, max_turns: int = 4,
                 max_total_tokens: int | None = None, turn_timeout_s: float | None = None,
                 observation_role: str = "tool", parse_action: str | None = None,
                 reward: str = "rollout_fns.multi_turn:env_return", **data_args: Any):
        """env: import path of the environment class (or factory), called as `env(**env_args)` once per episode.
        parse_action: import path of `fn(turn_text) -> Any` (raise ValueError for a malformed turn). The other
        limits are EpisodeConfig's; path, tokenizer and the remaining keywords (system_prompt, ...) are
        TextDataTask's."""
        super().__init__(path=path, tokenizer=tokenizer, reward=reward, **data_args)
        self.env_path, self.env_args = env, dict(env_args or {})
        self.env_factory = load_object(env, what="environment")
        try:
            inspect.signature(self.env_factory).bind(**self.env_args)
        except TypeError as err:
            raise TypeError(f"environment {env!r} cannot be built with env_args {self.env_args}: {err}") from None
        hook = load_object(parse_action, what="parse_action hook") if parse_action else None
        self.episode = EpisodeConfig(max_turns=max_turns, max_total_tokens=max_total_tokens,
                                     turn_timeout_s=turn_timeout_s, observation_role=observation_role,
                                     parse_action=hook)
        if self.apply_chat_template:
            ChatTurns(self.tokenizer, observation_role)  # a template that cannot append the turn fails here

    @classmethod
    def check_args(cls, task_args: dict, *, key: str) -> None:
        """TextDataTask's check, then the environment: it imports and takes `env_args`; parse_action imports."""
        super().check_args(task_args, key=key)
        env_args = dict(task_args.get("env_args") or {})
        try:
            inspect.signature(load_object(task_args["env"], what=f"{key}.env")).bind(**env_args)
        except TypeError as err:
            raise ValueError(f"{key}.env_args: environment {task_args['env']!r} cannot be built with env_args "
                             f"{env_args}: {err}") from None
        if task_args.get("parse_action"):
            load_object(task_args["parse_action"], what=f"{key}.parse_action")

    def make_env(self, prompt: dict) -> Environment:
        return self.env_factory(**self.env_args)

