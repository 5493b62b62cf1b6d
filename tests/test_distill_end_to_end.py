"""On-policy distillation through every real seam: a teacher fleet (its own strict engine behind its own sgl-router)
scores the student's sampled tokens, the scores ride on the samples into the megatron-core trainer's batch, and the
trainer's loss is the reverse KL to the teacher. One short run (module fixture) serves every assertion."""
import math
import os

import pytest
import torch

from glue.loop.replay import load_step
from glue.metrics.logger import read_metrics
from launch.config import load_config
from launch.run.runner import run
from helpers.processes import live_children


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("distill")
    before = set(live_children(os.getpid()))
    cfg = load_config("examples/configs/distill.yaml", [
        f"run.output_dir={out}", "run.name=e2e", "run.num_steps=2", "run.save_rollouts=true",
        "rollout.num_engines=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "cluster.engine=sglang_strict", "eval.interval=0",
        "teacher.center=false"])  # uncentered, the trainer's loss is the mean reverse KL itself (checked below)
    run_dir = run(cfg)
    return {"run_dir": run_dir, "records": read_metrics(run_dir / "metrics.jsonl"),
            "left_running": set(live_children(os.getpid())) - before}


def logprobs_of(model, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    scored = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return scored.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()


def trained_samples(run_dir, step: int):
    groups, withheld = load_step(run_dir, step)
    return [s for g in groups for s in g.samples if s.response_tokens and (s.group_id, s.index) not in withheld]


@pytest.mark.slow
def test_the_teacher_engines_scores_are_the_teachers_logprobs_of_the_students_tokens(distill_run):
    from transformers import AutoModelForCausalLM

    run_dir = distill_run["run_dir"]
    teacher = AutoModelForCausalLM.from_pretrained(run_dir / "teacher_model", dtype=torch.float32).eval()
    samples = trained_samples(run_dir, 1)
    assert len(samples) == 16
    worst = max(abs(a - b) for s in samples
                for a, b in zip(s.teacher_logprobs, logprobs_of(teacher, s.prompt_tokens, s.response_tokens)))
    assert all(len(s.teacher_logprobs) == len(s.response_tokens) for s in samples)
    assert worst < 1e-4, worst
    # the teacher copies the token it reads: it is sure of echoes and rules out the random student's other tokens
    echoes = [lp for s in samples for t, lp, prev in zip(s.response_tokens, s.teacher_logprobs,
                                                          [s.prompt_tokens[-1], *s.response_tokens]) if t == prev]
    others = [lp for s in samples for t, lp, prev in zip(s.response_tokens, s.teacher_logprobs,
                                                         [s.prompt_tokens[-1], *s.response_tokens]) if t != prev]
    assert echoes and min(echoes) > math.log(0.95) and max(others) < math.log(0.01)


@pytest.mark.slow
def test_the_trainers_loss_is_the_reverse_kl_to_the_teacher_on_the_trained_tokens(distill_run):
    run_dir, records = distill_run["run_dir"], distill_run["records"]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        samples = trained_samples(run_dir, record["step"])
        k = [r - t for s in samples for r, t, m in zip(s.rollout_logprobs, s.teacher_logprobs, s.loss_mask) if m]
        assert record["distill/reverse_kl"] == pytest.approx(sum(k) / len(k), abs=1e-5)
        # ppo_clip at ratio 1 with token_mean: the loss is -mean(advantage) = mean(k) only if every trained token's
        # advantage is -(log pi_student - log pi_teacher) (the task's GRPO advantages average ~0 per group)
        assert record["train/loss"] == pytest.approx(record["distill/reverse_kl"], abs=1e-3)
        assert record["distill/reverse_kl"] > 1.0  # a random student is far from the copying teacher


@pytest.mark.slow
def test_the_update_moves_the_student_the_way_the_teachers_advantages_point(distill_run):
    from transformers import AutoModelForCausalLM

    run_dir = distill_run["run_dir"]
    before = AutoModelForCausalLM.from_pretrained(run_dir / "init_model", dtype=torch.float32).eval()
    after = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32).eval()
    gain = 0.0
    for s in trained_samples(run_dir, 1):
        delta = [b - a for a, b in zip(logprobs_of(before, s.prompt_tokens, s.response_tokens),
                                       logprobs_of(after, s.prompt_tokens, s.response_tokens))]
        gain += sum(-(r - t) * d for r, t, d in zip(s.rollout_logprobs, s.teacher_logprobs, delta))
    assert gain > 0, "the tokens the teacher prefers did not gain probability against the others"
    assert not distill_run["left_running"], "processes left running after the run (the teacher's fleet?)"
