"""The built-in single-turn rollout function: one prompt, `num_samples` concurrent /generate calls through the
router, each answer turned into a scored `Sample` (the default `rollout.function`)."""
from __future__ import annotations

import asyncio

from glue.rollout.manager import RolloutContext, append_generation, score
from glue.types import Sample, SampleStatus


async def generate_group(ctx: RolloutContext, prompt: dict, num_samples: int) -> list[Sample]:
    """Sample `num_samples` responses to `prompt["prompt_tokens"]` concurrently and score each with the task."""
    return list(await asyncio.gather(*(generate_one(ctx, prompt, i) for i in range(num_samples))))


async def generate_one(ctx: RolloutContext, prompt: dict, index: int) -> Sample:
    """One response. If the engine aborts it part-way (generation paused with mode "abort"), the partial response
    is kept and generation continues from prompt + response so far, so its tokens may carry two versions; with
    `ctx.partial_rollouts == "restart"` the partial response is thrown away (counted in
    metadata["discarded_tokens"]) and generation starts again from the prompt, so every token has one version.
    With `ctx.routed_experts` (rollout.return_routed_experts) each request asks for the MoE routing of the positions
    the sample has none for yet, so a resumed sample's routing is its requests' routing concatenated. A generation
    still aborted after `ctx.max_resumes` continuations is given up (ABORTED, metadata["resume_limit_hit"])."""
    sample = ctx.track(ctx.resumed.get(index) or Sample(
        prompt_tokens=list(prompt["prompt_tokens"]), group_id=ctx.group_id, index=index,
        metadata={k: v for k, v in prompt.items() if k != "prompt_tokens"}, status=SampleStatus.ABORTED))
    budget = ctx.sampling_params.get("max_new_tokens")
    while sample.status is SampleStatus.ABORTED:  # a new sample, or one checkpointed part-way (ctx.resumed)
        params = ctx.sampling_for(index)
        if budget is not None:
            params["max_new_tokens"] = budget - len(sample.response_tokens)
        output = await ctx.client.generate(sample.prompt_tokens + sample.response_tokens, params,
                                           **ctx.routing_request(sample))
        append_generation(sample, output, ctx.routed_experts)
        if sample.status is not SampleStatus.ABORTED:
            break
        if sample.metadata.get("resumes", 0) >= ctx.max_resumes:
            sample.metadata["resume_limit_hit"] = 1
            break
        sample.metadata["resumes"] = sample.metadata.get("resumes", 0) + 1
        if ctx.partial_rollouts == "restart":
            sample.metadata["discarded_tokens"] = sample.metadata.get("discarded_tokens", 0) + len(sample.response_tokens)
            sample.response_tokens, sample.loss_mask, sample.rollout_logprobs, sample.versions = [], [], [], []
            sample.routed_experts = None
            continue
        if budget is not None and len(sample.response_tokens) >= budget:
            sample.status = SampleStatus.TRUNCATED
            break
    await score(ctx, sample)
    return sample
