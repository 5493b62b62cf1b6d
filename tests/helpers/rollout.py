"""Rollout-function test doubles: running a coroutine with an engine client, and a client scripted to abort."""
from __future__ import annotations

import asyncio

from glue.fleet.engine_client import EngineClient


def run(client: EngineClient, coro):
    async def wrapped():
        try:
            return await coro
        finally:
            await client.aclose()

    return asyncio.run(wrapped())


class ScriptedAborts:
    """Answers in SGLang's shape: the first `aborts` calls end with finish reason abort after 3 tokens at version
    `call index`, then one complete answer at the next version."""

    def __init__(self, aborts: int):
        self.aborts, self.inputs = aborts, []

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.inputs.append(list(input_ids))
        call = len(self.inputs) - 1
        n = 3 if call < self.aborts else sampling_params["max_new_tokens"]
        kind = "abort" if call < self.aborts else "length"
        return {"output_ids": [7] * n, "meta_info": {"output_token_logprobs": [[-0.5, 7, None]] * n,
                                                      "weight_version": str(call), "finish_reason": {"type": kind}}}
