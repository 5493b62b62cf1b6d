"""A stop's grace running out while a step waits on groups (run.stop_grace_s): the wait is cut and what the step
had so far is checkpointed, so a resume issues the unfinished groups again."""
from __future__ import annotations

import asyncio
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
    await asyncio.to_thread(parts.hooks.train_guard,
                            lambda: parts.checkpoints.save(step, parts.trainer.save_checkpoint, state))
