"""A stop's grace running out while a step waits on groups (run.stop_grace_s): the wait is cut and what the step
had so far is checkpointed, so a resume issues the unfinished groups again."""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Awaitable


async def never() -> None:
    """Waits for ever: the grace of a run that is never stopped."""
    await asyncio.get_running_loop().create_future()


async def unless_stopped(batch: Awaitable[Any], stopped: Awaitable[None]) -> Any | None:
    """`batch`'s result, or None if `stopped` returns first (then `batch` is cancelled)."""
    batch_task, stop_task = asyncio.ensure_future(batch), asyncio.ensure_future(stopped)
    try:
        await asyncio.wait({batch_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        return batch_task.result() if batch_task.done() else None
    finally:
        for task in (batch_task, stop_task):
            task.cancel()
        await asyncio.gather(batch_task, stop_task, return_exceptions=True)


async def save_cut(parts: Any, step: int) -> None:
    """A stop cut the step after `step` while it waited on groups: checkpoint `step` with the stream's state (the
    finished groups in the buffer, and the groups still generating with their samples so far, which a resume issues
    again and continues). The stream cancels those groups when the loop ends. `parts`: the loop's LoopParts."""
    if parts.checkpoints is None:
        return
    state = {**await parts.stream.checkpoint_state(parts.fleet), "version": parts.trainer.version}
    saved = await asyncio.to_thread(parts.hooks.train_guard,
                                    lambda: parts.checkpoints.save(step, parts.trainer.save_checkpoint, state))
    print(f"sluice: {cut_summary(state, saved)}", file=sys.stderr, flush=True)


def cut_summary(state: dict, saved: Any) -> str:
    """What a cut step's checkpoint kept and what it could not: the finished groups whole, the samples of the groups
    still generating that their rollout function tracked (with their tokens so far); the other samples of those
    groups are generated again from their prompts, and the step itself is trained after the resume."""
    partial = state.get("partial", {})
    samples = sum(len(v) for v in partial.values())
    untracked = len(state["reissue"]) - len(partial)
    lost = (f"; {untracked} of them tracked no sample (ctx.track) and are generated again from the prompt"
            if untracked else "")
    return (f"checkpoint {saved} (the last step trained): {len(state.get('finished', []))} finished groups kept whole, "
            f"{len(state['reissue'])} still generating issued again on resume with {samples} samples' tokens so far"
            f"{lost}; the cut step is trained after the resume")
