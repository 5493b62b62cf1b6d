"""Reward functions for text tasks: a decoded response and its data-set label in, a reward dict out. A text task
(`rollout_fns.text_data:TextDataTask`) calls one per sample as `fn(response_text, label, sample, **reward_args)`.

Each returns {"score", "correct", "format_ok", "too_long"} (floats): "score" is what GRPO sees, the other keys
become metrics. The score is 1 for a correct answer, 0 otherwise, minus `format_penalty` when the format is off
and `length_penalty` when the response is over a length limit; both penalties are 0 / off by default.
`math_reward` adds "timed_out" (1 when Math-Verify's judgement ran past its limit and was killed).
Labels may be any JSON value (a text task hands them over as the row holds them); these verifiers take a string or
a number and refuse anything else naming its type (`label_text`); a dict label needs a reward function of its own.
"""
from __future__ import annotations

import functools
import os
import random
import re
import threading
import time
from typing import Any

from glue.rewards.isolated import DeadlineExceeded, IsolatedPool
from glue.types import Sample

BOXED = "\\boxed{"
JUDGE_PROCESSES = max(1, min(8, os.cpu_count() or 1))  # judgements at once: one per core, up to the 8 reward threads
JUDGE_DEADLINE_FACTOR = 4  # the answer's parse, the label's two tries and the comparison, each up to timeout_s
# a judgement past its deadline goes once more in a fresh worker: a stopped or starved worker (the machine's fault,
# not the answer's) then costs the sample nothing; an answer that holds sympy past both deadlines is judged incorrect
JUDGE_TRIES = 2
_JUDGES: IsolatedPool | None = None
_JUDGES_LOCK = threading.Lock()


def math_reward(response_text: str, label: Any, sample: Sample | None = None, *, require_boxed: bool = False,
                format_penalty: float = 0.0, max_response_chars: int | None = None,
                max_response_tokens: int | None = None, length_penalty: float = 0.0,
                timeout_s: int | None = 5) -> dict[str, float]:
    """Whether the response's final answer equals `label` mathematically, by HF Math-Verify: boxed answers, LaTeX
    and plain numbers (`\\frac{1}{2}` equals `0.5`, `\\boxed{19}` equals `19`). An unparseable response is wrong
    (score 0), never an error; an unparseable label raises ValueError.

    require_boxed: only an answer inside `\\boxed{}` counts (otherwise the last number or expression does).
    format_penalty: subtracted when the response has no complete `\\boxed{...}` ("format_ok" is 0).
    timeout_s: Math-Verify's limit per parse and per comparison. The judgement then runs in a worker process
    (`glue.rewards.isolated`), where Math-Verify's own SIGALRM limits work on any calling thread, and the worker is killed
    when the whole judgement passes `JUDGE_DEADLINE_FACTOR` x timeout_s: some answers (towers of powers) keep sympy
    inside one C call that no signal interrupts, holding the GIL of whatever process runs it. A judgement past its
    deadline goes once more in a fresh worker (`JUDGE_TRIES`); an answer past both scores 0 with "timed_out" 1.
    None: judged in this process with no limit at all.
    """
    label = label_text(label, "math_reward")
    boxed = last_boxed(response_text)
    answer = response_text if not require_boxed else (f"{BOXED}{boxed}}}" if boxed is not None else "")
    is_timed_out = False
    if timeout_s is None:
        is_correct = judge_math(answer, label, None)
    else:
        try:
            is_correct = math_judges().call(judge_math, answer, label, timeout_s, tries=JUDGE_TRIES,
                                            timeout_s=JUDGE_DEADLINE_FACTOR * timeout_s + 1.0)
        except DeadlineExceeded:
            is_correct, is_timed_out = False, True
    scored = shape_score(is_correct=is_correct, is_format_ok=boxed is not None, response_text=response_text,
                         sample=sample, format_penalty=format_penalty, max_response_chars=max_response_chars,
                         max_response_tokens=max_response_tokens, length_penalty=length_penalty)
    return {**scored, "timed_out": float(is_timed_out)}


def judge_math(answer: str, label: str, timeout_s: int | None) -> bool:
    """Math-Verify's verdict on `answer` against `label` (what `math_reward` runs in a worker process). Its SIGALRM
    limits need the main thread: off it (timeout_s None, or a caller's thread) they are switched off."""
    from math_verify import parse, verify

    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    predicted = parse(answer, parsing_timeout=timeout) if answer else []
    gold = _parse_label(label, timeout)
    return bool(predicted) and bool(verify(gold, predicted, timeout_seconds=timeout))


def math_judges() -> IsolatedPool:
    """The worker processes `math_reward` judges in, started on first use (each imports Math-Verify first)."""
    global _JUDGES
    with _JUDGES_LOCK:
        if _JUDGES is None:
            _JUDGES = IsolatedPool(JUDGE_PROCESSES, preload=("math_verify",))
        return _JUDGES


@functools.lru_cache(maxsize=4096)
def _parse_label(label: str, timeout: int | None) -> list:
    """The label as Math-Verify sees it: as written ("19", "1/2"), else as LaTeX ("\\sqrt{2}", "(1,2)"). A label
    that parses neither way is a data error, not a wrong answer, so it raises (failing the group, visibly).
    Cached: a label is parsed once per sample of its group."""
    from math_verify import parse

    gold = parse(label, parsing_timeout=timeout) or parse(f"${label}$", parsing_timeout=timeout)
    if all(isinstance(g, str) for g in gold):  # nothing parsed (only the matched text came back, if that)
        raise ValueError(f"math_reward: Math-Verify cannot parse the label {label!r}; use exact_match_reward or "
                         "regex_reward for answers that are not math")
    return gold


