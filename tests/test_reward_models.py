"""Reward models without engines: the judge's parsers and template, how model scores join the task's reward, the
config checks, the shrinker's handling of judge/RM checkpoints, and the scalar reward model on a tiny
sequence-classification checkpoint (scores equal a direct transformers forward; batching several groups into one
forward changes nothing; a response not scored in time is counted)."""
import asyncio
import math

import pytest

from glue.rewards.judge import fill_template, load_parser
from glue.rewards.models import ModelRewardFailed, ModelRewards, SampleText
from glue.types import Sample, SampleStatus
from launch.config import ConfigError, load_config
from rollout_fns.judge import first_number_parser, score_parser, yes_no_parser

TEXTS = [SampleText(prompt=f"What is {a}+{b}?", response=f"{a + b + w}", label=str(a + b))
         for a, b, w in [(1, 2, 0), (3, 4, 1), (0, 0, 0), (7, 8, 2), (9, 9, 0), (2, 5, 3), (6, 1, 0)]]
TEXTS.append(SampleText(prompt="A much longer question so that rows of one batch have different lengths: 12+30?",
                        response="The answer is 42, I am quite sure of it.", label="42"))


def test_the_parsers_read_the_score_or_refuse_with_value_error():
    assert score_parser("I think it is fine. Score: 7") == 7.0
    assert score_parser("score = 2.5 ... final Score:9") == 9.0
    assert first_number_parser("8/10") == 8.0 and first_number_parser("about -3 points") == -3.0
    assert yes_no_parser("Yes, correct.") == 1.0 and yes_no_parser(" no!") == 0.0
    for parser, text in ((score_parser, "7 out of 10"), (first_number_parser, "great"), (yes_no_parser, "maybe")):
        with pytest.raises(ValueError):
            parser(text)


def test_the_template_fills_prompt_response_and_label_and_leaves_other_braces():
    text = SampleText(prompt="What is 1+2?", response="\\boxed{3}", label="3")
    assert fill_template("Q: {prompt} A: {response} gold {label} \\boxed{x}", text) == \
        "Q: What is 1+2? A: \\boxed{3} gold 3 \\boxed{x}"


def test_a_parser_path_is_checked_at_start_up():
    assert load_parser("rollout_fns.judge:score_parser") is score_parser
    with pytest.raises(AttributeError):
        load_parser("rollout_fns.judge:score_parsr")
    with pytest.raises(TypeError, match="fn\\(judge_text\\)"):
        load_parser("rollout_fns.verifiers:math_reward")  # needs (response_text, label, ...)


def test_judge_and_reward_model_settings_are_validated_naming_the_key():
    cfg = load_config(None, ["judge.timeout_s=5", "reward_model.batch_size=4", "reward.task_weight=0"])
    assert cfg.judge.timeout_s == 5 and cfg.judge.model.tiny.tokenizer and cfg.reward_model.batch_size == 4
    assert load_config(None, []).judge is None and load_config(None, []).reward_model is None
    for override, key in (("judge.prompt_template=rate it", "judge.prompt_template"),
                          ("judge.on_failure=retry", "judge.on_failure"), ("judge.timeout_s=0", "judge.timeout_s"),
                          ("judge.parser=not a path", "judge.parser"),
                          ("judge.model.tiny.tokenizer=false", "judge.model.tiny.tokenizer"),
                          ("reward_model.batch_size=0", "reward_model.batch_size")):
        with pytest.raises(ConfigError, match=key.replace(".", "\\.")):
            load_config(None, [override])


class FixedScorer:
    """A reward model double: fixed scores (None = could not score)."""

    def __init__(self, name, scores, weight=1.0, on_failure="zero"):
        self.name, self.scores, self.weight, self.on_failure = name, scores, weight, on_failure
        self.section = name

    async def score(self, texts):
        return [{"score": s, "error": None if s is not None else "timed out"} for s in self.scores[:len(texts)]]

    def metrics(self):
        return {}


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def group(rewards):
    return [Sample(prompt_tokens=[0, 1], response_tokens=[2, 3], loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
                   versions=[0, 0], reward=r, index=i, status=SampleStatus.COMPLETED) for i, r in enumerate(rewards)]


def test_model_scores_join_the_task_reward_with_their_weights_and_failures_score_zero():
    samples = group([1.0, {"score": 0.5, "correct": 1.0}, 0.0])
    samples[2].status = SampleStatus.FAILED  # a failed sample is not scored
    rewards = ModelRewards(scorers=[FixedScorer("judge", [7.0, None], weight=0.1),
                                    FixedScorer("rm", [-0.5, 2.0], weight=2.0)],
                           tokenizer=CharTokenizer(), task_weight=0.5)
    asyncio.run(rewards(samples))
    assert samples[0].reward == pytest.approx({"task": 1.0, "judge": 7.0, "rm": -0.5, "score": 0.5 + 0.7 - 1.0})
    assert samples[1].reward == pytest.approx({"correct": 1.0, "task": 0.5, "judge": 0.0, "rm": 2.0,
                                               "score": 0.25 + 0.0 + 4.0})
    assert samples[1].metadata["judge"]["error"] == "timed out" and samples[2].reward == 0.0
    assert rewards.text_of(samples[0]) == SampleText(prompt="ab", response="cd", label="")


