"""slime's rule-based rewards (slime.rollout.rm_hub, written by sluice) imported and called the way slime's functions
call them: `batched_async_rm(args, samples)` by args.rm_type, math_dapo_utils.compute_score on a retool-style
answer, the boxed-answer graders, F1 and GPQA letters, each on crafted answers whose rewards are worked out by hand;
and `--rm-type` scoring a text task's responses with the same rules."""
from __future__ import annotations

import asyncio

import pytest

from glue.rollout.slime import shim
from glue.rollout.slime.adapter import slime_args
from glue.types import Sample as SluiceSample

shim.install()  # what sluice does before loading a slime function; slime itself is not installed here

from slime.rollout.rm_hub import async_rm, batched_async_rm, grade_answer_verl  # noqa: E402
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward  # noqa: E402
from slime.rollout.rm_hub.f1 import f1_score, normalize_answer  # noqa: E402
from slime.rollout.rm_hub.gpqa import compute_gpqa_reward  # noqa: E402
from slime.rollout.rm_hub.ifbench import compute_ifbench_reward  # noqa: E402
from slime.rollout.rm_hub.math_dapo_utils import compute_score as math_dapo_compute_score  # noqa: E402
from slime.rollout.rm_hub.math_utils import extract_answer as extract_boxed_answer  # noqa: E402
from slime.rollout.rm_hub.math_utils import grade_answer_sympy  # noqa: E402
from slime.utils.types import Sample  # noqa: E402


def args_for(**values):
    args = slime_args(router_url="http://127.0.0.1:1", model_path="/m", sampling_params={"max_new_tokens": 8},
                      samples_per_prompt=2, prompts_per_step=1, seed=0, generate_path=None, reward_path=None)
    vars(args).update(values)
    return args


def sample(response, label, **metadata):
    return Sample(prompt="q", response=response, label=label, metadata=metadata)


