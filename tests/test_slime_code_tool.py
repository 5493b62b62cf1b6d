"""slime's standard pipeline with a code-tool generate function, in the shape of slime's retool example (its own
code): slime's default whole-rollout function (`slime.rollout.sglang_rollout.generate_rollout`, named by
`--rollout-function-path`) pulls each step's groups from the data source and runs `generate_and_rm_group`, which
calls the generate function found in `args.custom_generate_function_path` and scores each sample through rm_hub's
`async_rm` (`args.custom_rm_path`). The generate function sends input ids, runs a code tool on each turn's text, and
holds on to `sample.loss_mask` and its own `response` while `append_response_tokens` extends them, writing both back
at the end, as retool does. Two sync steps on the tiny Qwen2 with its tokenizer."""
from __future__ import annotations

import pytest

from glue.loop.replay import load_step
from glue.metrics.logger import read_metrics
from glue.rollout.slime import shim
from launch.config import load_config
from launch.run.runner import run
from rollout_fns.arith_data import write_arith_jsonl

shim.install()  # what sluice does before loading a slime function; slime itself is not installed here

from slime.rollout.sglang_rollout import GenerateState  # noqa: E402 - the stand-in installed above
from slime.utils.http_utils import post  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

SEEN: list[dict] = []  # each sample's loss mask as the generate function wrote it back
MAX_TURNS = 2


# --- the user's code, in slime's style ----------------------------------------------------------------------------

async def generate(args, sample: Sample, sampling_params) -> Sample:
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    state = GenerateState(args)
    sample.rollout_log_probs, sample.response, sample.response_length, sample.loss_mask = None, "", 0, []
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)
    response, response_ids = "", []
    loss_masks = sample.loss_mask  # kept, and put back at the end
    for turn in range(MAX_TURNS):
        payload = {"input_ids": prompt_ids + response_ids, "sampling_params": dict(sampling_params),
                   "return_logprob": True}
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        ids = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        text = state.tokenizer.decode(ids)
        response += text
        response_ids += ids
        sample.append_response_tokens(args, tokens=ids, log_probs=[item[0] for item in
                                                                   output["meta_info"]["output_token_logprobs"]],
                                      trainable=True, meta_info=output["meta_info"])
        if turn == MAX_TURNS - 1:
            break
        tool_output = run_code(text)
        tool_ids = state.tokenizer(tool_output, add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=tool_ids, trainable=False)  # loss_mask 0, into loss_masks too
        response, response_ids = response + tool_output, response_ids + tool_ids
    sample.tokens, sample.response_length = prompt_ids + response_ids, len(response_ids)
    sample.response, sample.loss_mask = response, loss_masks  # written back, as retool does
    SEEN.append({"mask": list(loss_masks), "n": len(response_ids), "tool": "<interpreter>" in response})
    return sample


def run_code(text: str) -> str:
    """The interpreter: sums the digits the turn wrote (a tiny random model writes no program)."""
    return f"<interpreter>{sum(int(ch) for ch in text if ch.isdigit())}</interpreter>"


async def reward_func(args, sample, **kwargs):
    """1 when the label is in the answer after the interpreter's output, else the share of digits there."""
    answer = sample.response.split("</interpreter>")[-1]
    return float(str(sample.label) in answer) or sum(ch.isdigit() for ch in answer) / max(1, len(answer))


# --- the run -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.long  # an end-to-end variant: tests/test_slime_fully_async.py keeps one whole slime rollout run in CI
def test_slime_s_default_rollout_with_a_code_tool_generate_function_trains_two_steps(tmp_path):
    shim.install()
    data = write_arith_jsonl(tmp_path / "arith.jsonl", 32, seed=5)
    cfg = load_config("examples/configs/demo.yaml", [
        f"run.output_dir={tmp_path}", "run.name=code_tool", "run.num_steps=2", "run.save_rollouts=true",
        "model.tiny.tokenizer=true", "model.tiny.vocab_size=272", "rollout.task=rollout_fns.text_data:TextDataTask",
        f"rollout.task_args.path={data}", "rollout.task_args.prompt_key=prompt", "rollout.task_args.label_key=answer",
        "rollout.slime.rollout_function=slime.rollout.sglang_rollout.generate_rollout",
        "rollout.slime.generate_function=test_slime_code_tool.generate",
        "reward.slime.function=test_slime_code_tool.reward_func", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.sampling.max_new_tokens=6", "rollout.num_engines=1"])
    SEEN.clear()
    run_dir = run(cfg)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(r["rollout/failed"] == 0 for r in records), records
    assert len(SEEN) == 16 and all(s["tool"] and s["mask"].count(0) > 0 and len(s["mask"]) == s["n"] for s in SEEN)
    for step in (1, 2):
        groups, _ = load_step(run_dir, step)
        for sample in (s for g in groups for s in g.samples):
            text = sample.metadata["response_text"]
            first_tool = sample.loss_mask.index(0)
            assert "<interpreter>" in text and all(m == 1 for m in sample.loss_mask[:first_tool])
            assert len(sample.loss_mask) == len(sample.response_tokens) == len(sample.versions)
            assert set(sample.versions) == {step - 1}  # sync: every token from the weights of the step before
            answer = text.split("</interpreter>")[-1]
            assert sample.reward == pytest.approx(float(sample.metadata["label"] in answer)
                                                  or sum(c.isdigit() for c in answer) / max(1, len(answer)))
