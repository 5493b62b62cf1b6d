"""slime.rollout.rm_hub.f1: SQuAD-style token F1 between an answer and a ground truth (`--rm-type f1`), over text
lower-cased, without punctuation, articles (a, an, the) and extra spaces. sluice's own code."""
from __future__ import annotations

import re
import string
from collections import Counter

from glue.rollout.slime.rm_hub.labels import label_text

ZERO = (0, 0, 0)
CLOSED_ANSWERS = ("yes", "no", "noanswer")  # scored all or nothing
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    text = s.lower().translate(_PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    """(f1, precision, recall) of the prediction's words against the ground truth's; (0, 0, 0) when they share
    none, when there is no prediction, and when either is yes / no / noanswer and they differ."""
    if prediction is None:
        return ZERO
    predicted, truth = normalize_answer(prediction), normalize_answer(label_text(ground_truth, "f1"))
    if predicted != truth and (predicted in CLOSED_ANSWERS or truth in CLOSED_ANSWERS):
        return ZERO
    predicted_words, truth_words = predicted.split(), truth.split()
    shared = sum((Counter(predicted_words) & Counter(truth_words)).values())
    if shared == 0:
        return ZERO
    precision, recall = shared / len(predicted_words), shared / len(truth_words)
    return 2 * precision * recall / (precision + recall), precision, recall
