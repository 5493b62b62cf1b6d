"""The text_arith recipe for a few steps through every real seam (Ray, embedded engines behind sgl-router, megatron on
gloo): the model, its tokenizer and both data files are made in the run folder, eval runs at step 0 and every
interval on the weights just synced without any eval group reaching the training buffer, and dynamic sampling
drops and counts the groups with equal rewards."""
import os

import pytest

from glue.metrics.logger import read_metrics
from launch.config import load_config
from launch.run.runner import run
from helpers.processes import live_children
from helpers.runs import expand


def first_token_mod4(response_text, label, sample):
    """A reward a random policy gets right about a quarter of the time, so groups of 4 are sometimes all equal."""
    hit = float(bool(sample.response_tokens) and sample.response_tokens[0] % 4 == 0)
    return {"score": hit, "correct": hit}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync"])  # async mode: test_evaluation runs the loop with eval in both modes
def test_text_arith_evaluates_at_the_start_and_every_interval_outside_the_buffer_and_filters_flat_groups(
        tmp_path, mode):
    before = set(live_children(os.getpid()))
    cfg = load_config("examples/configs/text_arith.yaml", [
        f"run.output_dir={tmp_path}", f"run.mode={mode}", "run.num_steps=4", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "rollout.dynamic_sampling=true", f"rollout.task_args.path={tmp_path}/train.jsonl",
        "rollout.task_args.reward=test_text_arith_end_to_end:first_token_mod4",
        f"eval.task_args.path={tmp_path}/test.jsonl", "eval.interval=2", "eval.num_prompts=6",
        "eval.samples_per_prompt=2", "eval.pass_at_k=[1, 2]"])
    run_dir = run(cfg)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    evaluated = {r["step"]: r for r in records if "eval/reward_mean" in r}
    assert sorted(evaluated) == [0, 2, 4]
    for step, r in evaluated.items():  # each eval ran right after that step's sync, on its weights
        assert r["eval/weight_version"] == r["eval/weight_version_max"] == step
        assert r["eval/num_samples"] == 12 and r["eval/failed_groups"] == 0
        assert 0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1 and r["eval/time_s"] > 0
    steps = records[1:]
    trained = [i for r in steps for i in expand(r["rollout/group_ids"])]
    # eval never reached the buffer: 4 training groups of 4 samples per step, non-negative ids, none twice
    assert [r["rollout/num_samples"] for r in steps] == [16] * 4
    assert len(trained) == len(set(trained)) == 16 and min(trained) >= 0
    assert all(r["rollout/zero_std_group_frac"] == 0 for r in steps)  # flat groups were dropped, not trained
    filtered = sum(r["rollout/filtered_groups"] for r in steps)
    if mode == "sync":  # every group drawn was trained or dropped, and the last one drawn was trained
        assert filtered == max(trained) + 1 - len(trained) > 0  # a quarter hit rate makes ~1 group in 3 flat
    assert all(r["rollout/filtered_prompts"] == 0 and "reward/correct" in r for r in steps)
    assert (tmp_path / "train.jsonl").exists() and (tmp_path / "test.jsonl").exists()
    assert (run_dir / "init_model" / "tokenizer.json").exists()
    assert set(live_children(os.getpid())) <= before, "processes left running after the run"