def test_a_failure_with_drop_group_fails_the_group():
    rewards = ModelRewards(scorers=[FixedScorer("judge", [1.0, None], on_failure="drop_group")],
                           tokenizer=CharTokenizer())
    with pytest.raises(ModelRewardFailed, match="judge could not score 1 of 2 samples .*judge.on_failure: drop_group"):
        asyncio.run(rewards(group([0.0, 0.0])))


def test_the_shrinker_swaps_judge_and_reward_model_checkpoints_for_tiny_text_models(tmp_path):
    from launch.tools.shrink import shrink

    raw = {"model": {"path": "/m/Qwen3-8B"}, "rollout": {"task": "rollout_fns.toy_tasks:EchoTask"},
           "judge": {"model": {"path": "/m/Qwen3-32B"}, "num_engines": 4, "timeout_s": 60},
           "reward_model": {"model": {"path": "/m/Skywork-Reward-Llama-3.1-8B"}, "batch_size": 32}}
    shrunk = shrink(raw, data_dir=tmp_path)
    judge, rm = shrunk.raw["judge"], shrunk.raw["reward_model"]
    assert judge["model"]["path"] is None and judge["model"]["tiny"]["tokenizer"] and judge["num_engines"] == 1
    assert rm["model"]["path"] is None and rm["model"]["tiny"]["family"] == "llama"
    assert shrunk.record.kept["judge.timeout_s"] == 60 and shrunk.record.kept["reward_model.batch_size"] == 32
    assert shrunk.record.scaled["judge.num_engines"]["from"] == 4


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from glue.rewards.scalar_rm import save_tiny_reward_model

    return save_tiny_reward_model(str(tmp_path_factory.mktemp("rm")), vocab_size=272, seed=3)


def direct_scores(path, texts):
    """The reference: transformers' own model, one text per forward, no padding."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for t in texts:
        chat = [{"role": "user", "content": t.prompt}, {"role": "assistant", "content": t.response}]
        ids = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False,
                        return_tensors="pt").input_ids
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_the_scalar_reward_model_scores_as_a_direct_forward_and_batches_groups_together(rm_dir):
    from glue.rewards.scalar_rm import ScalarRewardModel

    expected = direct_scores(rm_dir, TEXTS)
    assert len({round(v, 6) for v in expected}) == len(TEXTS)  # the texts really score differently
    rm = ScalarRewardModel(path=rm_dir, batch_size=16)

    async def three_groups():  # three groups finishing together: queued before the first forward starts
        return await asyncio.gather(rm.score(TEXTS[:3]), rm.score(TEXTS[3:5]), rm.score(TEXTS[5:]))

    verdicts = [v for g in asyncio.run(three_groups()) for v in g]
    assert rm.batch_sizes == [len(TEXTS)]  # one forward for all of them
    assert [v["score"] for v in verdicts] == pytest.approx(expected, abs=1e-5)
    one_at_a_time = [rm.forward([rm.render(t)])[0] for t in TEXTS]
    assert one_at_a_time == pytest.approx(expected, abs=1e-5)
    metrics = rm.metrics()
    assert metrics["reward/rm_calls"] == len(TEXTS) and metrics["reward/rm_batches"] == 1
    assert metrics["reward/rm_timeouts"] == 0 and metrics["reward/rm_s"] > 0
    assert rm.metrics()["reward/rm_calls"] == 0  # counts are per step: read and reset

    small = ScalarRewardModel(path=rm_dir, batch_size=3)
    scores = [v["score"] for v in asyncio.run(small.score(TEXTS))]
    assert small.batch_sizes == [3, 3, 2] and scores == pytest.approx(expected, abs=1e-5)
    asyncio.run(rm.aclose())
    asyncio.run(small.aclose())


def test_a_reward_model_too_slow_for_its_timeout_is_counted_and_scores_nothing(rm_dir):
    from glue.rewards.scalar_rm import ScalarRewardModel

    rm = ScalarRewardModel(path=rm_dir, batch_size=16, timeout_s=1e-4)
    verdicts = asyncio.run(rm.score(TEXTS))
    assert all(v["score"] is None and "timed out" in v["error"] for v in verdicts)
    metrics = rm.metrics()
    assert metrics["reward/rm_timeouts"] == len(TEXTS) and "reward/rm_s" not in metrics
    asyncio.run(rm.aclose())
    assert not any(math.isnan(x) for x in direct_scores(rm_dir, TEXTS[:1]))


def test_a_dry_run_refuses_a_judge_parser_that_does_not_import(tmp_path):
    from launch.run.preflight import check_plugins

    assert "plugins:" in check_plugins(load_config("examples/configs/judge_reward.yaml"))
    with pytest.raises(ConfigError, match="score_parsr"):
        check_plugins(load_config("examples/configs/judge_reward.yaml", ["judge.parser=rollout_fns.judge:score_parsr"]))


def test_a_judge_on_a_policy_without_a_tokenizer_is_refused_before_anything_starts():
    from launch.run.preflight import check_tokenizer

    cfg = load_config("examples/configs/demo.yaml", ["judge.num_engines=1"])  # EchoTask's token-id tiny model
    with pytest.raises(ConfigError, match="judge: / reward_model: .*model.tiny.tokenizer: true"):
        check_tokenizer(cfg, plan_only=False)
    assert "judge: / reward_model:" in check_tokenizer(load_config("examples/configs/judge_reward.yaml"),
                                                         plan_only=False)
