"""On-policy distillation's per-token signal: the reverse KL from the student to a teacher, estimated on the student's
own sampled tokens, turned into a per-token advantage that the policy loss then trains with its usual clip and
off-policy corrections. The driver calls `distillation_advantages` once per step (glue.rewards.teacher). Imports only torch.

For a sampled token y_t, k_t = log pi_student(y_t) - log pi_teacher(y_t) is the single-sample estimate of the
per-token reverse KL, KL(pi_student || pi_teacher) = E_{y ~ pi_student}[k]. Its policy gradient is that of the
return -k_t at token t: the token gets advantage -coef * k_t, so tokens the student likes more than the teacher are
pushed down and tokens it likes less are pushed up (Agarwal et al. 2024, GKD; Thinking Machines' on-policy
distillation, which also uses the per-token, undiscounted form).
"""
from __future__ import annotations

import torch

# objective -> whether the task's advantage is kept beside the KL term
DISTILL_OBJECTIVES = {"reverse_kl": False, "reverse_kl_plus_task": True}


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, *,
                          coef: float) -> torch.Tensor:
    """[B, T] each -> [B, T]: -coef * (student_logprobs - teacher_logprobs) where mask > 0, 0 elsewhere.

    `student_logprobs` are the logprobs the sampling policy gave its tokens (the rollout logprobs): the KL is of the
    policy that generated the data, as in an on-policy gradient; the loss's ratio corrects for the trained weights."""
    k = student_logprobs.detach().to(torch.float64) - teacher_logprobs.detach().to(torch.float64)
    return torch.where(mask > 0, -coef * k, 0.0).to(student_logprobs.dtype)


def distillation_advantages(task_advantages: torch.Tensor, *, student_logprobs: torch.Tensor,
                            teacher_logprobs: torch.Tensor, mask: torch.Tensor, coef: float,
                            objective: str, center: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """All [B, T]. The advantages to train with: the reverse-KL advantage alone (`objective` "reverse_kl") or added
    to `task_advantages` ("reverse_kl_plus_task"), 0 where mask is 0; and metrics over the valid tokens:
    `distill/reverse_kl` (mean k), `distill/teacher_logprob_mean`, `distill/kl_advantage_abs_mean`.
    `center` subtracts the batch's mean reverse-KL advantage over the valid tokens (a baseline: the expected
    gradient is unchanged, up to the baseline's dependence on the batch, and a student that is worse than the teacher
    everywhere no longer pushes down every token it sampled)."""
    if objective not in DISTILL_OBJECTIVES:
        raise ValueError(f"distillation objective must be one of {sorted(DISTILL_OBJECTIVES)}, got {objective!r}")
    kl_adv = reverse_kl_advantages(student_logprobs, teacher_logprobs, mask, coef=coef).to(task_advantages.dtype)
    if center:
        valid_kl = kl_adv[mask > 0]
        kl_adv = torch.where(mask > 0, kl_adv - (valid_kl.mean() if valid_kl.numel() else 0.0), 0.0)
    advantages = kl_adv + task_advantages * (mask > 0) if DISTILL_OBJECTIVES[objective] else kl_adv
    valid = mask > 0
    count = max(int(valid.sum()), 1)
    k = (student_logprobs - teacher_logprobs).to(torch.float64)[valid]
    metrics = {"distill/reverse_kl": float(k.sum()) / count,
               "distill/teacher_logprob_mean": float(teacher_logprobs.to(torch.float64)[valid].sum()) / count,
               "distill/kl_advantage_abs_mean": float(kl_adv.to(torch.float64)[valid].abs().sum()) / count}
    return advantages, metrics
