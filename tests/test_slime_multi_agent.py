"""A multi-agent generate function in the shape of slime's multi-agent example, written here: two solver agents
answer the prompt as text with stop strings, a critic agent reads their answers and gives its own, and every agent's
sample is scored by `slime.rollout.rm_hub.batched_async_rm` by the run's `--rm-type` (a sample's metadata may name
its own). The function returns all three samples; the run trains them for two steps on the tiny Qwen2 with its
tokenizer (embedded engines behind the real sgl-router, megatron on gloo)."""
from __future__ import annotations

import copy

import pytest

from glue.loop.replay import load_step
from glue.metrics.logger import read_metrics
from glue.rollout.slime import shim
from launch.config import load_config
from launch.run.runner import run
from rollout_fns.arith_data import write_arith_jsonl

shim.install()  # what sluice does before loading a slime function; slime itself is not installed here

from slime.rollout.rm_hub import batched_async_rm  # noqa: E402 - the stand-in installed above
from slime.rollout.rm_hub.f1 import f1_score  # noqa: E402
from slime.rollout.rm_hub.math_utils import extract_answer  # noqa: E402
from slime.rollout.sglang_rollout import GenerateState  # noqa: E402
from slime.utils.http_utils import post  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

STOP = ["</answer>", *"etaoin"]  # a tiny random model writes no closing tag: common letters end a turn too
SCORED: list[dict] = []


# --- the user's code, in slime's style ----------------------------------------------------------------------------

async def agent_turn(args, sample: Sample, prompt_text: str, sampling_params) -> Sample:
    """One agent's answer to `prompt_text`, kept in `sample` with the engine's tokens, logprobs and versions."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.prompt = prompt_text
    sample.tokens = state.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    sample.response, sample.response_length, sample.loss_mask, sample.rollout_log_probs = "", 0, None, None
    output = await post(url, {"text": prompt_text, "return_logprob": True,
                              "sampling_params": {**sampling_params, "stop": STOP}})
    entries = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(args, tokens=[e[1] for e in entries], log_probs=[e[0] for e in entries],
                                  trainable=True, meta_info=output["meta_info"], text=output["text"])
    return sample


async def generate_with_agents(args, sample: Sample, sampling_params) -> list[Sample]:
    solvers = [await agent_turn(args, copy.deepcopy(sample), f"Solve: {sample.prompt}\n", sampling_params)
               for _ in range(2)]
    critic = copy.deepcopy(sample)
    critic.metadata = {**critic.metadata, "rm_type": "boxed_f1"}  # the critic is scored on its boxed answer
    answers = "".join(f"Answer {i}: {s.response}\n" for i, s in enumerate(solvers))
    critic = await agent_turn(args, critic, f"{sample.prompt}\n{answers}Best answer: \\boxed{{", sampling_params)
    critic.response = "\\boxed{" + critic.response + "}"  # the box the critic's prompt opened
    agents = [*solvers, critic]
    rewards = await batched_async_rm(args, agents)
    for agent, reward in zip(agents, rewards):
        agent.reward = reward
        SCORED.append({"rm_type": agent.metadata.get("rm_type", args.rm_type), "response": agent.response,
                       "label": agent.label, "reward": reward})
    return agents


# --- the run -------------------------------------------------------------------------------------------------------

def expected_reward(rm_type: str, response: str, label: str) -> float:
    """f1 by hand-written rm_hub rules: the whole response, or for boxed_f1 only its last boxed answer."""
    text = extract_answer(response) or "" if rm_type == "boxed_f1" else response
    return f1_score(text, label)[0]


@pytest.mark.slow
@pytest.mark.long  # a whole run (218 s measured on the shared 2-core machine); tests/test_slime_rm_hub.py keeps
# batched_async_rm by rm_type in make test, tests/test_slime_search_r1.py a slime-shaped function's two steps
def test_a_multi_agent_function_scored_by_rm_type_trains_two_steps(tmp_path):
    data = write_arith_jsonl(tmp_path / "arith.jsonl", 16, seed=2)
    cfg = load_config("examples/configs/demo.yaml", [
        f"run.output_dir={tmp_path}", "run.name=multi_agent", "run.num_steps=2", "run.save_rollouts=true",
        "model.tiny.tokenizer=true", "model.tiny.vocab_size=272", "rollout.task=rollout_fns.text_data:TextDataTask",
        f"rollout.task_args.path={data}", "rollout.task_args.prompt_key=prompt", "rollout.task_args.label_key=answer",
        "rollout.slime.generate_function=test_slime_multi_agent:generate_with_agents", "rollout.slime.rm_type=f1",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.sampling.max_new_tokens=6",
        "rollout.num_engines=1"])
    SCORED.clear()
    run_dir = run(cfg)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(r["rollout/failed"] == 0 for r in records), records
    assert all(r["rollout/num_samples"] == 2 * 2 * 3 for r in records), records  # 3 agents per generate call
    assert {s["rm_type"] for s in SCORED} == {"f1", "boxed_f1"}
    for s in SCORED:
        assert s["reward"] == pytest.approx(expected_reward(s["rm_type"], s["response"], s["label"])), s
    for step in (1, 2):
        groups, _ = load_step(run_dir, step)
        samples = [s for g in groups for s in g.samples]
        assert len(samples) == 12
        for sample in samples:
            assert len(sample.loss_mask) == len(sample.response_tokens) == len(sample.versions) > 0
            assert "unrecorded_version_tokens" not in sample.metadata
            assert sample.reward == pytest.approx(expected_reward(sample.metadata.get("rm_type", "f1"),
                                                                  sample.metadata["response_text"],
                                                                  sample.metadata["label"]))
