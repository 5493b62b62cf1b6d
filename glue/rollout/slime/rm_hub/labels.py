"""The label check the rule-based rewards share: they compare text, so a label must be a string or a number."""
from __future__ import annotations

from typing import Any


def label_text(label: Any, rule: str) -> str:
    """`label` as text; ValueError in one line naming the rule and the label's type for anything else (a dict, a
    list, a bool, None)."""
    if isinstance(label, str) or (isinstance(label, (int, float)) and not isinstance(label, bool)):
        return str(label)
    raise ValueError(f"rm_type {rule}: the label is a {type(label).__name__} ({str(label)[:80]}); it takes a string "
                     "or a number; for a dict label (e.g. {'ground_truth': ...}) write a reward function "
                     "(--custom-rm-path) that reads it")
