"""slime.rollout.rm_hub.math_dapo_utils as slime's functions call it (retool, strands): DAPO's math reward.
`compute_score(solution, ground_truth, strict_box_verify=False)` -> {"score": 1.0 or -1.0, "acc": bool, "pred"}.

Two ways to read the answer, both on the end of the response only (its last 300 characters, 100 for the box):
the last `Answer: ...` line, normalised and compared with the ground truth as an integer (DAPO's answers are
integers; a ground truth that is not a number is compared as normalised text), or with `strict_box_verify` the last
`\\boxed{...}` compared with the ground truth character for character. sluice's own code.
"""
from __future__ import annotations

import re

from glue.rollout.slime.rm_hub.labels import label_text

ANSWER_LINE = r"(?i)Answer\s*:\s*([^\n]+)"
SOLUTION_TAIL = 300  # characters of the response read at all
BOX_TAIL = 100  # characters the strict box is looked for in
UNIT_WORDS = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "points", "feet",
              "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
              "multiples")
NOISE = ("\\ldots", "\\dots", "\\;", ",\\!", "{,}", '"', "^\\circ", "^{\\circ}", "\\mathrm{th}", "<|im_end|>",
         "<|endoftext|>")


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` of `string` with balanced braces, or None."""
    start = string.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(string)):
        depth += {"{": 1, "}": -1}.get(string[i], 0)
        if depth == 0 and string[i] == "}":
            return string[start:i + 1]
    return None


def remove_boxed(s: str) -> str:
    """`\\boxed{x}` -> `x`; ValueError for anything else."""
    if not (s.startswith("\\boxed{") and s.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} expression: {s[:80]!r}")
    return s[len("\\boxed{"):-1]


def _unwrap(command: str, text: str, *, greedy: bool = False) -> str:
    body = ".*" if greedy else ".*?"
    return re.sub(rf"\\{command}\{{({body})\}}", r"\1", text)


def normalize_final_answer(final_answer: str) -> str:
    """A final answer without what does not change it: the part after the last `=`, spaces, articles, units,
    `\\text{}` / `\\textbf{}` / `\\overline{}` / `\\boxed{}` wrappers, dollar signs, shorthand `\\frac12`, and the
    thousands commas of a whole number."""
    text = str(final_answer).split("=")[-1]
    text = re.sub(r"\b(an|a) ", "", text)
    for old, new in ((".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"), (",\\text{and}", ","),
                     ("\\text{and}", ","), ("\\text{m}", "\\text{}")):
        text = text.replace(old, new)
    for noise in (*NOISE, *UNIT_WORDS, "\\text{s}", "\\text{}"):
        text = text.replace(noise, "")
    inline = re.fullmatch(r".*?\$(.*?)\$.*", text, flags=re.S)
    if inline:
        text = inline.group(1)
    for command in ("text", "textbf", "overline"):
        text = _unwrap(command, text)
    text = _unwrap("boxed", text, greedy=True)
    text = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", text)
    text = re.sub(r"sqrt([^{])", r"sqrt{\1}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def _as_integer_text(value: str) -> str:
    try:
        return str(int(float(value)))
    except ValueError:
        return value  # not a number: compared as normalised text


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False,
                       answer_pattern: str = ANSWER_LINE) -> tuple[bool, str]:
    """Whether the last `Answer: ...` of the solution equals `gt` (boxed when `gt_need_extract`); and that answer."""
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    if gt_need_extract:
        boxed = last_boxed_only_string(gt)
        gt = remove_boxed(boxed) if boxed is not None else gt
    truth = _as_integer_text(normalize_final_answer(gt))
    return pred == truth, pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """1 when the last box near the end holds exactly `gt`, else -1; and the boxed text (None without a box).
    With `pause_tokens_index` (four positions) the box is looked for from 100 characters before the last."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 positions, got {len(pause_tokens_index)}")
        pred = pred[pause_tokens_index[-1] - BOX_TAIL:]
    else:
        pred = pred[-BOX_TAIL:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict:
    """{"score": 1.0 for a correct answer, -1.0 otherwise, "acc": whether correct, "pred": the answer read}."""
    truth = label_text(ground_truth, "dapo")
    correct, pred = verify(solution_str[-SOLUTION_TAIL:], truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}
