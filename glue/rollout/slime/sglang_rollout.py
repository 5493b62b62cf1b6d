"""`slime.rollout.sglang_rollout` for slime's functions where slime is not installed: `GenerateState`, `generate`,
`generate_and_rm`, `generate_and_rm_group` with slime's semantics (slime `rollout/sglang_rollout.py`), and its default
whole-rollout function `generate_rollout`. Generation goes through the router with `slime.utils.http_utils.post`
(glue.rollout.slime.http_calls.post: the run's API key, the answers recorded for their weight versions); rewards through
`slime.rollout.rm_hub`, looked up when a reward is due, as slime's functions import it."""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import uuid
from typing import Any, Callable, Iterator

from glue.rollout.slime.http_calls import post
from glue.rollout.slime.sample import RolloutFnTrainOutput, Sample
from glue.rollout.slime.user_code import load_function


class GenerateState:
    """slime's per-process generation state: the tokenizer of `args.hf_checkpoint`, the run's `sampling_params`,
    the `semaphore` that caps requests in flight (`args.sglang_server_concurrency`), and the flags of a rollout in
    progress: `aborted` (set: generation stops, what is running returns ABORTED), `remaining_batch_size` and
    `pendings` (the group tasks a rollout submitted). One per process, as slime's singleton; a new `args` (a new
    sluice run in the same process) makes a new one."""

    _instance: "GenerateState | None" = None

    def __new__(cls, args: Any) -> "GenerateState":
        if cls._instance is None or cls._instance.args is not args:
            from transformers import AutoTokenizer

            state = super().__new__(cls)
            state.args = args
            state.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
            state.processor = None
            state.semaphore = asyncio.Semaphore(args.sglang_server_concurrency)
            state.sampling_params = dict(
                temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
                max_new_tokens=args.rollout_max_response_len, stop=args.rollout_stop,
                stop_token_ids=args.rollout_stop_token_ids, skip_special_tokens=args.rollout_skip_special_tokens,
                no_stop_trim=True, spaces_between_special_tokens=False)
            if args.sglang_enable_deterministic_inference:
                state.group_sampling_seeds = [args.rollout_seed + i for i in range(args.n_samples_per_prompt)]
            state.dp_rank = 0
            state.reset()
            cls._instance = state
        return cls._instance

    def __init__(self, args: Any) -> None:
        pass

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        """slime balances requests over an engine's DP ranks; behind sgl-router that is the router's job: rank 0."""
        yield self.dp_rank

    def submit_generate_tasks(self, samples: list[list[Sample]]) -> None:
        """One `generate_and_rm_group` task per group, in `pendings`."""
        for group in samples:
            self.pendings.add(asyncio.create_task(
                generate_and_rm_group(self.args, group, sampling_params=self.sampling_params.copy())))
        self.remaining_batch_size += len(samples)


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    """slime's default generate: one /generate call continuing `sample.tokens` (the prompt's tokens from
    `sample.prompt` when it has none), `max_new_tokens` less what the sample already holds (0 left: TRUNCATED)."""
    state = GenerateState(args)
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"generate: sample status is {sample.status}; slime generates PENDING or ABORTED samples")
    prompt_ids = list(sample.tokens) if sample.tokens else \
        state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    sampling_params["max_new_tokens"] -= sample.response_length  # on the caller's dict, as slime does
    if sampling_params["max_new_tokens"] < 0:
        raise ValueError(f"generate: max_new_tokens {sampling_params['max_new_tokens']} is below 0")
    if sampling_params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    if not sample.tokens:
        sample.tokens = prompt_ids
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True})
    entries = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(args, tokens=[e[1] for e in entries], log_probs=[e[0] for e in entries],
                                  trainable=True, meta_info=output["meta_info"], text=output["text"])
    return sample


def rm_hub() -> Any:
    """slime.rollout.rm_hub, as the run has it (slime's own, or sluice's stand-in)."""
    return importlib.import_module("slime.rollout.rm_hub")


