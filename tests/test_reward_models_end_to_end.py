"""examples/configs/judge_reward.yaml for two steps through every real seam (Ray, policy engines behind sgl-router, the
judge's own engine behind its own router, megatron-core on gloo, the broadcast bridge): the reward each trained
sample carries is the task's score plus the judge's and the reward model's scores with their weights, and each of
those equals what the judge checkpoint answers and the reward model checkpoint outputs when called directly."""
import json
import os

import pytest

from glue.metrics.logger import read_metrics
from launch.config import load_config
from launch.run.runner import run
from helpers.processes import live_children

STEPS, GROUPS, SAMPLES = 2, 2, 4


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("judge-run")
    before = set(live_children(os.getpid()))
    cfg = load_config("examples/configs/judge_reward.yaml", [
        f"run.output_dir={tmp}", f"run.num_steps={STEPS}", f"rollout.prompts_per_step={GROUPS}",
        f"rollout.samples_per_prompt={SAMPLES}", f"rollout.task_args.path={tmp}/train.jsonl", "run.save_rollouts=true",
        "run.loggers=[jsonl]",  # math_reward's worker processes outlive a run: a reward that starts none
        "rollout.task_args.reward=rollout_fns.verifiers:exact_match_reward"])
    run_dir = run(cfg)
    left = set(live_children(os.getpid())) - before
    trained = [json.loads((run_dir / "rollouts" / f"step_{s:08d}.json").read_text()) for s in range(1, STEPS + 1)]
    return cfg, run_dir, read_metrics(run_dir / "metrics.jsonl"), trained, left


def samples_of(step):
    return [s for g in step["groups"] for s in g["samples"]]


@pytest.mark.slow
def test_the_trained_reward_is_the_task_score_plus_the_weighted_judge_and_reward_model_scores(judged_run):
    cfg, _, records, trained, left = judged_run
    assert not left, f"processes left running after the run: {left}"
    for record, step in zip(records, trained):
        samples = samples_of(step)
        assert len(samples) == GROUPS * SAMPLES
        for s in samples:
            r = s["reward"]
            assert s["metadata"]["judge"]["error"] is None and r["judge"] == float(s["metadata"]["judge"]["text"])
            assert r["rm"] == s["metadata"]["rm"]["score"]
            assert r["score"] == pytest.approx(cfg.reward.task_weight * r["task"] + cfg.judge.weight * r["judge"]
                                               + cfg.reward_model.weight * r["rm"])
        # the trainer's batch is these rewards: the step's reward mean is theirs
        assert record["rollout/reward_mean"] == pytest.approx(sum(s["reward"]["score"] for s in samples) / len(samples))
        assert record["reward/judge"] == pytest.approx(sum(s["reward"]["judge"] for s in samples) / len(samples))
    judged = [s["reward"]["judge"] for step in trained for s in samples_of(step)]
    assert len(set(judged)) > 1, "every response got the same judge score: the judge did not read them"


@pytest.mark.slow
def test_every_judgement_and_rm_score_is_counted_and_timed(judged_run):
    _, _, records, _, _ = judged_run
    total = GROUPS * SAMPLES * STEPS
    assert sum(r["reward/judge_calls"] for r in records) == total
    assert sum(r["reward/rm_calls"] for r in records) == total
    assert sum(r["reward/judge_timeouts"] + r["reward/judge_parse_failures"] + r["reward/judge_errors"]
               for r in records) == 0
    assert all(r["reward/rm_timeouts"] == 0 for r in records)
    assert 0 < sum(r["reward/rm_batches"] for r in records) <= total
    assert all(r["reward/judge_s"] > 0 and r["reward/rm_s"] > 0 for r in records if r["reward/judge_calls"])


@pytest.mark.slow
def test_the_judge_and_reward_model_scores_equal_direct_calls_of_their_checkpoints(judged_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from glue.rewards.judge import fill_template
    from glue.rewards.models import SampleText

    cfg, run_dir, _, trained, _ = judged_run
    policy = AutoTokenizer.from_pretrained(run_dir / "init_model")
    judge_tok = AutoTokenizer.from_pretrained(run_dir / "judge_model")
    judge = AutoModelForCausalLM.from_pretrained(run_dir / "judge_model").eval()
    rm_tok = AutoTokenizer.from_pretrained(run_dir / "reward_model")
    rm = AutoModelForSequenceClassification.from_pretrained(run_dir / "reward_model").eval()
    for s in samples_of(trained[-1]):
        text = SampleText(prompt=policy.decode(s["prompt_tokens"], skip_special_tokens=True),
                          response=policy.decode(s["response_tokens"], skip_special_tokens=True),
                          label=str(s["metadata"]["label"]))
        ids = judge_tok(fill_template(cfg.judge.prompt_template, text), return_tensors="pt").input_ids
        with torch.no_grad():
            answer = judge.generate(ids, max_new_tokens=cfg.judge.max_new_tokens, do_sample=False)
            chat = [{"role": "user", "content": text.prompt}, {"role": "assistant", "content": text.response}]
            rm_ids = rm_tok(rm_tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False,
                            return_tensors="pt").input_ids
            rm_score = float(rm(input_ids=rm_ids).logits[0, 0])
        assert judge_tok.decode(answer[0, ids.shape[1]:], skip_special_tokens=True) == s["metadata"]["judge"]["text"]
        assert s["reward"]["rm"] == pytest.approx(rm_score, abs=1e-5)
