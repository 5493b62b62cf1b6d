"""Running slime's rollout and reward functions as they are (rollout.slime.*, reward.slime.function): loaded by path,
called with slime's arguments (an `args` namespace, slime-shaped `Sample`s, the sampling_params dict), and their
samples mapped back into sluice's `Sample` with a weight version on every response token.

`SlimeFunctions` is what a run holds: `generate_group` is the rollout function's body (rollout_fns.slime_functions),
`reward` is the task-reward stand-in when only reward.slime.function is given. slime's contracts (slime
`rollout/sglang_rollout.py`, `rollout/rm_hub`): `async def generate(args, sample, sampling_params[, evaluation])
-> Sample | list[Sample]`; `def generate_rollout(args, rollout_id, data_source, evaluation=False)` returning
`RolloutFnTrainOutput` or groups of samples; `async def reward_func(args, sample, **kwargs) -> float | dict`.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import os
from typing import Any, Callable
from urllib.parse import urlparse

from glue.fleet.engine_client import weight_version_to_int
from glue.rollout.manager import score
from glue.rollout.slime import http_calls, sglang_rollout, shim, user_code, utils
from glue.rollout.slime.data_source import PromptDataSource
from glue.rollout.slime.defaults import SGLANG_DEFAULTS, SLIME_DEFAULTS, derive
from glue.rollout.slime.rollout_calls import RolloutCalls
from glue.rollout.slime.sample import checked_reward, from_prompt, from_sluice, to_sluice
from glue.types import Sample as SluiceSample, SampleStatus

def load_function(path: str, what: str) -> Callable:
    """The function at `path` (module path, or a .py file with ':function'), with slime's modules importable."""
    shim.install()
    return user_code.load_function(path, what)


def check_contract(fn: Callable, what: str, *, params: int, is_async: bool, form: str) -> None:
    """slime calls these positionally: `fn` must take at least `params` positional arguments (any more need
    defaults) and be async or plain as slime awaits it or not."""
    if not callable(fn):
        raise TypeError(f"{what}: {fn!r} is not callable; expected `{form}`")
    if inspect.iscoroutinefunction(fn) != is_async:
        kind = "an async function" if is_async else "a plain (not async) function"
        raise TypeError(f"{what}: {fn.__module__}:{fn.__qualname__} must be {kind}: `{form}`")
    positional = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_var = any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values())
    required = [p for p in positional if p.default is p.empty]
    if (len(positional) < params and not has_var) or len(required) > params:
        raise TypeError(f"{what}: {fn.__module__}:{fn.__qualname__}{inspect.signature(fn)} does not fit slime's "
                        f"`{form}`")


GENERATE_FORM = "async def generate(args, sample, sampling_params) -> Sample | list[Sample]"
ROLLOUT_FORM = "def generate_rollout(args, rollout_id, data_source, evaluation=False)"
REWARD_FORM = "async def reward_func(args, sample, **kwargs) -> float | dict"


def slime_args(*, router_url: str, model_path: str, sampling_params: dict, samples_per_prompt: int,
               prompts_per_step: int, seed: int, generate_path: str | None, reward_path: str | None,
               max_context_len: int | None = None, rm_type: str | None = None, context_parallel_size: int = 1,
               max_tokens_per_gpu: int | None = None, run_values: dict[str, Any] | None = None) -> argparse.Namespace:
    """slime's `args` as rollout and reward functions receive it: every argument of slime's parser with slime's
    default (glue.rollout.slime.defaults), under `run_values` (slime's names for what this run's config decides,
    launch.slime.namespace), under the settings given here, then what slime derives from them (an unset
    eval_max_context_len is the rollout's, ...)."""
    address = urlparse(router_url)
    values = {**SLIME_DEFAULTS, **SGLANG_DEFAULTS, **(run_values or {})}
    values.update(
        sglang_router_ip=address.hostname, sglang_router_port=address.port, hf_checkpoint=model_path,
        rollout_temperature=sampling_params.get("temperature", 1.0), rollout_top_p=sampling_params.get("top_p", 1.0),
        rollout_top_k=sampling_params.get("top_k", -1), rollout_max_response_len=sampling_params["max_new_tokens"],
        rollout_max_context_len=max_context_len, rollout_stop=sampling_params.get("stop"),
        rollout_stop_token_ids=sampling_params.get("stop_token_ids"), n_samples_per_prompt=samples_per_prompt,
        rollout_batch_size=prompts_per_step, rollout_seed=seed, custom_generate_function_path=generate_path,
        custom_rm_path=reward_path, rm_type=rm_type, context_parallel_size=context_parallel_size,
        max_tokens_per_gpu=max_tokens_per_gpu)
    return argparse.Namespace(**derive(values))


