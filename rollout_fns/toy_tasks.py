"""Toy tasks for the demo and the tests: token-id prompts (no tokenizer) with a verifiable reward that a tiny
random model learns by RL in minutes. The rollout manager draws prompts from `prompts(seed)` and the rollout
function scores each sample with `reward(sample)`."""
from __future__ import annotations

import asyncio
import random
from typing import Iterator

from glue.types import Sample


class EchoTask:
    """Prompt: BOS followed by `prompt_len` random content tokens. Reward: the fraction of the first `k`
    response tokens equal to the prompt's last token (missing tokens count as misses), in [0, 1].

    Why a tiny random model learns it by GRPO in a few dozen steps: a random policy over V tokens hits the
    target about 1/V of the time per token, so with k tokens per sample and 8 samples per group most groups
    have some reward variance, which is all GRPO needs for a signal. The rule it has to find is "emit the
    token you are looking at": at the first response position the model's input *is* the prompt's last
    token, and once it has echoed that token the input stays the target. That is a map from input embedding
    to output logits, reachable through the residual stream without any attention pattern. The defaults (4
    content tokens, k=4) give a two-stage curve: first "emit content tokens" (reward ~0.25), then the copy.
    The defaults keep clear of the tiny model's special ids (bos 0, eos 1).
    """

    def __init__(self, *, vocab_size: int = 32, content_low: int = 4, content_high: int = 8,
                 prompt_len: int = 4, k: int = 4, bos_id: int = 0):
        if not 0 <= content_low < content_high <= vocab_size:
            raise ValueError(
                f"EchoTask: content tokens [{content_low}, {content_high}) must lie inside the vocabulary "
                f"[0, {vocab_size}); adjust content_low/content_high"
            )
        if content_low <= bos_id < content_high:
            raise ValueError(f"EchoTask: bos_id={bos_id} lies inside the content range; move it outside")
        if prompt_len < 1 or k < 1:
            raise ValueError(f"EchoTask: prompt_len and k must be >= 1, got prompt_len={prompt_len}, k={k}")
        self.vocab_size = vocab_size
        self.content_low, self.content_high = content_low, content_high
        self.prompt_len, self.k, self.bos_id = prompt_len, k, bos_id

    def prompts(self, seed: int) -> Iterator[dict]:
        """An endless, seed-determined stream of prompts: {"prompt_tokens": [...], "target": int}."""
        rng = random.Random(seed)
        while True:
            content = [rng.randrange(self.content_low, self.content_high) for _ in range(self.prompt_len)]
            yield {"prompt_tokens": [self.bos_id, *content], "target": content[-1]}

    def reward(self, sample: Sample) -> float:
        """Fraction of the first k response tokens equal to the prompt's last token."""
        target = sample.prompt_tokens[-1]
        head = sample.response_tokens[: self.k]
        return sum(1 for t in head if t == target) / self.k


class SlowToolEchoTask(EchoTask):
    """EchoTask whose reward waits on a simulated tool or environment: each call sleeps a random time in
    [min_latency_s, max_latency_s] before scoring, as an agent task waits on a sandbox or an API. Rollout time is
    then dominated by waiting, not by the engines (the async-RL diary of Qwen3.5 / GLM-5's setting, where async training pays off)."""

    def __init__(self, *, min_latency_s: float = 0.2, max_latency_s: float = 1.0, latency_seed: int = 0, **echo_args):
        super().__init__(**echo_args)
        if not 0 <= min_latency_s <= max_latency_s:
            raise ValueError(f"SlowToolEchoTask: need 0 <= min_latency_s <= max_latency_s, got {min_latency_s}, "
                             f"{max_latency_s}")
        self.min_latency_s, self.max_latency_s = min_latency_s, max_latency_s
        self._rng = random.Random(latency_seed)

    async def reward(self, sample: Sample) -> float:
        await asyncio.sleep(self._rng.uniform(self.min_latency_s, self.max_latency_s))
        return super().reward(sample)
