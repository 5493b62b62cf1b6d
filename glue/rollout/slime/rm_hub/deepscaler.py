"""slime.rollout.rm_hub.deepscaler (`--rm-type deepscaler`): 1 when the boxed answer after the reasoning equals the
label, else 0. The reasoning ends at the last `</think>` (or the answer follows `###Response`); a response with
neither scores 0, as does one without a boxed answer. sluice's own code over math_utils' graders."""
from __future__ import annotations

from typing import Any

from glue.rollout.slime.rm_hub.labels import label_text
from glue.rollout.slime.rm_hub.math_utils import extract_answer, grade_answer_mathd, grade_answer_sympy


def get_deepscaler_rule_based_reward(response: str, label: Any) -> int:
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    answer = extract_answer(solution)
    if answer is None or label == "":
        return 0
    truth = label_text(label, "deepscaler")
    if "\\boxed" in truth:
        truth = extract_answer(truth)
        if truth is None:
            return 0
    return int(grade_answer_mathd(answer, truth) or grade_answer_sympy(answer, truth))