def exact_match_reward(response_text: str, label: Any, sample: Sample | None = None, *, use_boxed: bool = True,
                       format_penalty: float = 0.0, max_response_chars: int | None = None,
                       max_response_tokens: int | None = None, length_penalty: float = 0.0) -> dict[str, float]:
    """Whether the response equals `label` as strings after `normalize_answer`. With `use_boxed` (the default) the
    content of the last `\\boxed{...}` is compared when there is one, else the whole response; "format_ok" says
    whether there was one."""
    boxed = last_boxed(response_text)
    answer = boxed if use_boxed and boxed is not None else response_text
    is_correct = normalize_answer(answer) == normalize_answer(label_text(label, "exact_match_reward"))
    return shape_score(is_correct=is_correct, is_format_ok=boxed is not None, response_text=response_text,
                       sample=sample, format_penalty=format_penalty, max_response_chars=max_response_chars,
                       max_response_tokens=max_response_tokens, length_penalty=length_penalty)


def regex_reward(response_text: str, label: Any, sample: Sample | None = None, *, pattern: str,
                 format_penalty: float = 0.0, max_response_chars: int | None = None,
                 max_response_tokens: int | None = None, length_penalty: float = 0.0) -> dict[str, float]:
    """Whether the first capture group of `pattern`'s last match in the response equals `label` after
    `normalize_answer` (e.g. pattern r"Answer:\\s*(\\S+)"). No match is wrong and "format_ok" is 0."""
    label = label_text(label, "regex_reward")
    compiled = _compile(pattern)
    matches = list(compiled.finditer(response_text))
    answer = matches[-1].group(1) if matches else None
    is_correct = answer is not None and normalize_answer(answer) == normalize_answer(label)
    return shape_score(is_correct=is_correct, is_format_ok=bool(matches), response_text=response_text,
                       sample=sample, format_penalty=format_penalty, max_response_chars=max_response_chars,
                       max_response_tokens=max_response_tokens, length_penalty=length_penalty)


_verifier_delays = random.Random(0)


def slow_regex_reward(response_text: str, label: Any, sample: Sample | None = None, *, min_delay_s: float = 0.5,
                      max_delay_s: float = 2.0, **regex_args: Any) -> dict[str, float]:
    """`regex_reward` behind a verifier that takes `min_delay_s`..`max_delay_s` (uniform) per answer, as a sandbox or
    a remote judge does: what makes a sync run wait on its slowest answer while an async one keeps generating
    (docs/async.md, the SmolLM2 comparison). Plain function: it runs on the reward threads."""
    if not 0 <= min_delay_s <= max_delay_s:
        raise ValueError(f"slow_regex_reward: need 0 <= min_delay_s <= max_delay_s, got {min_delay_s}, {max_delay_s}")
    time.sleep(_verifier_delays.uniform(min_delay_s, max_delay_s))
    return regex_reward(response_text, label, sample, **regex_args)


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern:
    compiled = re.compile(pattern)
    if compiled.groups < 1:
        raise ValueError(f"regex_reward: pattern {pattern!r} has no capture group; wrap the answer in (...)")
    return compiled


def label_text(label: Any, verifier: str) -> str:
    """The label as the text a verifier compares: a string as it is, a number as str() writes it. Anything else (a
    dict, a list, a bool, null) is refused in one line naming its type, before any judging."""
    if isinstance(label, str) or (isinstance(label, (int, float)) and not isinstance(label, bool)):
        return str(label)
    raise ValueError(f"{verifier}: the label is a {type(label).__name__} ({str(label)[:80]}); it takes a string or "
                     "a number; for a dict label (e.g. {'ground_truth': ...}) write a reward function that reads it")


def shape_score(*, is_correct: bool, is_format_ok: bool, response_text: str, sample: Sample | None,
                format_penalty: float, max_response_chars: int | None, max_response_tokens: int | None,
                length_penalty: float) -> dict[str, float]:
    """The reward dict: 1 or 0 for correctness, less the penalties that apply. A token limit needs the sample."""
    if max_response_tokens is not None and sample is None:
        raise ValueError("max_response_tokens needs the sample (its response_tokens); pass sample= or use "
                         "max_response_chars")
    is_too_long = ((max_response_chars is not None and len(response_text) > max_response_chars)
                   or (max_response_tokens is not None and len(sample.response_tokens) > max_response_tokens))
    score = float(is_correct) - (0.0 if is_format_ok else format_penalty) - (length_penalty if is_too_long else 0.0)
    return {"score": score, "correct": float(is_correct), "format_ok": float(is_format_ok),
            "too_long": float(is_too_long)}


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` in `text` (nested braces allowed), or None."""
    start = text.rfind(BOXED)
    while start != -1:
        depth, i = 1, start + len(BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(BOXED):i - 1]
        start = text.rfind(BOXED, 0, start)  # this one is unclosed: try the one before
    return None


def normalize_answer(text: str) -> str:
    """Case-folded, whitespace-collapsed, without surrounding `$`, quotes and a final period."""
    text = " ".join(text.split()).casefold()
    return text.strip("$ \"'").rstrip(". ").strip("$ \"'")
