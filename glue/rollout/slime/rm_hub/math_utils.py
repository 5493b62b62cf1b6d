"""slime.rollout.rm_hub.math_utils as slime's functions call it: the last `\\boxed{}` answer of a response and whether
it equals a ground truth, first as normalised LaTeX text (`grade_answer_mathd`), then as a sympy expression
(`grade_answer_sympy`); `grade_answer_verl` chains the two on a response's boxed answer. sluice's own code; sympy is
imported on first use.

Rules, as slime grades: an integer ground truth needs an integer answer of the same value (no simplification);
two plain fractions `a/b` compare as written (an unreduced one is wrong); tuples and intervals compare element by
element with the same brackets; expressions with more than two unknown letters or huge powers are not evaluated.
"""
from __future__ import annotations

import re
from typing import Any

from glue.rollout.slime.rm_hub.labels import label_text

BOXES = ("\\boxed", "\\fbox")
UNIT_WORDS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
              "year", "foot", "feet", "inch", "yard")
SCALES = {"million": "*10^6", "billion": "*10^9", "trillion": "*10^12"}
BRACKETS = "()[]"
LATEX_WORDS = {"\\pi": "pi", "\\infty": "oo", "\\cdot": "*", "\\times": "*", "\\div": "/", "\\le": "<=",
               "\\ge": ">="}


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`) of `text` with its command and balanced braces, or None."""
    start = max(text.rfind(box) for box in BOXES)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def remove_boxed(boxed: str | None) -> str | None:
    """`\\boxed{x}` -> `x`; anything else -> None."""
    if boxed is None or not boxed.startswith("\\boxed{") or not boxed.endswith("}"):
        return None
    return boxed[len("\\boxed{"):-1]


def extract_boxed_answer(solution: str) -> str | None:
    return remove_boxed(last_boxed_only_string(solution))


def extract_answer(passage: str) -> str | None:
    """The last boxed answer of `passage`, or None when it has no `\\boxed`."""
    return extract_boxed_answer(passage) if "\\boxed" in passage else None


def _unwrap_text(answer: str) -> str:
    match = re.fullmatch(r"\\text\{(.+?)\}", answer)
    return match.group(1) if match else answer


def _braced_shorthand(answer: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{x}` -> `\\frac{1}{x}`, `\\sqrt3` -> `\\sqrt{3}`."""
    answer = re.sub(r"\\frac(?!\{)(\w)(?!\{)(\w)", r"\\frac{\1}{\2}", answer)
    answer = re.sub(r"\\frac(?!\{)(\w)\{", r"\\frac{\1}{", answer)
    answer = re.sub(r"\\frac\{([^{}]*)\}(?!\{)(\w)", r"\\frac{\1}{\2}", answer)
    return re.sub(r"\\sqrt(?![{\[])(\w)", r"\\sqrt{\1}", answer)


def mathd_normalize_answer(answer: str | None) -> str | None:
    """An answer as LaTeX text with its cosmetic differences removed (spacing, `\\left`, `\\dfrac`, degrees, dollar
    and percent signs, trailing `\\text{ units}`, a short `x =` in front, shorthand fractions, `a/b` of integers)."""
    if answer is None:
        return None
    text = _unwrap_text(answer.strip()).strip()
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""), ("\\%", "")):
        text = text.replace(old, new)
    text = text.split("\\text{ ")[0] if text.count("\\text{ ") == 1 else text
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    left, eq, right = text.partition("=")
    if eq and "=" not in right and len(left.strip()) <= 2:
        text = right
    text = _braced_shorthand(text).replace(" ", "")
    if text == "0.5":
        text = "\\frac{1}{2}"
    fraction = re.fullmatch(r"(-?\d+)/(\d+)", text)
    return f"\\frac{{{fraction.group(1)}}}{{{fraction.group(2)}}}" if fraction else text


def _group_thousands(expr: str) -> str:
    """`1,234,567` -> `1234567`, leaving the commas of tuples alone."""
    previous = None
    while previous != expr:
        previous, expr = expr, re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", expr)
    return expr


def _latex_to_plain(expr: str) -> str:
    """The LaTeX that answers use, as a plain expression sympy's parser reads."""
    expr = expr.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    expr = _braced_shorthand(expr)
    previous = None
    while previous != expr:  # innermost first, so nested fractions and roots unfold
        previous = expr
        expr = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", expr)
        expr = re.sub(r"\\sqrt\[([^\]]*)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", expr)
        expr = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", expr)
    for word, plain in LATEX_WORDS.items():
        expr = expr.replace(word, f" {plain} ")
    expr = re.sub(r"\\(left|right|,|;|!|quad)", "", expr)
    return expr.replace("\\", "")


