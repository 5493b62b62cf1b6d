"""slime's search-r1 and retool examples, in their shape, run unchanged: a generate function sends the prompt as
`text` with stop strings through `slime.utils.http_utils.post`, reads the answer's `text`, loops a tool turn whose
output is appended with loss_mask 0 while it holds on to `sample.loss_mask` (as retool does), caps its turns by
`args.rollout_max_context_len`, and a reward reads `sample.label["ground_truth"]` from a dict label. Two training
steps on the tiny Qwen2 with its tokenizer (embedded engines behind the real sgl-router, megatron on gloo)."""
from __future__ import annotations

import json

from glue.loop.replay import load_step
from glue.metrics.logger import read_metrics
from glue.rollout.slime import shim
from launch.config import load_config
from launch.run.runner import run

shim.install()  # what sluice does before loading a slime function; slime itself is not installed here

from slime.rollout.sglang_rollout import GenerateState  # noqa: E402 - the stand-in installed above
from slime.utils.http_utils import post  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

# search-r1 stops on its closing tags; a tiny random model writes none, so common letters stand in for them too
STOP = ["</search>", "</answer>", *"etaoinsrhl"]
MAX_TURNS = 3
TURNS: list[dict] = []  # what each generate turn saw, across the run
REWARDS: list[dict] = []


# --- the user's code, in slime's style ----------------------------------------------------------------------------

def search(query: str) -> str:
    """The retriever: a fixed passage naming the query's length (a random model's query finds nothing real)."""
    return f"\n\n<information>Doc 1: {len(query)} letters.</information>\n\n"


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_text = sample.prompt
    prompt_ids = state.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)
    sample.response, sample.response_length, sample.loss_mask, sample.rollout_log_probs = "", 0, [], None
    loss_masks = sample.loss_mask  # retool keeps this list and puts it back at the end
    response, response_ids = "", []
    max_context = args.rollout_max_context_len or args.context_parallel_size * args.max_tokens_per_gpu
    params = {**sampling_params, "stop": STOP}
    for turn in range(MAX_TURNS):
        budget = max_context - len(prompt_ids) - len(response_ids)
        if budget <= 0:
            sample.status = Sample.Status.TRUNCATED
            break
        payload = {"text": prompt_text + response, "return_logprob": True,
                   "sampling_params": {**params, "max_new_tokens": min(params["max_new_tokens"], budget)}}
        output = await post(url, payload)
        finish = output["meta_info"]["finish_reason"]
        if finish["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        ids = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
        TURNS.append({"text": output["text"], "finish": finish, "decoded": state.tokenizer.decode(ids),
                      "rm_type": args.rm_type})
        response += output["text"]
        response_ids += ids
        sample.append_response_tokens(args, tokens=ids, log_probs=log_probs, trainable=True,
                                      meta_info=output["meta_info"])
        if finish["type"] != "stop" or turn == MAX_TURNS - 1:
            break
        observation = search(output["text"])
        obs_ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        response += observation
        response_ids += obs_ids
        sample.append_response_tokens(args, tokens=obs_ids, trainable=False)
    sample.tokens = prompt_ids + response_ids
    sample.response_length = len(response_ids)
    sample.response = response
    sample.loss_mask = loss_masks
    return sample


async def reward_func(args, sample, **kwargs):
    """search-r1's shape: the label is the row's reward_model dict; 1 when a ground-truth target is in the answer."""
    targets = sample.label["ground_truth"]["target"]
    REWARDS.append({"targets": targets, "masked": sample.loss_mask.count(0), "n": len(sample.loss_mask)})
    return float(any(t in sample.response for t in targets))


# --- the run -------------------------------------------------------------------------------------------------------

def write_search_rows(path, n: int) -> str:
    """Rows as search-r1's preprocessed data holds them: a question and a reward_model dict label."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"Who wrote book {i}?",
                                "reward_model": {"style": "rule", "ground_truth": {"target": ["e", f"author {i}"]}}})
                    + "\n")
    return str(path)


def test_a_search_r1_shaped_function_with_text_stop_strings_and_a_dict_label_trains_two_steps(tmp_path):
    data = write_search_rows(tmp_path / "search.jsonl", 16)
    cfg = load_config("examples/configs/demo.yaml", [
        f"run.output_dir={tmp_path}", "run.name=search_r1", "run.num_steps=2", "run.save_rollouts=true",
        "model.tiny.tokenizer=true", "model.tiny.vocab_size=272", "rollout.task=rollout_fns.text_data:TextDataTask",
        f"rollout.task_args.path={data}", "rollout.task_args.prompt_key=question",
        "rollout.task_args.label_key=reward_model", "rollout.slime.generate_function=test_slime_search_r1:generate",
        "reward.slime.function=test_slime_search_r1:reward_func", "rollout.slime.max_context_len=96",
        "rollout.slime.rm_type=deepscaler", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "rollout.sampling.max_new_tokens=6", "rollout.num_engines=1"])
    TURNS.clear(), REWARDS.clear()
    run_dir = run(cfg)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(r["rollout/failed"] == 0 for r in records), records
    stopped = [t for t in TURNS if t["finish"]["type"] == "stop" and isinstance(t["finish"]["matched"], str)]
    assert stopped, f"no turn ended on a stop string: {TURNS[:3]}"
    for turn in stopped:  # slime decodes with no_stop_trim: the text ends in the matched stop string
        assert turn["finish"]["matched"] in STOP and turn["text"].endswith(turn["finish"]["matched"]), turn
    assert all(t["rm_type"] == "deepscaler" for t in TURNS)
    assert len(REWARDS) == 16 and all(r["targets"] == ["e", r["targets"][1]] for r in REWARDS)
    assert any(r["masked"] for r in REWARDS)  # tool output reached the kept loss_mask list as zeros
    for step in (1, 2):
        groups, _ = load_step(run_dir, step)
        for sample in (s for g in groups for s in g.samples):
            assert len(sample.loss_mask) == len(sample.response_tokens) == len(sample.versions)
            text = sample.metadata["response_text"]
            assert sample.loss_mask.count(0) == 0 or "<information>" in text
            assert sample.reward == float("e" in text or any(f"author {i}" in text for i in range(16)))
