"""Liveness while sluice waits on its engines: a control call (a sync's or a checkpoint's pause, the continue after
it) runs in a thread of its own while every engine is asked, every `interval_s`, for an answer of any kind; the
call is given up as soon as an engine has answered nothing `failures` times in a row, not after its own timeout.

The probe is `GET /model_info`, which SGLang's HTTP server answers from its own process at once, paused or not.
Not `GET /health`: with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION (on by default) that generates a token, so a paused
server answers it only after SGLANG_HEALTH_CHECK_TIMEOUT (20 s), with 503, and marks itself unhealthy.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

from weight_sync.engine_calls import answers_at_all

PROBES_AT_ONCE = 64  # probes in flight at once (liveness here, and the watch's deep health sweep)


class EnginesSilent(RuntimeError):
    """Engines (`indices` into `urls`, the url list probed) that answered nothing while a control call waited on
    them: `in_a_row[i]` probes in a row each."""

    def __init__(self, in_a_row: dict[int, int], urls: Sequence[str], timeout_s: float):
        names = ", ".join(f"engine {i} ({urls[i]}, {n} in a row)" for i, n in sorted(in_a_row.items()))
        super().__init__(f"{names} answered nothing to GET /model_info ({timeout_s:g} s each) while a control call "
                         "waited on it")
        self.indices, self.urls = frozenset(in_a_row), list(urls)


def silent_engines(urls: Sequence[str], timeout_s: float, key: str | None = None) -> frozenset[int]:
    """Ask every engine GET /model_info at once (`answers_at_all`); the indices of those that gave no answer at all
    within `timeout_s` (any HTTP status is an answer: the engine's HTTP server is alive)."""
    if not urls:
        return frozenset()
    with ThreadPoolExecutor(max_workers=min(len(urls), PROBES_AT_ONCE), thread_name_prefix="liveness") as pool:
        answered = pool.map(lambda url: answers_at_all(url, timeout_s, key), urls)
        return frozenset(i for i, answers in enumerate(answered) if not answers)


def call_while_live(call: Callable[[], Any], urls: Sequence[str], *, interval_s: float, timeout_s: float,
                    failures: int, key: str | None = None) -> Any:
    """`call()`'s result or its error, unless first some engines of `urls` answer nothing to `failures` probes in a
    row (a round every `interval_s` after the last one ended): then EnginesSilent at once. A call that fails while
    engines were silent in the latest round raises EnginesSilent too, naming those: they are what it waited on, and
    are not asked again. A call given up is left in its daemon thread to end by itself (its own timeout, or a
    connection reset once the silent engine is killed); its outcome is dropped."""
    outcome: Future = Future()

    def run() -> None:
        try:
            outcome.set_result(call())
        except BaseException as err:  # handed to the caller, or dropped once the call was given up
            outcome.set_exception(err)

    threading.Thread(target=run, name="engine-control", daemon=True).start()
    urls = list(urls)
    in_a_row = dict.fromkeys(range(len(urls)), 0)
    while not wait([outcome], timeout=interval_s).done:
        silent = silent_engines(urls, timeout_s, key)
        in_a_row = {i: n + 1 if i in silent else 0 for i, n in in_a_row.items()}
        hung = {i: n for i, n in in_a_row.items() if n >= failures}
        if hung and not (outcome.done() and outcome.exception() is None):  # a call that got through stands
            raise EnginesSilent(hung, urls, timeout_s)
    silent_last = {i: n for i, n in in_a_row.items() if n}
    if silent_last and outcome.exception() is not None:
        raise EnginesSilent(silent_last, urls, timeout_s) from outcome.exception()
    return outcome.result()
