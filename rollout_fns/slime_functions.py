"""The rollout function that runs slime's functions unchanged (rollout.slime.generate_function or
rollout.slime.rollout_function, with reward.slime.function or the task's reward): set either key and it becomes
`rollout.function`. The adapter itself is glue.rollout.slime.adapter; docs/rollout_functions.md, "slime functions"."""
from __future__ import annotations

from glue.rollout.manager import RolloutContext
from glue.types import Sample


async def generate_group(ctx: RolloutContext, prompt: dict, num_samples: int) -> list[Sample]:
    """`num_samples` samples of `prompt` from the run's slime generate function (or the next group its whole-rollout
    function returns: called once per step's groups), each with a weight version per response token, scored by
    reward.slime.function or the task."""
    if ctx.slime is None or (ctx.slime.generate is None and ctx.slime.rollout is None):
        raise ValueError("rollout_fns.slime_functions runs slime's functions: set rollout.slime.generate_function or "
                         "rollout.slime.rollout_function")
    return await ctx.slime.generate_group(ctx, prompt, num_samples)
