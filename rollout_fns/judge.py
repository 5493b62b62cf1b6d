"""Parsers for LLM-judge answers (`judge.parser`): the judge's decoded answer in, a score out; ValueError when the
answer holds none (glue.rewards.judge counts it in reward/judge_parse_failures and applies judge.on_failure)."""
from __future__ import annotations

import re

SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score_parser(text: str) -> float:
    """The number after the last "Score:" (or "score =") in the answer, e.g. "... so Score: 7" -> 7.0."""
    matches = SCORE.findall(text)
    if not matches:
        raise ValueError(f"no 'Score: N' in the judge's answer {text[:80]!r}")
    return float(matches[-1])


def first_number_parser(text: str) -> float:
    """The first number anywhere in the answer ("8/10" -> 8.0): for judges prompted to answer with a number alone
    (or a template that ends in "Score:")."""
    match = NUMBER.search(text)
    if match is None:
        raise ValueError(f"no number in the judge's answer {text[:80]!r}")
    return float(match.group())


def yes_no_parser(text: str) -> float:
    """1.0 when the answer's first word is yes, 0.0 when it is no (case and punctuation ignored)."""
    words = re.findall(r"[a-z]+", text.lower())
    if not words or words[0] not in ("yes", "no"):
        raise ValueError(f"the judge's answer {text[:80]!r} starts with neither yes nor no")
    return 1.0 if words[0] == "yes" else 0.0
