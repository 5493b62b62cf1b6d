"""slime.rollout.rm_hub.gpqa (`--rm-type gpqa`): multiple choice. The correct letter comes from
metadata["correct_letter"], a one-letter label, a label that is the option's index, or the label's text matching
one of metadata["choices"]; the response's letter from "answer is X" / "X is correct" phrasing after the reasoning,
else its last standalone valid capital letter. Without both letters the response scores when it contains the
correct option's text. Letters are A.. up to the number of choices (metadata["valid_letters"] overrides; A-J
without either). sluice's own code."""
from __future__ import annotations

import re
import string
from typing import Any

DEFAULT_LETTERS = list(string.ascii_uppercase[:10])
LETTER_PHRASES = (r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])\b", r"\b([A-Z])\s*is\s*(?:the\s*)?correct",
                  r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])\b")


def _after_reasoning(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if text else ""


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def _response_letter(response: str, letters: list[str]) -> str | None:
    text = _after_reasoning(response)
    for phrase in LETTER_PHRASES:
        found = re.search(phrase, text, flags=re.IGNORECASE)
        if found and found.group(1).upper() in letters:
            return found.group(1).upper()
    standalone = [c for c in re.findall(r"\b([A-Z])\b", text) if c in letters]
    return standalone[-1] if standalone else None


def _choices_and_letters(metadata: dict) -> tuple[list[str], list[str]]:
    choices = metadata.get("choices")
    choices = [str(c) for c in (choices.values() if isinstance(choices, dict) else choices or [])]
    given = metadata.get("valid_letters")
    letters = [str(x).upper() for x in given] if given else \
        list(string.ascii_uppercase[:len(choices)]) if choices else DEFAULT_LETTERS
    return choices, letters


def _correct_letter(label: Any, metadata: dict, choices: list[str], letters: list[str]) -> str | None:
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    if isinstance(label, str):
        text = label.strip()
        if not correct and len(text) == 1 and text.upper() in letters:
            correct = text.upper()
        if not correct and text:
            for letter, choice in zip(letters, choices):
                if _words(choice) == _words(text):
                    metadata.setdefault("correct_answer", choice)
                    return letter
    elif isinstance(label, (int, float)) and not isinstance(label, bool) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]
    return correct


def compute_gpqa_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    if response is None:
        return 0.0
    metadata = {} if metadata is None else metadata
    choices, letters = _choices_and_letters(metadata)
    correct = _correct_letter(label, metadata, choices, letters)
    given = _response_letter(response, letters)
    if given and correct:
        return float(given == correct)
    label_text = label.strip() if isinstance(label, str) else ""
    targets = [choices[letters.index(correct)]] if correct in letters[:len(choices)] else []
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    targets += [label_text] if label_text else []
    said = _words(_after_reasoning(response))
    if any(_words(t) and _words(t) in said for t in targets):
        return 1.0
    return float(given == label_text.upper()) if given and label_text else 0.0
