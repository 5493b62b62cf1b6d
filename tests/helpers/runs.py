"""Reading whole runs back: step ranges and metrics records with the timing keys left out."""
from __future__ import annotations


def expand(ranges: str) -> list[int]:
    ids = []
    for part in ranges.split(","):
        a, _, b = part.partition("-")
        ids += list(range(int(a), int(b or a) + 1))
    return ids


TIMING = ("time/", "sync/", "async/", "fault/", "staleness/in_flight", "staleness/in_queue", "weights/lag", "eval/time_s")


def learning_record(record: dict) -> dict:
    """What a run learnt and trained on at a step, without what depends on timing (waits, queue depths)."""
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}
