"""The agent of examples/configs/openai_agent.yaml: arithmetic questions answered by an agent written with the `openai`
package (rollout_fns.openai_agent runs it through sgl-router), whose every answer goes to a `check` tool and back.

The tool call is the agent's, made on the model's behalf (the tiny model has no tool-call parser), so the assistant
message carries it with an id and the tool message answers that id, as the OpenAI chat format wants (sgl-router
refuses a tool message without `tool_call_id`). With SGLang's `--tool-call-parser`, answer the ids of
`reply.choices[0].message.tool_calls` instead.
"""
from __future__ import annotations

import json
import random
from typing import Any, Iterator

from rollout_fns.arith_data import arith_rows
from rollout_fns.verifiers import math_reward

AGENT = "rollout_fns.arith_agent:solve"


def check(answer: str, label: str) -> str:
    """The tool: whether the answer is right, in words the model reads back."""
    return "correct" if math_reward(answer, label)["correct"] else "check your arithmetic"


async def solve(client: Any, prompt: dict) -> float:
    """Ask; the answer goes to the check tool, its verdict comes back as a tool message; ask again. The reward is
    the last answer's correctness."""
    messages = [{"role": "user", "content": prompt["question"]}]
    for turn in range(prompt.get("turns", 2)):
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=prompt.get("max_tokens", 16), temperature=1.0)
        answer = reply.choices[0].message.content or ""
        call = {"id": f"check-{turn}", "type": "function",
                "function": {"name": "check", "arguments": json.dumps({"answer": answer})}}
        messages += [{"role": "assistant", "content": answer, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": check(answer, prompt["label"])}]
    return math_reward(answer, prompt["label"])["score"]


class ArithAgentTask:
    """Prompts naming `solve`: "What is a+b?" rows (rollout_fns.arith_data). prompt_tokens is only what a failed
    group's samples record: the agent builds its own chat, and the rewards are the agent's."""

    def __init__(self, *, num_rows: int = 1000, data_seed: int = 0, low: int = 0, high: int = 9,
                 operators: str = "+", turns: int = 2, max_tokens: int = 16):
        self.rows = arith_rows(num_rows, data_seed, low=low, high=high, operators=operators)
        self.turns, self.max_tokens = turns, max_tokens

    def prompts(self, seed: int) -> Iterator[dict]:
        rng = random.Random(seed)
        while True:
            row = rng.choice(self.rows)
            yield {"prompt_tokens": [0], "agent": AGENT, "question": row["prompt"], "label": row["answer"],
                   "turns": self.turns, "max_tokens": self.max_tokens}

    def reward(self, sample) -> float:
        return sample.reward  # never called by rollout_fns.openai_agent: each run's samples carry the agent's reward
