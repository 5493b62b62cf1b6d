"""Reward functions for text tasks: Math-Verify equivalences, exact and regex matching, and the penalties."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from glue.types import Sample
from rollout_fns import verifiers
from rollout_fns.verifiers import (exact_match_reward, last_boxed, math_reward, normalize_answer, regex_reward,
                                   slow_regex_reward)


@pytest.mark.parametrize("label, response", [
    (r"\frac{1}{2}", "0.5"),
    ("0.5", r"So $x = \frac{1}{2}$"),
    ("19", r"12 + 7 = 19, so the answer is \boxed{19}."),
    ("19", "The answer is 19"),
    (19, r"\boxed{19}"),
    ("-3", r"\boxed{-3}"),
    (r"\frac{1}{2}", r"\boxed{\frac12}"),
    (r"\sqrt{2}", r"so $x = \sqrt{2}$"),
    ("(1,2)", r"The interval is \boxed{(1, 2)}"),
])
def test_math_reward_accepts_equal_answers_in_any_notation(label, response):
    result = math_reward(response, label)
    assert result["score"] == 1.0 and result["correct"] == 1.0


@pytest.mark.parametrize("label, response", [
    ("19", r"\boxed{18}"),
    ("19", "19 is what I first thought, but it is 3"),
    (r"\frac{1}{2}", "0.25"),
])
def test_math_reward_scores_wrong_answers_zero(label, response):
    assert math_reward(response, label) == {"score": 0.0, "correct": 0.0, "format_ok": float("boxed" in response),
                                            "too_long": 0.0, "timed_out": 0.0}


@pytest.mark.parametrize("response", ["", "}{ \\boxed{ ^^ $$ \\frac{", "no numbers here at all", "\x00\x01\ufffd"])
def test_math_reward_scores_garbage_zero_without_raising(response):
    assert math_reward(response, "19")["score"] == 0.0


@pytest.mark.parametrize("label", ["", "???"])
def test_math_reward_refuses_a_label_it_cannot_parse(label):
    with pytest.raises(ValueError, match="cannot parse the label"):
        math_reward(r"\boxed{1}", label)


def test_math_reward_works_off_the_main_thread_and_in_an_event_loop_there():
    """Math-Verify's default timeouts use SIGALRM, which raises outside the main thread; math_reward turns them
    off there, so a reward run in a worker thread or a non-main-thread event loop still scores."""
    results = {}

    def in_worker():
        results["thread"] = math_reward(r"\boxed{\frac{1}{2}}", "0.5")

        async def in_loop():
            return math_reward(r"\boxed{7}", "8")

        results["loop"] = asyncio.run(in_loop())

    worker = threading.Thread(target=in_worker)
    worker.start()
    worker.join(timeout=60)
    assert results["thread"]["correct"] == 1.0
    assert results["loop"]["correct"] == 0.0


TOWER = r"\boxed{9^{9^{9^{9}}}}"  # sympy evaluates it for minutes; off the main thread it held the GIL over 60 s


def test_a_pathological_answer_scored_off_the_main_thread_ends_within_its_limit_and_never_freezes_the_caller():
    """Before, a reward thread judged in-process with Math-Verify's limits off: this answer froze the whole driver
    (its other threads too) for over a minute. Now the judgement runs in a worker process under Math-Verify's own
    limit."""
    results, ticks = {}, []
    worker = threading.Thread(target=lambda: results.update(math_reward(TOWER, "1", timeout_s=1)))
    t0 = time.monotonic()
    worker.start()
    while worker.is_alive() and time.monotonic() - t0 < 60:
        ticks.append(time.monotonic())
        time.sleep(0.05)
    assert not worker.is_alive(), "math_reward did not come back within 60 s"
    assert results["score"] == 0.0 and results["correct"] == 0.0
    assert len(ticks) >= 10  # the caller's process kept running while the answer was judged


def test_a_judgement_past_its_deadline_is_killed_and_scored_zero_as_timed_out(monkeypatch):
    """The worker is killed when the whole judgement outlives JUDGE_DEADLINE_FACTOR x timeout_s + 1 s (for answers
    stuck in one C call that no signal interrupts); with the factor at 0 the deadline (1 s) comes before
    Math-Verify's own 3 s limit, so this answer takes the kill path."""
    monkeypatch.setattr(verifiers, "JUDGE_DEADLINE_FACTOR", 0)
    assert math_reward(r"\boxed{4}", "4", timeout_s=3)["correct"] == 1.0
    pids = verifiers.math_judges().pids()
    t0 = time.monotonic()
    result = math_reward(TOWER, "1", timeout_s=3)
    assert result == {"score": 0.0, "correct": 0.0, "format_ok": 1.0, "too_long": 0.0, "timed_out": 1.0}
    assert time.monotonic() - t0 < 3
    assert set(pids) - set(verifiers.math_judges().pids())  # the stuck worker is gone
    assert math_reward(r"\boxed{5}", "5", timeout_s=3)["correct"] == 1.0  # a fresh worker judges the next one


def test_math_reward_on_the_main_thread_leaves_the_callers_alarm_as_it_was():
    """Judged in a worker process, Math-Verify's SIGALRM never touches this process: the handler stays, and an
    alarm the caller had set stays pending (in-process, Math-Verify's `alarm(0)` used to cancel it)."""
    before = signal.getsignal(signal.SIGALRM)
    previous = signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        assert math_reward(r"\boxed{4}", "4", timeout_s=3)["correct"] == 1.0
        assert signal.getsignal(signal.SIGALRM) is before
        assert 90.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, *previous)  # pytest-timeout's alarm, if it had one


