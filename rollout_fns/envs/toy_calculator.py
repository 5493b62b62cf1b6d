"""A token-level calculator task for `rollout_fns.multi_turn` that a tiny random model learns by RL in minutes: the
multi-turn, tool-waiting counterpart of `toy_tasks.EchoTask` (no tokenizer; the learning table's second task).
The prompt asks for a + b (mod n); the model may call a slow calculator tool, whose answer comes back as an
observation."""
from __future__ import annotations

import asyncio
import random
from typing import Iterator

from glue.types import Sample
from rollout_fns.envs import Action, StepResult
from rollout_fns.multi_turn import EpisodeConfig


class ToyCalculatorEnv:
    """One episode of at most two turns. A first turn that opens with `call_id` calls the tool, which sleeps a
    uniform time in `latency_s` and answers with the token of (a + b) mod `modulus` (reward `call_credit`); any other
    turn is the final answer, scored like EchoTask: `1 - call_credit` times the fraction of its first `answer_len`
    tokens equal to that token (missing tokens count as misses)."""

    def __init__(self, *, call_id: int, result_low: int, modulus: int, answer_len: int,
                 latency_s: tuple[float, float], call_credit: float, rng: random.Random):
        self.call_id, self.result_low, self.modulus, self.call_credit = call_id, result_low, modulus, call_credit
        self.answer_len, self.latency_s, self.rng = answer_len, latency_s, rng
        self.result, self.called = -1, False

    async def reset(self, prompt: dict) -> None:
        self.result = self.result_low + (prompt["a"] + prompt["b"]) % self.modulus
        return None

    async def step(self, action: Action) -> StepResult:
        if self.called or action.tokens[:1] != [self.call_id]:
            hits = sum(token == self.result for token in action.tokens[: self.answer_len])
            return StepResult(reward=(1.0 - self.call_credit) * hits / self.answer_len, done=True)
        self.called = True
        await asyncio.sleep(self.rng.uniform(*self.latency_s))
        return StepResult(observation=[self.result], reward=self.call_credit)


class ToyCalculatorTask:
    """Prompt: BOS, the token of a, the token of b (a, b uniform in [0, operand_range)); the answer is
    (a + b) mod operand_range, uniform over its operand_range tokens, so no single answer is right more often than
    the others (with a plain sum the policy settles on the most frequent one and stops learning). Episodes of up to
    two turns of up to `answer_len` tokens (set `rollout.sampling.max_new_tokens` to it). Reward: the episode's
    summed step rewards, in [0, 1].

    Why a tiny random model learns it: answering a + b from the prompt needs an addition table, but calling the tool
    (token `call_id`, found 1 time in V at random, and rewarded `call_credit`) turns it into EchoTask's rule, "emit the
    token you are looking at": the tool's answer is the last input token when the answer turn starts, and the
    answer's `answer_len` tokens give partial credit as EchoTask's do. The curve has stages: learn to call (reward
    ~call_credit), to answer with result tokens, then to copy the tool's answer (reward -> 1). Every call waits on
    the tool, so once the policy calls, rollout time is dominated by the tool's latency (where async pays off).
    The ids keep clear of the tiny model's special ids (bos 0, eos 1)."""

    def __init__(self, *, vocab_size: int = 32, operand_low: int = 4, operand_range: int = 4, call_id: int = 3,
                 result_low: int = 12, latency_s: tuple[float, float] | list[float] = (0.2, 1.0),
                 call_credit: float = 0.2, answer_len: int = 4, latency_seed: int = 0, bos_id: int = 0):
        low, high = latency_s
        if not 0 <= low <= high:
            raise ValueError(f"ToyCalculatorTask: latency_s must be [low, high] with 0 <= low <= high, got {latency_s}")
        results = range(result_low, result_low + operand_range)
        operands = range(operand_low, operand_low + operand_range)
        if max(results[-1], operands[-1], call_id) >= vocab_size or min(operand_low, result_low, call_id) <= 1:
            raise ValueError(f"ToyCalculatorTask: operand ids {operands}, result ids {results} and call_id {call_id} "
                             f"must lie in [2, vocab_size={vocab_size})")
        if call_id in operands or call_id in results or set(operands) & set(results):
            raise ValueError("ToyCalculatorTask: call_id, the operand ids and the result ids must not overlap")
        if not 0 <= call_credit < 1:
            raise ValueError(f"ToyCalculatorTask: call_credit must be in [0, 1), got {call_credit}")
        self.operand_low, self.operand_range = operand_low, operand_range
        self.call_id, self.result_low = call_id, result_low
        self.latency_s, self.call_credit, self.bos_id = (float(low), float(high)), call_credit, bos_id
        if answer_len < 1:
            raise ValueError(f"ToyCalculatorTask: answer_len must be >= 1, got {answer_len}")
        self.answer_len = answer_len
        self.episode = EpisodeConfig(max_turns=2)  # call, then answer; or answer at once
        self.tokenizer = None
        self._rng = random.Random(latency_seed)

    def prompts(self, seed: int) -> Iterator[dict]:
        """An endless, seed-determined stream of {"prompt_tokens", "a", "b"}."""
        rng = random.Random(seed)
        while True:
            a, b = rng.randrange(self.operand_range), rng.randrange(self.operand_range)
            yield {"prompt_tokens": [self.bos_id, self.operand_low + a, self.operand_low + b], "a": a, "b": b}

    def make_env(self, prompt: dict) -> ToyCalculatorEnv:
        return ToyCalculatorEnv(call_id=self.call_id, result_low=self.result_low, modulus=self.operand_range,
                                answer_len=self.answer_len, latency_s=self.latency_s, call_credit=self.call_credit,
                                rng=self._rng)

    def reward(self, sample: Sample) -> float:
        """The episode's summed step rewards (the environment's)."""
        return float(sum(sample.metadata.get("env_rewards", [])))