def load_slime_functions(generate_function: str | None, rollout_function: str | None, reward_function: str | None
                         ) -> tuple[Callable | None, Callable | None, Callable | None]:
    """(generate, whole-rollout, reward) functions of the rollout.slime / reward.slime keys, loaded and checked
    against slime's contracts. rollout.slime.rollout_function may name either rollout contract: an async function
    is a generate function, a plain one slime's whole-rollout function, which runs in place of the generate function
    when both are set (slime's rollout function finds that one in `args.custom_generate_function_path`)."""
    generate = rollout = reward = None
    if rollout_function is not None:
        fn = load_function(rollout_function, "rollout.slime.rollout_function")
        if inspect.iscoroutinefunction(fn) and generate_function is not None:
            raise ValueError(f"rollout.slime.rollout_function {rollout_function!r} is a generate function and "
                             f"rollout.slime.generate_function {generate_function!r} is another; keep one")
        contract = (dict(is_async=True, form=GENERATE_FORM) if inspect.iscoroutinefunction(fn)
                    else dict(is_async=False, form=ROLLOUT_FORM))
        check_contract(fn, "rollout.slime.rollout_function", params=3, **contract)
        generate, rollout = (fn, None) if contract["is_async"] else (None, fn)
    if generate_function is not None:
        fn = load_function(generate_function, "rollout.slime.generate_function")
        check_contract(fn, "rollout.slime.generate_function", params=3, is_async=True, form=GENERATE_FORM)
        generate = generate or fn
    if reward_function is not None:
        reward = load_function(reward_function, "reward.slime.function")
        check_contract(reward, "reward.slime.function", params=2, is_async=True, form=REWARD_FORM)
    return generate, rollout, reward


