"""The LLM judge: each response to score is put into the judge's prompt template, tokenized with the judge's
tokenizer, sent to the judge fleet's router with the same `EngineClient` the policy's rollouts use, and the judge's
decoded answer is parsed into a score by the configured parser (glue.rewards.models.ModelRewards calls it)."""
from __future__ import annotations

import asyncio
import inspect
import math
import time
from typing import Any, Callable

from glue.embedded_engine.tiny_text_model import save_tiny_text_model
from glue.fleet.engine_client import EngineHTTPError
from glue.plugins import load_object
from glue.rewards.models import Counters, SampleText

TEXT_KEPT = 500  # characters of the judge's answer kept in sample.metadata["judge"]
COUNTED = ("calls", "timeouts", "parse_failures", "errors")


def load_parser(path: str) -> Callable[[str], float]:
    """The judge's parser by import path, checked to be callable as fn(judge_text) (at start-up, not at the first
    judgement)."""
    fn = load_object(path, what="judge.parser")
    if not callable(fn) or inspect.iscoroutinefunction(fn):
        raise TypeError(f"judge.parser {path!r} must be a plain function fn(judge_text: str) -> float")
    try:
        inspect.signature(fn).bind("")
    except TypeError as err:
        raise TypeError(f"judge.parser {path!r} cannot be called as fn(judge_text): {err}") from None
    return fn


def fill_template(template: str, text: SampleText) -> str:
    """The template with {prompt}, {response} and {label} replaced (other braces, e.g. \\boxed{}, stay as written)."""
    return (template.replace("{prompt}", text.prompt).replace("{response}", text.response)
            .replace("{label}", text.label))


class Judge:
    """Scores responses with an LLM served by its own fleet. Requests run concurrently, at most `max_concurrency`
    at once over all groups; each is cut after `timeout_s` (its HTTP request is closed, which aborts it on the
    engine). A timeout, an engine error or an answer the parser refuses (ValueError, or a non-finite number) gives
    that sample no score (None) and is counted; ModelRewards records each judgement in `sample.metadata["judge"]`."""

    name = section = "judge"

    def __init__(self, *, client: Any, tokenizer: Any, parser: Callable[[str], float], prompt_template: str,
                 sampling_params: dict, timeout_s: float, max_concurrency: int, apply_chat_template: bool = True,
                 weight: float = 1.0, on_failure: str = "zero"):
        self.client, self.tokenizer, self.parser = client, tokenizer, parser
        self.prompt_template, self.sampling_params = prompt_template, dict(sampling_params)
        self.timeout_s, self.max_concurrency = timeout_s, max_concurrency
        self.apply_chat_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.weight, self.on_failure = weight, on_failure
        self.counters = Counters("judge")
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    def input_ids(self, text: SampleText) -> list[int]:
        """The judge's prompt tokens for one response."""
        content = fill_template(self.prompt_template, text)
        if self.apply_chat_template:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return list(self.tokenizer(content).input_ids)

    async def score(self, texts: list[SampleText]) -> list[dict]:
        """One judgement per text, all at once (within `max_concurrency`)."""
        return list(await asyncio.gather(*(self.judge(t) for t in texts)))

    async def judge(self, text: SampleText) -> dict:
        """One judgement: {"score": float | None, "text": the judge's answer, "error": None | what went wrong,
        "seconds": the request's time}."""
        import aiohttp

        ids = self.input_ids(text)
        async with self._semaphore():
            self.counters.add("calls")
            started = time.perf_counter()
            try:
                answer = await asyncio.wait_for(self.client.generate(ids, self.sampling_params, return_logprob=False),
                                                self.timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                return self._failed("timeouts", f"timed out after judge.timeout_s={self.timeout_s:g} s", started)
            except (ConnectionError, EngineHTTPError, aiohttp.ClientError) as err:  # the judge fleet failed it: counted
                return self._failed("errors", f"{type(err).__name__}: {str(err)[:300]}", started)
            seconds = time.perf_counter() - started
        self.counters.seconds.append(seconds)
        reply = self.tokenizer.decode(answer.get("output_ids") or [], skip_special_tokens=True)
        try:
            value = float(self.parser(reply))
            if not math.isfinite(value):
                raise ValueError(f"non-finite score {value}")
        except ValueError as err:
            self.counters.add("parse_failures")
            return {"score": None, "text": reply[:TEXT_KEPT], "error": f"unparsable: {err}", "seconds": seconds}
        return {"score": value, "text": reply[:TEXT_KEPT], "error": None, "seconds": seconds}

    def _failed(self, kind: str, error: str, started: float) -> dict:
        self.counters.add(kind)
        seconds = time.perf_counter() - started
        self.counters.seconds.append(seconds)
        return {"score": None, "text": "", "error": error, "seconds": seconds}

    def _semaphore(self) -> asyncio.Semaphore:
        """One semaphore per running event loop (the run has one; tests may run several)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._slots

    def metrics(self) -> dict[str, float]:
        """reward/judge_calls, _timeouts, _parse_failures, _errors since the last call, and reward/judge_s (mean
        request seconds) and reward/judge_s_max when there were calls."""
        return self.counters.take(COUNTED)


def save_tiny_judge_model(path: str, **tiny: Any) -> str:
    """The CPU stand-in for a judge: a tiny random text model (glue.embedded_engine.tiny_text_model) whose output layer knows only
    the ten digits (every other row is zero, so a digit always has the highest logit), so its answers are numbers
    that depend on what it read: parseable by `rollout_fns.judge:first_number_parser`, and never ending on their own
    (an answer runs to judge.max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_tiny_text_model(path, **tiny)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        keep = head[digits].clone()
        head.zero_()
        head[digits] = keep
    model.save_pretrained(path)
    return path