async def generate_and_rm(args: Any, sample: Sample, sampling_params: dict, evaluation: bool = False
                          ) -> Sample | list[Sample]:
    """Generate one sample (the sample's `generate_function_path`, else `args.custom_generate_function_path`, else
    `generate`) and score it with rm_hub's `async_rm` (`batched_async_rm` for a list), as slime does: a finished
    sample is returned as it is, an aborted one unscored, and with `args.group_rm` the group is scored later."""
    if args.partial_rollout and args.mask_offpolicy_in_partial_rollout and sample.response_length > 0:
        sample.loss_mask = [0] * sample.response_length
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        path = sample.generate_function_path or args.custom_generate_function_path
        fn = generate if path is None else _generate_function(path)
        if "evaluation" in inspect.signature(fn).parameters:
            sample = await fn(args, sample, sampling_params, evaluation=evaluation)
        else:
            sample = await fn(args, sample, sampling_params)
    if args.group_rm:
        return sample
    samples = sample if isinstance(sample, list) else [sample]
    if any(s.status == Sample.Status.ABORTED for s in samples):
        return sample
    unscored = [s for s in samples if s.reward is None]
    if isinstance(sample, list) and unscored:
        for s, reward in zip(unscored, await rm_hub().batched_async_rm(args, unscored)):
            s.reward = reward
    elif unscored:
        sample.reward = await rm_hub().async_rm(args, sample)
    return sample


_generate_functions: dict[str, Callable] = {}  # loaded once per path, not once per sample


def _generate_function(path: str) -> Callable:
    if path not in _generate_functions:
        _generate_functions[path] = load_function(path, "args.custom_generate_function_path")
    return _generate_functions[path]


async def generate_and_rm_group(args: Any, group: list[Sample], sampling_params: dict, evaluation: bool = False
                                ) -> list[Sample] | list[list[Sample]]:
    """A group's samples generated and scored concurrently (`generate_and_rm`, each with its own copy of
    `sampling_params` and a session id); with `args.group_rm` the group is scored as a whole afterwards. While
    `GenerateState.aborted` is set the group comes back as it was given."""
    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    tasks = []
    for index, sample in enumerate(group):
        params = sampling_params.copy()
        if args.sglang_enable_deterministic_inference:
            params["sampling_seed"] = state.group_sampling_seeds[index]
        tasks.append(asyncio.create_task(generate_and_rm(args, sample, params, evaluation=evaluation)))
    group = list(await asyncio.gather(*tasks))
    if not state.aborted and args.group_rm:
        for sample, reward in zip(group, await rm_hub().batched_async_rm(args, group)):
            sample.reward = reward
    return group


async def generate_rollout_async(args: Any, rollout_id: int, data_source: Any) -> list[list[Sample]]:
    """`args.rollout_batch_size` groups from `data_source`, generated and scored concurrently, ordered by their
    first sample's index as slime orders them. A group that comes back with an aborted sample (a weight sync's
    abort-mode pause) is submitted again, its aborted samples continued, at most `ABORTED_RESUBMITS` times."""
    state = GenerateState(args)
    done: list[list[Sample]] = []
    try:
        state.submit_generate_tasks(data_source.get_samples(args.rollout_batch_size))
        while len(done) < args.rollout_batch_size:
            finished, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
            for group in (task.result() for task in finished):
                if _should_continue(group) and not state.aborted:
                    state.submit_generate_tasks([group])
                else:
                    done.append(group)
    finally:
        for task in state.pendings:
            task.cancel()
        state.reset()
    return sorted(done, key=lambda group: _first(group).index)


ABORTED_RESUBMITS = 8  # times one group is submitted again for its aborted samples, in one rollout call


def _should_continue(group: list) -> bool:
    samples = [s for item in group for s in (item if isinstance(item, list) else [item])]
    if not any(s.status == Sample.Status.ABORTED for s in samples):
        return False
    first = samples[0]
    first.metadata["aborted_resubmits"] = first.metadata.get("aborted_resubmits", 0) + 1
    return first.metadata["aborted_resubmits"] <= ABORTED_RESUBMITS


def _first(group: list) -> Sample:
    return group[0][0] if isinstance(group[0], list) else group[0]


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's default `--rollout-function-path`: one step's groups (`generate_rollout_async`), on an event loop of
    its own. Evaluation runs per prompt through `generate_and_rm` (sluice's eval: section), not here."""
    if evaluation:
        raise ValueError("generate_rollout: sluice evaluates each eval prompt through generate_and_rm "
                         "(the eval: section), not through the rollout function")
    return RolloutFnTrainOutput(samples=asyncio.run(generate_rollout_async(args, rollout_id, data_source)))