def _normalize(expr: str | None) -> str | None:
    """An answer as a lower-case plain expression: no units, no `$`/`%`, no thousands commas, LaTeX unfolded,
    mixed numbers `7 3/4` as `7+3/4`, an integral float as an integer."""
    if expr is None:
        return None
    expr = _unwrap_text(expr)
    for old, new in (("\\%", ""), ("\\$", ""), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     *SCALES.items()):
        expr = expr.replace(old, new)
    for unit in UNIT_WORDS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\{?\\circ\}?", "", expr)
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    if "\\" in expr:
        expr = _latex_to_plain(expr)
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"(\d) +(\d)", r"\1+\2", expr)
    expr = expr.replace(" ", "").replace("{", "(").replace("}", ")").lower()
    number = _group_thousands(expr)
    try:
        value = float(number)
    except ValueError:
        return expr
    return str(int(round(value))) if abs(value - round(value)) <= 1e-7 else expr


def _is_int(expr: str) -> bool:
    try:
        value = float(_group_thousands(expr))
    except ValueError:
        return False
    return abs(value - round(value)) <= 1e-7


def _is_plain_fraction(expr: str) -> bool:
    return re.fullmatch(r"-?\d+/0*[1-9]\d*", expr) is not None


def _elements(expr: str) -> list[str]:
    """The elements of a tuple or interval `(a,b)` / `[a,b)`, or [expr]."""
    expr = _group_thousands(expr)
    if len(expr) > 2 and expr[0] in BRACKETS and expr[-1] in BRACKETS and \
            not any(ch in expr[1:-1] for ch in BRACKETS):
        return [part.strip() for part in expr[1:-1].split(",")]
    return [expr] if expr else []


def _may_evaluate(expr: str) -> bool:
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    return len(letters) <= 2 and "^{" not in expr and "^(" not in expr and \
        re.search(r"\^\d+\^|\^\d\d+", expr) is None


def _sympy_equal(truth: str, given: str) -> bool:
    """sympy's verdict on truth - given == 0; an expression it cannot read is not equal."""
    difference = f"({truth})-({given})"
    if not _may_evaluate(difference):
        return False
    import sympy
    from sympy.parsing import sympy_parser

    names = {k: v for k, v in vars(sympy).items() if not k.startswith("_")}
    transforms = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        parsed = sympy_parser.parse_expr(difference.replace("^", "**"), local_dict={},
                                         global_dict={"__builtins__": {}, **names}, transformations=transforms)
        return sympy.simplify(parsed) == 0
    except Exception:  # noqa: BLE001 - an answer sympy cannot read is wrong, not an error
        return False


def _element_equal(truth: str, given: str) -> bool:
    if _is_plain_fraction(truth) and _is_plain_fraction(given):
        return truth == given
    if _is_int(truth) != _is_int(given):
        return False
    return truth == given or _sympy_equal(truth, given)


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    truth, given = _normalize(ground_truth), _normalize(given_answer)
    if truth is None or given is None:
        return False
    if truth == given:
        return True
    if not given:
        return False
    truths, givens = _elements(truth), _elements(given)
    if len(truths) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # an open interval is not a closed one
    return len(truths) == len(givens) and all(_element_equal(t, g) for t, g in zip(truths, givens))


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    return mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given_answer)


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the last boxed answer of `solution_str` equals `ground_truth` (itself boxed or plain)."""
    if not ground_truth:
        return False
    truth = label_text(ground_truth, "math")
    if "\\boxed" in truth:
        truth = extract_answer(truth)
    given = extract_answer(solution_str)
    if given is None or truth is None:
        return False
    return grade_answer_mathd(given, truth) or grade_answer_sympy(given, truth)
