"""loss/distill.py: the reverse-KL advantage of on-policy distillation, worked out by hand."""
import pytest
import torch

from loss.distill import distillation_advantages, reverse_kl_advantages


def test_a_token_the_student_likes_more_than_the_teacher_gets_a_negative_advantage_and_less_a_positive_one():
    student = torch.tensor([[-0.5, -2.0, -1.0, 0.0]])
    teacher = torch.tensor([[-1.5, -0.5, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = reverse_kl_advantages(student, teacher, mask, coef=0.5)
    # -0.5 * (s - t): (-0.5 + 1.5) = 1 -> -0.5; (-2 + 0.5) = -1.5 -> +0.75; equal -> 0; masked -> 0
    assert adv.tolist() == [[-0.5, 0.75, 0.0, 0.0]]


def test_reverse_kl_alone_drops_the_task_advantage_and_plus_task_adds_it():
    student = torch.tensor([[-1.0, -1.0], [-2.0, -0.1]])
    teacher = torch.tensor([[-1.0, -3.0], [-0.5, -0.1]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    task = torch.tensor([[0.7, 0.7], [-0.7, -0.7]])
    alone, metrics = distillation_advantages(task, student_logprobs=student, teacher_logprobs=teacher, mask=mask,
                                             coef=1.0, objective="reverse_kl")
    assert alone.tolist() == [[0.0, -2.0], [1.5, 0.0]]
    both, _ = distillation_advantages(task, student_logprobs=student, teacher_logprobs=teacher, mask=mask,
                                      coef=1.0, objective="reverse_kl_plus_task")
    assert torch.allclose(both, torch.tensor([[0.7, -1.3], [0.8, 0.0]]))
    # k over the 3 valid tokens: 0, 2, -1.5 -> mean 1/6; teacher mean (-1 - 3 - 0.5) / 3
    assert metrics["distill/reverse_kl"] == pytest.approx(0.5 / 3)
    assert metrics["distill/teacher_logprob_mean"] == pytest.approx(-4.5 / 3)
    assert metrics["distill/kl_advantage_abs_mean"] == pytest.approx(3.5 / 3)


def test_an_unknown_objective_is_refused_by_name():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="reverse_kl"):
        distillation_advantages(z, student_logprobs=z, teacher_logprobs=z, mask=z + 1, coef=1.0, objective="forward")


def test_centering_subtracts_the_mean_kl_advantage_of_the_valid_tokens_only():
    student = torch.tensor([[-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-1.0, -4.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, _ = distillation_advantages(torch.zeros(1, 3), student_logprobs=student, teacher_logprobs=teacher, mask=mask,
                                     coef=1.0, objective="reverse_kl", center=True)
    # uncentered: [0, -3, masked]; the valid mean -1.5 is subtracted: the better-than-average token turns positive
    assert adv.tolist() == [[1.5, -1.5, 0.0]]