def test_the_last_boxed_answer_is_extracted_with_nested_braces_and_an_unclosed_box_is_none():
    assert extract_boxed_answer("first \\boxed{1}, then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed_answer("\\boxed{\\sqrt{2}} and \\boxed{3") is None
    assert extract_boxed_answer("no box, 42") is None


@pytest.mark.parametrize("response, label, correct", [
    ("so \\boxed{0.5}", "\\frac{1}{2}", True),  # equal as numbers
    ("so \\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("so \\boxed{3.0}", "3", True),  # an integral float is the integer
    ("so \\boxed{1,000}", "1000", True),  # thousands commas
    ("so \\boxed{2/4}", "1/2", False),  # an unreduced fraction is wrong, as slime grades
    ("so \\boxed{(1, 2)}", "(1,2)", True),
    ("so \\boxed{[1,2)}", "(1,2)", False),  # a half-open interval is not an open one
    ("so \\boxed{x = 5}", "5", True),
    ("the answer is 5", "5", False),  # no box: no answer
    ("so \\boxed{5}", "", False),
    ("so \\boxed{5}", "\\boxed{5}", True),  # a boxed label is unboxed
])
def test_math_grades_the_boxed_answer_against_the_label_as_slime_s_rules_do(response, label, correct):
    assert grade_answer_verl(response, label) is correct


def test_deepscaler_reads_the_answer_after_the_reasoning_only():
    assert get_deepscaler_rule_based_reward("<think>maybe \\boxed{4}</think> It is \\boxed{42}.", "42") == 1
    assert get_deepscaler_rule_based_reward("<think>\\boxed{42}</think> It is \\boxed{41}.", 42) == 0
    assert get_deepscaler_rule_based_reward("It is \\boxed{42}.", "42") == 0  # no </think>: no answer
    assert get_deepscaler_rule_based_reward("###Response the answer \\boxed{7}", 7) == 1
    with pytest.raises(ValueError, match="rm_type deepscaler: the label is a dict .* it takes a string or a number"):
        get_deepscaler_rule_based_reward("</think>\\boxed{1}", {"ground_truth": "1"})


def test_dapo_reads_the_answer_line_or_the_strict_box_and_scores_plus_or_minus_one():
    assert math_dapo_compute_score("steps...\nAnswer: 1,000", "1000") == {"score": 1.0, "acc": True, "pred": "1000"}
    assert math_dapo_compute_score("Answer: $\\boxed{17}$", "17.0")["acc"] is True
    assert math_dapo_compute_score("Answer: 999", "1000") == {"score": -1.0, "acc": False, "pred": "999"}
    assert math_dapo_compute_score("no answer line", "3")["pred"] == "[INVALID]"
    # retool's call: the last box, compared as written, within the last 100 characters
    assert math_dapo_compute_score("code ran, so \\boxed{7}", "7", strict_box_verify=True)["score"] == 1.0
    assert math_dapo_compute_score("\\boxed{7}" + " padding" * 20, "7", strict_box_verify=True) == \
        {"score": -1.0, "acc": False, "pred": None}


def test_f1_is_the_token_overlap_after_normalisation():
    assert normalize_answer("The Cat, sat!") == "cat sat"
    f1, precision, recall = f1_score("The cat sat", "a cat sat down")  # 2 shared words of 2 and of 3
    assert (precision, recall) == (1.0, 2 / 3) and f1 == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert f1_score("Paris France", "paris")[0] == pytest.approx(2 / 3)  # precision 1/2, recall 1
    assert f1_score("yes", "no") == (0, 0, 0) and f1_score(None, "x") == (0, 0, 0)
    assert f1_score("dog", "cat") == (0, 0, 0)


def test_gpqa_compares_option_letters_or_the_correct_option_s_text():
    choices = {"choices": ["London", "Rome", "Paris", "Oslo"]}
    assert compute_gpqa_reward("Thinking... The answer is B", "B") == 1.0
    assert compute_gpqa_reward("The answer is C", "B") == 0.0
    assert compute_gpqa_reward("<think>A? no</think> I pick C", 2) == 1.0  # the label is the option's index
    assert compute_gpqa_reward("</think> it must be paris", "Paris", dict(choices)) == 1.0  # no letter: the text
    assert compute_gpqa_reward("The answer is (A)", "Paris", dict(choices)) == 0.0  # label text -> letter C
    assert compute_gpqa_reward("answer: D", "x", {"correct_letter": "d"}) == 1.0


@pytest.mark.parametrize("rm_type", ["math", "dapo", "f1"])
def test_a_rule_that_compares_text_refuses_a_dict_label_naming_its_type(rm_type):
    with pytest.raises(ValueError, match=f"^rm_type {rm_type}: the label is a dict .* takes a string or a number"):
        asyncio.run(async_rm(args_for(rm_type=rm_type), sample("\\boxed{1}", {"ground_truth": "1"})))


def test_ifbench_without_ifbench_s_library_says_what_is_missing_in_one_line():
    with pytest.raises(ImportError, match="^rm_type ifbench needs IFBench's evaluation_lib"):
        compute_ifbench_reward("text", None, {"instruction_id_list": ["count:word_count_range"]})
    assert compute_ifbench_reward("text", None, {}) == 0.0  # nothing to check: 0, as slime scores it


def test_batched_async_rm_scores_a_list_by_args_rm_type_in_order_with_per_sample_overrides():
    samples = [sample("</think> \\boxed{12}", "12"), sample("</think> \\boxed{13}", "12"),
               sample("the cat sat", "a cat sat down", rm_type="f1"),  # metadata rm_type wins, as in slime
               sample("see \\boxed{the cat sat}", "cat sat down", rm_type="boxed_f1")]
    rewards = asyncio.run(batched_async_rm(args_for(rm_type="deepscaler"), samples))
    assert rewards == [1, 0, pytest.approx(0.8), pytest.approx(0.8)]
    assert asyncio.run(async_rm(args_for(rm_type="math"), sample("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"))) == 1
    assert asyncio.run(async_rm(args_for(rm_type="math"), sample("\\boxed{\\sqrt{4}}", "2"))) == 0  # integer label
    assert asyncio.run(async_rm(args_for(rm_type="dapo"), sample("Answer: 5", 5)))["score"] == 1.0
    assert asyncio.run(async_rm(args_for(rm_type="random"), sample("", ""))) in (0, 1)
    with pytest.raises(NotImplementedError, match="rm_type 'bleu' is not a rule-based reward"):
        asyncio.run(async_rm(args_for(rm_type="bleu"), sample("", "")))
    with pytest.raises(NotImplementedError, match="no rule-based reward is named"):
        asyncio.run(async_rm(args_for(), sample("", "")))


async def length_reward(args, sample, **kwargs):
    return float(len(sample.response))


async def lengths_reward(args, samples, **kwargs):
    return [float(len(s.response)) for s in samples]


def test_custom_rm_paths_come_first_the_sample_s_then_args_and_batched_passes_the_whole_list():
    here = f"{__name__}.length_reward"
    assert asyncio.run(async_rm(args_for(rm_type="deepscaler", custom_rm_path=here), sample("abc", "1"))) == 3.0
    own = Sample(response="abcd", label="1", custom_rm_path=here)
    assert asyncio.run(async_rm(args_for(rm_type="math"), own)) == 4.0
    batched = args_for(custom_rm_path=f"{__name__}.lengths_reward")
    assert asyncio.run(batched_async_rm(batched, [sample("a", ""), sample("abc", "")])) == [1.0, 3.0]


async def score_with_a_reward_service(sample_to_score, **args_values):
    """remote_rm against a reward service on loopback that answers {"score": len(response)}, its first request with
    a 503; (the answer, the bodies the service received)."""
    from aiohttp import web

    seen = []

    async def score(request):
        seen.append(await request.json())
        if len(seen) == 1:
            return web.json_response({}, status=503)
        return web.json_response({"score": len(seen[-1]["response"])})

    app = web.Application()
    app.router.add_post("/score", score)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/score"
        return await async_rm(args_for(rm_type="remote_rm", rm_url=url, **args_values), sample_to_score), seen
    finally:
        await runner.cleanup()


def test_remote_rm_posts_prompt_response_and_label_to_rm_url_and_retries_a_failed_try():
    answer, seen = asyncio.run(score_with_a_reward_service(
        Sample(prompt="p", response="four", label={"ground_truth": "4"})))
    assert answer == {"score": 4}
    assert seen == [{"prompt": "p", "response": "four", "label": {"ground_truth": "4"}}] * 2
    with pytest.raises(ValueError, match="rm_type remote_rm needs args.rm_url"):
        asyncio.run(async_rm(args_for(rm_type="remote_rm"), sample("", "")))


def test_rm_type_scores_a_text_task_s_response_with_slime_s_rule():
    from rollout_fns.slime_rewards import rm_hub_reward

    done = SluiceSample(prompt_tokens=[1], response_tokens=[2], metadata={"choices": ["x", "y"]})
    assert rm_hub_reward("</think> \\boxed{6}", "6", done, rm_type="deepscaler") == {"score": 1.0}
    assert rm_hub_reward("Answer: 7", "6", done, rm_type="dapo") == {"score": -1.0, "acc": 0.0}
    assert rm_hub_reward("The answer is B", "y", done, rm_type="gpqa") == {"score": 1.0}  # y is option B
    assert grade_answer_sympy("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2")


def test_rm_type_takes_the_built_in_verifiers_length_penalty_as_make_rehearse_s_shrink_sets_it():
    """`make rehearse` gives a recipe with dynamic sampling `max_response_chars` / `length_penalty` on its reward (a
    random tiny policy otherwise scores every answer alike); the slime scripts' --rm-type reward refused them at
    start-up (`reward function ... cannot be called ... got an unexpected keyword argument 'max_response_chars'`)."""
    from rollout_fns.slime_rewards import rm_hub_reward
    from rollout_fns.text_data import _check_reward_call

    args = {"rm_type": "math", "max_response_chars": 8, "length_penalty": 0.5}
    _check_reward_call(rm_hub_reward, "rollout_fns.slime_rewards:rm_hub_reward", args)
    done = SluiceSample(prompt_tokens=[1], response_tokens=[2])
    assert rm_hub_reward("\\boxed{6}", "6", done, **args) == {"score": 0.5, "too_long": 1.0}
    assert rm_hub_reward("\\boxed{6}", "6", done, **{**args, "max_response_chars": 20}) == {"score": 1.0,
                                                                                         "too_long": 0.0}
    assert rm_hub_reward("\\boxed{6}", "6", done, rm_type="math") == {"score": 1.0}  # no limit: the rule's alone
