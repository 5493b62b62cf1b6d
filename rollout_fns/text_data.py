"""A data-set task: rows of a local JSONL or Parquet file become chat-templated, tokenized prompts (looping over
epochs, reshuffled per epoch by seed), and each response is decoded and scored against the row's label by a
reward function such as `rollout_fns.verifiers:math_reward`."""
from __future__ import annotations

import inspect
import json
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from glue.plugins import load_object
from glue.types import Sample

@dataclass(frozen=True)
class TextRow:
    """One data-set row: a prompt (text, or a list of {"role", "content"} chat messages) and its label: any JSON
    value as the row holds it (a string, a number, or a dict such as search-r1's {"ground_truth": ...}), which the
    reward function reads."""

    prompt: str | list[dict]
    label: Any


def load_rows(path: str | os.PathLike, prompt_key: str = "prompt", label_key: str = "answer") -> list[TextRow]:
    """Every row of a .jsonl or .parquet file, checked. A bad row raises ValueError naming `file:line` (JSONL,
    1-based, blank lines skipped) or `file:row N` (Parquet, 0-based) and what is wrong with it."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text data: {path} does not exist or is not a file")
    if path.endswith(".jsonl"):
        records = _read_jsonl(path)
    elif path.endswith(".parquet"):
        records = _read_parquet(path, [prompt_key, label_key])
    else:
        raise ValueError(f"text data: {path} must end in .jsonl or .parquet")
    rows = [_check_record(where, record, prompt_key, label_key) for where, record in records]
    if not rows:
        raise ValueError(f"text data: {path} has no rows")
    return rows


def _read_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: invalid JSON ({err.msg} at column {err.colno})") from None


def _read_parquet(path: str, columns: list[str]) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    missing = [c for c in columns if c not in table.schema_arrow.names]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r} (columns: {table.schema_arrow.names})")
    number = 0
    for batch in table.iter_batches(columns=columns):
        for record in batch.to_pylist():
            yield f"{path}:row {number}", record
            number += 1


def _check_record(where: str, record: Any, prompt_key: str, label_key: str) -> TextRow:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with {prompt_key!r} and {label_key!r}, got "
                         f"{type(record).__name__}")
    for key in (prompt_key, label_key):
        if key not in record or record[key] is None:
            raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(record)})")
    prompt, label = record[prompt_key], record[label_key]
    if isinstance(prompt, list):
        _check_messages(where, prompt_key, prompt)
    elif not isinstance(prompt, str):
        raise ValueError(f"{where}: {prompt_key!r} must be a string or a list of chat messages, got "
                         f"{type(prompt).__name__}")
    return TextRow(prompt=prompt, label=label)


def _check_messages(where: str, prompt_key: str, messages: list) -> None:
    if not messages:
        raise ValueError(f"{where}: {prompt_key!r} is an empty list of chat messages")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: {prompt_key!r} message {i} must be an object with string 'role' and "
                             f"'content', got {str(message)[:100]}")


class TextDataTask:
    """Prompts from a local data set, rewards from a `(response_text, label, sample, **reward_args)` function.

    Each prompt dict is {"prompt_tokens", "label", "row", "epoch"}; the rollout function copies all but the
    tokens into `sample.metadata`, where `reward` finds the label. Rows whose prompt is longer than
    `max_prompt_tokens` are passed over; `task.filtered_prompts` is how many distinct rows that was so far (the
    rollout manager holds the task as `RolloutManager.task`).
    """

    data_file_args = ("path",)  # task_args naming local files read when the task is built (checked by launch.run.preflight)

    def __init__(self, *, path: str, tokenizer: str, prompt_key: str = "prompt", label_key: str = "answer",
                 system_prompt: str | None = None, apply_chat_template: bool = True,
                 max_prompt_tokens: int | None = None, shuffle: bool = True,
                 reward: str = "rollout_fns.verifiers:math_reward", reward_args: dict | None = None):
        """path: a local .jsonl or .parquet file. tokenizer: a local HF model directory (or a cached hub id; never
        downloaded) whose tokenizer and chat template are used. prompt_key / label_key: the row fields holding the
        prompt (text or chat messages) and the label (any JSON value, handed to the reward as it is).
        system_prompt: a system turn put before each prompt. apply_chat_template: false tokenizes the plain text. max_prompt_tokens: longer prompts are passed
        over. shuffle: reshuffle the rows every epoch. reward: import path of `fn(response_text, label, sample,
        **reward_args)`; reward_args: its keyword options (checked against its signature here)."""
        from transformers import AutoTokenizer

        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"TextDataTask: max_prompt_tokens must be >= 1 or None, got {max_prompt_tokens}")
        self.rows = load_rows(path, prompt_key, label_key)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        if apply_chat_template and not self.tokenizer.chat_template:
            raise ValueError(f"TextDataTask: the tokenizer at {tokenizer} has no chat_template; use a chat model's "
                             "tokenizer or set apply_chat_template: false")
        if not apply_chat_template and any(isinstance(r.prompt, list) for r in self.rows):
            raise ValueError(f"TextDataTask: {path} has chat-message prompts, which need apply_chat_template: true")
        self.system_prompt, self.apply_chat_template = system_prompt, apply_chat_template
        self.max_prompt_tokens, self.shuffle = max_prompt_tokens, shuffle
        self.reward_path, self.reward_args = reward, dict(reward_args or {})
        self.reward_fn = load_object(reward, what="reward function")
        _check_reward_call(self.reward_fn, reward, self.reward_args)
        self._too_long: dict[int, bool] = {}  # row -> over max_prompt_tokens, learnt as rows are drawn
        self.filtered_prompts = 0  # distinct rows found longer than max_prompt_tokens (and passed over) so far

    @classmethod
    def check_args(cls, task_args: dict, *, key: str) -> None:
        """What building the task would check of `task_args` without reading the data or the tokenizer (launch's
        dry run): the reward function imports and takes `reward_args`."""
        own = inspect.signature(cls).parameters.get("reward")  # a subclass may pass it on through **kwargs
        default = own.default if own is not None and own.default is not own.empty else \
            inspect.signature(TextDataTask).parameters["reward"].default
        reward = task_args.get("reward", default)
        try:
            _check_reward_call(load_object(reward, what=f"{key}.reward"), reward, dict(task_args.get("reward_args") or {}))
        except TypeError as err:
            raise ValueError(f"{key}.reward_args: {err}") from None

    def prompts(self, seed: int) -> "PromptStream":
        """An endless stream over the rows, epoch after epoch, each epoch's order fixed by (seed, epoch)."""
        return PromptStream(self, seed)

    def messages(self, prompt: str | list[dict]) -> list[dict]:
        """The chat for a prompt: a text prompt becomes one user turn; the system prompt goes first unless the
        prompt's own messages already start with one."""
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and chat[0]["role"] != "system":
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        return chat

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """Prompt token ids: the chat template with the assistant's generation prompt, or the plain text."""
        if not self.apply_chat_template:
            return list(self.tokenizer(prompt).input_ids)
        ids = self.tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(ids)

    def reward(self, sample: Sample) -> Any:
        """Decode the response (special tokens skipped) and score it against the label; an async reward function's
        coroutine is returned for the caller to await."""
        if "label" not in sample.metadata:
            raise ValueError(f"sample {sample.group_id}/{sample.index} has no 'label' in metadata; the rollout "
                             "function must copy the prompt dict's keys into sample.metadata")
        text = self.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
        return self.reward_fn(text, sample.metadata["label"], sample, **self.reward_args)

    def is_too_long(self, row: int, tokens: list[int] | None = None) -> bool:
        """Whether row `row` is over max_prompt_tokens (tokenizing it unless `tokens` are given or it is known)."""
        if self.max_prompt_tokens is None:
            return False
        if row not in self._too_long:
            n = len(tokens if tokens is not None else self.encode(self.rows[row].prompt))
            self._too_long[row] = n > self.max_prompt_tokens
            self.filtered_prompts += self._too_long[row]
            if self._too_long[row] and self.filtered_prompts == 1:
                print(f"sluice: text data row {row} has {n} prompt tokens > max_prompt_tokens="
                      f"{self.max_prompt_tokens}; such rows are skipped (count: TextDataTask.filtered_prompts)",
                      file=sys.stderr, flush=True)
        return self._too_long[row]