@pytest.mark.parametrize("label, kind", [({"ground_truth": "19"}, "dict"), (["19"], "list"), (True, "bool"),
                                         (None, "NoneType")])
def test_the_built_in_verifiers_refuse_a_label_that_is_not_a_string_or_number_naming_its_type(label, kind):
    for verifier, options in [(math_reward, {}), (exact_match_reward, {}), (regex_reward, {"pattern": "(\\d+)"})]:
        with pytest.raises(ValueError, match=f"^{verifier.__name__}: the label is a {kind} .*; it takes a string "
                                             "or a number"):
            verifier("\\boxed{19}", label, **options)


def test_the_built_in_verifiers_take_a_number_label_as_its_text():
    assert math_reward("\\boxed{19}", 19)["correct"] == exact_match_reward("\\boxed{0.5}", 0.5)["correct"] == 1.0
    assert regex_reward("x = 7", 7, pattern=r"= (\d+)")["correct"] == 1.0


def test_require_boxed_ignores_answers_outside_the_box():
    assert math_reward("The answer is 19", "19", require_boxed=True)["correct"] == 0.0
    assert math_reward(r"I guess 3, then \boxed{19}", "19", require_boxed=True)["correct"] == 1.0


def test_format_penalty_is_subtracted_only_without_a_box():
    unboxed = math_reward("The answer is 19", "19", format_penalty=0.5)
    boxed = math_reward(r"\boxed{19}", "19", format_penalty=0.5)
    wrong_unboxed = math_reward("18", "19", format_penalty=0.5)
    assert (unboxed["score"], unboxed["format_ok"]) == (0.5, 0.0)
    assert (boxed["score"], boxed["format_ok"]) == (1.0, 1.0)
    assert wrong_unboxed["score"] == -0.5


def test_length_penalty_applies_over_the_char_or_token_limit():
    text = r"\boxed{19}"  # 10 characters
    assert math_reward(text, "19", max_response_chars=10, length_penalty=0.25)["score"] == 1.0
    over = math_reward(text, "19", max_response_chars=9, length_penalty=0.25)
    assert (over["score"], over["too_long"]) == (0.75, 1.0)
    sample = Sample(prompt_tokens=[1], response_tokens=list(range(12)))
    assert math_reward(text, "19", sample, max_response_tokens=12, length_penalty=0.25)["score"] == 1.0
    assert math_reward(text, "19", sample, max_response_tokens=11, length_penalty=0.25)["score"] == 0.75


def test_a_token_limit_without_the_sample_is_refused():
    with pytest.raises(ValueError, match="max_response_tokens needs the sample"):
        math_reward("19", "19", max_response_tokens=4)


def test_exact_match_compares_normalised_text_and_prefers_the_box():
    assert exact_match_reward("  The   Eiffel Tower. ", "the eiffel tower")["correct"] == 1.0
    assert exact_match_reward(r"It is \boxed{Paris}.", "paris")["correct"] == 1.0
    assert exact_match_reward(r"It is \boxed{Paris}.", "paris", use_boxed=False)["correct"] == 0.0
    assert exact_match_reward("London", "Paris") == {"score": 0.0, "correct": 0.0, "format_ok": 0.0,
                                                     "too_long": 0.0}


def test_regex_reward_uses_the_last_match_and_flags_a_missing_one():
    pattern = r"Answer:\s*(\S+)"
    assert regex_reward("Answer: 3 ... no wait. Answer: 42", "42", pattern=pattern)["correct"] == 1.0
    assert regex_reward("Answer: 42 ... no wait. Answer: 3", "42", pattern=pattern)["correct"] == 0.0
    missing = regex_reward("42", "42", pattern=pattern, format_penalty=0.1)
    assert (missing["correct"], missing["format_ok"], missing["score"]) == (0.0, 0.0, -0.1)


def test_regex_reward_refuses_a_pattern_without_a_group():
    with pytest.raises(ValueError, match="no capture group"):
        regex_reward("Answer: 4", "4", pattern=r"Answer: \d+")


def test_last_boxed_handles_nesting_and_skips_an_unclosed_box():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{5} and finally \boxed{6") == "5"
    assert last_boxed("no box") is None


def test_normalize_answer_strips_dollars_quotes_case_and_final_period():
    assert normalize_answer(' $ "Forty  Two". ') == 'forty two'


def test_the_slow_verifier_waits_then_scores_as_regex_reward_does():
    import time

    pattern = r"=\s*(-?\d+)"
    started = time.perf_counter()
    slow = slow_regex_reward("1+2=3", "3", pattern=pattern, min_delay_s=0.2, max_delay_s=0.3)
    assert time.perf_counter() - started >= 0.2
    assert slow == regex_reward("1+2=3", "3", pattern=pattern) and slow["correct"] == 1.0
    assert slow_regex_reward("1+2=4", "3", pattern=pattern, min_delay_s=0, max_delay_s=0)["correct"] == 0.0
    with pytest.raises(ValueError, match="min_delay_s <= max_delay_s"):
        slow_regex_reward("1+2=3", "3", pattern=pattern, min_delay_s=1.0, max_delay_s=0.5)
