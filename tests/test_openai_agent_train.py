"""An agent written with the `openai` package trains through a whole sluice run (Ray, embedded engines behind the real
sgl-router serving /v1/chat/completions, megatron on gloo): its recorded calls become samples the trainer scores with
the same logprobs the engine reported, and the engines receive the trained weights."""
import math

import openai
import pytest

from glue.metrics.logger import read_metrics
from launch.config import load_config
from launch.runner import run

QUESTIONS = ["What is 1+1?", "What is 2+2?", "What is 3+1?", "What is 2+1?"]


async def tool_agent(client: openai.AsyncOpenAI, prompt: dict) -> float:
    """Two calls: a question, then the reply and a tool result sent back; rewarded by the second reply's first
    character, which a random policy gets right now and then."""
    messages = [{"role": "user", "content": prompt["question"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=2, temperature=1.0)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "tool", "tool_call_id": "calc-1", "content": "2"}]
    answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3, temperature=1.0)
    return float(answer.choices[0].message.content[:1].isdigit())


class AgentTask:
    """Prompts that name the agent; the reward is what the agent returned (rollout_fns.openai_agent sets it)."""

    def prompts(self, seed: int):
        i = 0
        while True:
            yield {"prompt_tokens": [0], "agent": "test_openai_agent_train:tool_agent",
                   "question": QUESTIONS[(seed + i) % len(QUESTIONS)]}
            i += 1

    def reward(self, sample):
        return sample.reward


@pytest.mark.slow
def test_an_openai_client_agent_trains_through_sluice(tmp_path):
    cfg = load_config("examples/configs/demo.yaml", [
        f"run.output_dir={tmp_path}", "run.name=agent", "run.num_steps=2", "run.overwrite=true",
        "model.tiny.tokenizer=true", "model.tiny.vocab_size=272",
        "rollout.function=rollout_fns.openai_agent:generate_group", "rollout.task=test_openai_agent_train:AgentTask",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4"])
    records = read_metrics(run(cfg) / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert [r["weights/version"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/num_samples"] >= 8 and r["rollout/failed"] == 0  # 2 prompts x 4 runs, >= 1 sample each
        # the trainer's logprobs of the recorded tokens are the engine's: the ids were recorded, not re-tokenised
        assert math.isclose(r["train/discrepancy/ratio_mean"], 1.0, abs_tol=1e-3), r
        assert r["train/discrepancy/ratio_max"] < 1.01, r