class SlimeFunctions:
    """A run's slime functions: the generate (or whole-rollout) function and the reward function, their `args`."""

    def __init__(self, *, client: Any, model_path: str, sampling_params: dict, samples_per_prompt: int,
                 prompts_per_step: int, seed: int, generate_function: str | None = None,
                 rollout_function: str | None = None, reward_function: str | None = None,
                 max_context_len: int | None = None, rm_type: str | None = None, context_parallel_size: int = 1,
                 max_tokens_per_gpu: int | None = None, run_values: dict[str, Any] | None = None):
        """The last four are slime's args of the same names (`slime_args`), as the run sets them."""
        self.client, self.model_path = client, model_path
        self.reward_path = reward_function
        self.generate, self.rollout, self.reward_fn = load_slime_functions(generate_function, rollout_function,
                                                                           reward_function)
        self.generate_path = rollout_function if self.rollout is not None or generate_function is None \
            else generate_function  # the function that runs, for error messages
        self.args = slime_args(router_url=getattr(client, "router_url", "http://127.0.0.1:0"), model_path=model_path,
                               sampling_params=sampling_params, samples_per_prompt=samples_per_prompt,
                               prompts_per_step=prompts_per_step, seed=seed, generate_path=generate_function,
                               reward_path=reward_function, max_context_len=max_context_len, rm_type=rm_type,
                               context_parallel_size=context_parallel_size, max_tokens_per_gpu=max_tokens_per_gpu,
                               run_values=run_values)
        self.fleet = http_calls.Fleet(router_url=getattr(client, "router_url", ""),
                                      api_key=getattr(client, "api_key", None))
        self._tokenizer: Any = None
        self._calls: RolloutCalls | None = None  # the whole-rollout function's calls, from the first group on

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (for the texts slime samples carry), or None for a model without one."""
        if self._tokenizer is None and os.path.isfile(os.path.join(self.model_path, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if tokens and self.tokenizer is not None else ""

    async def reward(self, sample: SluiceSample) -> float | dict:
        """reward.slime.function on a sluice sample (the task-reward stand-in for sluice's own rollout functions)."""
        slime_sample = from_sluice(sample, prompt_text=self.text(sample.prompt_tokens),
                                   response_text=self.text(sample.response_tokens))
        with http_calls.serving(self.fleet):
            return checked_reward(await self.reward_fn(self.args, slime_sample), self._reward_where)

    @property
    def _reward_where(self) -> str:
        return f"reward.slime.function {self.reward_path!r}"

    async def generate_group(self, ctx: Any, prompt: dict, num_samples: int) -> list[SluiceSample]:
        """One group: the next one the whole-rollout function's calls return (glue.rollout.slime.rollout_calls), or
        the generate function once per sample (concurrently). Eval groups (negative ids, glue.loop.evaluation) are
        generated per sample, as slime's eval runs each prompt through generate_and_rm: by the generate function,
        else slime's default `generate`."""
        fallback = asyncio.ensure_future(self._fleet_version())  # awaited only for a sample with no version known
        try:
            with http_calls.serving(self.fleet):
                samples = await (self._from_rollout_calls(ctx, prompt, fallback)
                                 if self.rollout is not None and ctx.group_id >= 0
                                 else self._samples(ctx, prompt, num_samples, fallback))
                for index, sample in enumerate(samples):
                    sample.index = index
                await asyncio.gather(*(self._score(ctx, s) for s in samples))
        finally:
            fallback.cancel()
        return samples

    def close(self) -> None:
        """At the run's end: the whole-rollout function's last call may finish, then its exit hooks run, then the
        background loop of `slime.utils.async_utils.run` stops, if a function started it."""
        if self._calls is not None:
            self._calls.close()
        if not utils.stop_async_loop():
            print("sluice: slime.utils.async_utils.run's loop still runs a coroutine that ignored cancellation; its "
                  "thread is left to the process's exit", flush=True)

    async def _samples(self, ctx: Any, prompt: dict, num_samples: int, fallback: asyncio.Future
                       ) -> list[SluiceSample]:
        tasks = [asyncio.ensure_future(self._sample(ctx, prompt, i, fallback)) for i in range(num_samples)]
        try:
            return [s for done in await asyncio.gather(*tasks) for s in done]
        except BaseException:
            for task in tasks:  # one failed sample fails the group: stop the others' calls too
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _sample(self, ctx: Any, prompt: dict, index: int, fallback: asyncio.Future) -> list[SluiceSample]:
        """One sample generated by the user's function; an aborted one is generated again from the prompt (slime
        without partial rollout) at most `ctx.max_resumes` times."""
        discarded = 0
        for attempt in range(1 + ctx.max_resumes):
            fresh = from_prompt(prompt, text=self.text(prompt["prompt_tokens"]), group_id=ctx.group_id, index=index)
            with http_calls.recording() as record:
                out = await self._call_generate(fresh, {**ctx.sampling_for(index), **shim.SLIME_TEXT_PARAMS},
                                                evaluation=ctx.group_id < 0)
            outs = out if isinstance(out, list) else [out]
            if not any(_status_of(s) == "aborted" for s in outs) or attempt == ctx.max_resumes:
                break
            discarded += sum(int(s.response_length or 0) for s in outs)
        samples = [await self._to_sluice(s, record.calls, ctx.group_id, index, fallback) for s in outs]
        for sample in samples:
            if discarded:
                sample.metadata["discarded_tokens"] = discarded
            if sample.status is SampleStatus.ABORTED:
                sample.metadata["resume_limit_hit"] = 1
        return samples

    async def _call_generate(self, sample: Any, sampling_params: dict, evaluation: bool) -> Any:
        generate = self.generate or sglang_rollout.generate  # eval groups of a whole-rollout function: slime's default
        if "evaluation" in inspect.signature(generate).parameters:
            out = await generate(self.args, sample, sampling_params, evaluation=evaluation)
        else:
            out = await generate(self.args, sample, sampling_params)
        if out is None or (isinstance(out, list) and not out):
            raise TypeError(f"rollout.slime function {self.generate_path!r} returned {out!r}; return the sample "
                            "(or a list of samples)")
        return out

    async def _from_rollout_calls(self, ctx: Any, prompt: dict, fallback: asyncio.Future) -> list[SluiceSample]:
        if self._calls is None:
            source = PromptDataSource(samples_per_prompt=self.args.n_samples_per_prompt, draw=ctx.draw_prompt,
                                      to_sample=self._fresh_sample)
            self._calls = RolloutCalls(self.rollout, self.args, source, fleet=self.fleet,
                                       where=f"rollout.slime.rollout_function {self.generate_path!r}")
        group, answers = await self._calls.next_group(prompt)
        return [await self._to_sluice(s, answers, ctx.group_id, i, fallback) for i, s in enumerate(group)]

    def _fresh_sample(self, prompt: dict, group_index: int, index: int) -> Any:
        return from_prompt(prompt, text=self.text(prompt["prompt_tokens"]), group_id=group_index, index=index)

    async def _to_sluice(self, sample: Any, calls: list, group_id: int, index: int, fallback: asyncio.Future
                         ) -> SluiceSample:
        where = f"slime function {self.generate_path!r}"
        versions, unrecorded = token_versions(sample, calls), 0
        if versions is None:  # nothing recorded: the engines' version when the group started, for every token
            start, unrecorded = await fallback, int(sample.response_length)
            if start is None:
                raise ValueError(f"{where}: no weight version is known for the response tokens; post /generate "
                                 "with slime.utils.http_utils.post or pass the answer's meta_info to "
                                 "append_response_tokens")
            versions = [start] * unrecorded
        if self.reward_fn is not None and sample.reward is None and _status_of(sample) != "failed":
            sample.reward = checked_reward(await self.reward_fn(self.args, sample), self._reward_where)
        converted = to_sluice(sample, versions=versions, group_id=group_id, index=index, where=where)
        if unrecorded:
            converted.metadata["unrecorded_version_tokens"] = unrecorded
        return converted

    async def _score(self, ctx: Any, sample: SluiceSample) -> None:
        """A sample the functions left unscored gets the task's reward (0 for a FAILED one)."""
        if sample.reward is not None:
            return
        if sample.status is SampleStatus.FAILED:
            sample.reward = 0.0
            return
        await score(ctx, sample)

    async def _fleet_version(self) -> int | None:
        """The oldest weight version the engines hold now (None if they cannot say): the version of tokens no
        recorded answer covers."""
        versions = getattr(self.client, "weight_versions", None)
        if versions is None:
            return None
        try:
            held = await asyncio.get_running_loop().run_in_executor(None, versions)
        except Exception:  # noqa: BLE001 - an engine down now fails only the samples that need this version
            return None
        return min((weight_version_to_int(v) for v in held), default=None)


def _status_of(sample: Any) -> str:
    return getattr(sample.status, "value", sample.status)


def token_versions(sample: Any, calls: list) -> list[int] | None:
    """The weight version of each response token, or None when none is known. Sources, first wins: the versions
    `append_response_tokens(meta_info=...)` stamped; the recorded /generate answers whose output sits where the
    answer's input ended; for tokens neither covers (tool output) the nearest generated token's version before
    them, else after them."""
    tokens, n = list(sample.tokens or []), int(sample.response_length or 0)
    start = len(tokens) - n
    stamped = list(getattr(sample, "token_versions", None) or [])
    versions: list[int | None] = stamped if len(stamped) == n else [None] * n
    for call in calls:
        at, k = call.input_len - start, len(call.output_ids)
        if k and 0 <= at and at + k <= n and tokens[start + at:start + at + k] == call.output_ids \
                and all(v is None for v in versions[at:at + k]):
            versions[at:at + k] = call.versions
    known = [i for i, v in enumerate(versions) if v is not None]
    if not known:
        return None if n else []
    filled, last = [], versions[known[0]]
    for v in versions:
        last = v if v is not None else last
        filled.append(last)
    return filled