def _check_reward_call(fn: Any, path: str, reward_args: dict) -> None:
    """Fail at start-up, not at the first sample, if `fn(response_text, label, sample, **reward_args)` cannot bind."""
    if not callable(fn):
        raise TypeError(f"reward function {path!r} is not callable")
    try:
        inspect.signature(fn).bind("", "", None, **reward_args)
    except TypeError as err:
        raise TypeError(f"reward function {path!r} cannot be called as fn(response_text, label, sample, "
                        f"**reward_args) with reward_args {reward_args}: {err}") from None


class PromptStream:
    """The iterator `TextDataTask.prompts(seed)` returns. Rows are tokenized only when drawn; `skip(n)` passes over
    n prompts without tokenizing them (unless max_prompt_tokens needs their lengths)."""

    def __init__(self, task: TextDataTask, seed: int):
        self.task, self.seed = task, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)
        self._drawn_this_epoch = 0

    def __iter__(self) -> "PromptStream":
        return self

    def __next__(self) -> dict:
        while True:
            row = self._advance()
            tokens = self.task.encode(self.task.rows[row].prompt)
            if not self.task.is_too_long(row, tokens):
                self._drawn_this_epoch += 1
                return {"prompt_tokens": tokens, "label": self.task.rows[row].label, "row": row, "epoch": self.epoch}

    def skip(self, n: int) -> None:
        """Advance past n prompts, as n calls of next() would, without building them."""
        for _ in range(n):
            while self.task.is_too_long(self._advance()):
                pass
            self._drawn_this_epoch += 1

    def _advance(self) -> int:
        """The next row in order, starting a new (reshuffled) epoch at the end of one."""
        if self.position == len(self._order):
            if self._drawn_this_epoch == 0:
                raise ValueError(f"text data: all {len(self._order)} rows are longer than max_prompt_tokens="
                                 f"{self.task.max_prompt_tokens}; raise it")
            self.epoch, self.position, self._drawn_this_epoch = self.epoch + 1, 0, 0
            self._order = self._epoch_order(self.epoch)
        row = self._order[self.position]
        self.position += 1
        return row

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.task.rows)))
        if self.task.shuffle:
            random.Random(f"text-data/{self.seed}/{epoch}").shuffle(order)  # str seeds hash the same in every process
        return order
