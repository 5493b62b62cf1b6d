"""SFT data: rows of `{"messages": [{"role", "content"}, ...]}` (JSONL, or Parquet with pyarrow) checked line by line,
rendered with the tokenizer's chat template turn by turn so that each token is known to belong to an assistant turn
or not, and handed to the trainer as `Sample`s whose loss mask is 1 on the assistant's tokens only (as a multi-turn
rollout masks tool output), a step's worth at a time in a seeded order."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from glue.types import Sample, TrainBatch

ROLES = ("system", "user", "assistant", "tool")


def read_conversations(path: str | Path, messages_key: str = "messages") -> list[tuple[str, list[dict[str, str]]]]:
    """Every row's conversation with where it came from ("chat.jsonl line 3"); raises ValueError naming the line of
    the first row that is not JSON, has no `messages_key`, or whose messages are not a chat with an assistant turn."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sft.data={str(path)!r} does not exist; point it at a JSONL file of {{\"{messages_key}\": "
                         "[...]}} rows, or set sft.example_rows to write a generated one there")
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    conversations = []
    for where, row in rows:
        if not isinstance(row, dict) or messages_key not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{where}: no {messages_key!r} key (the row has {keys}); every row needs "
                             f"{{\"{messages_key}\": [{{\"role\": ..., \"content\": ...}}, ...]}} (sft.messages_key "
                             "names another key)")
        conversations.append((where, check_messages(row[messages_key], where)))
    if not conversations:
        raise ValueError(f"sft.data={str(path)!r} holds no conversations")
    return conversations


def _jsonl_rows(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path} line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {number}: not JSON ({err.msg} at column {err.colno})") from None
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"sft.data={str(path)!r} is Parquet, which needs pyarrow (not installed here): "
                         "pip install pyarrow, or give the data as JSONL") from None
    return [(f"{path} row {number}", row) for number, row in enumerate(pq.read_table(path).to_pylist(), 1)]


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} with a known role, string content and an assistant turn with
    text; raises ValueError starting with `where`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}}, got "
                         f"{type(messages).__name__ if not isinstance(messages, list) else 'an empty list'}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else type(message).__name__
            raise ValueError(f"{where}: message {i} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {i} ({message['role']}) needs a string content, got "
                             f"{type(message.get('content')).__name__}")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise ValueError(f"{where}: no assistant turn with text, so nothing to train on; every conversation needs "
                         "one (SFT learns the assistant's turns only)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def tokenize_chat(tokenizer: Any, messages: list[dict[str, str]], where: str = "conversation"
                  ) -> tuple[list[int], list[int]]:
    """(token ids, trained flags) of a conversation rendered by `tokenizer`'s chat template. Each turn's text is the
    template's render of the conversation up to it minus the render before it; an assistant turn is split at the
    end of its generation prompt (e.g. `<|im_start|>assistant\\n`, not trained), and its tokens are trained up to and
    including the last end-of-sequence token (e.g. `<|im_end|>`, where generation stops). Tokenized turn by turn,
    as a rollout tokenizes a prompt and then generates: the same ids an RL run would train."""
    tokens: list[int] = []
    trained: list[int] = []
    rendered = ""

    def add(upto: str, is_trained: bool) -> None:
        nonlocal rendered
        if not upto.startswith(rendered):
            raise ValueError(f"{where}: the chat template renders a later turn by changing the text of the turns "
                             "before it, so the assistant's tokens cannot be told apart; use a template that renders "
                             "each turn after the previous ones (ChatML does)")
        ids = tokenizer(upto[len(rendered):], add_special_tokens=False)["input_ids"] if upto != rendered else []
        flags = [0] * len(ids)
        if is_trained:
            eos = tokenizer.eos_token_id
            last = max((i for i, t in enumerate(ids) if t == eos), default=len(ids) - 1)
            flags = [1 if i <= last else 0 for i in range(len(ids))]
        tokens.extend(ids)
        trained.extend(flags)
        rendered = upto

    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            add(render(tokenizer, messages[:i], generation_prompt=True), False)
        add(render(tokenizer, messages[:i + 1], generation_prompt=False), message["role"] == "assistant")
    return tokens, trained


def render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    if not messages and not generation_prompt:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def to_sample(tokens: list[int], trained: list[int], index: int) -> Sample:
    """A conversation as a `Sample`: the prompt runs up to its first trained token (at least the first token, which
    nothing predicts), the response is the rest with the trained flags as its loss mask (later user turns are in it
    with loss mask 0, as a multi-turn rollout's tool output is)."""
    first = next((i for i, flag in enumerate(trained) if flag), len(tokens) - 1)
    first = min(max(first, 1), len(tokens))
    response = tokens[first:]
    return Sample(prompt_tokens=tokens[:first], response_tokens=response, loss_mask=trained[first:],
                  rollout_logprobs=[0.0] * len(response), versions=[0] * len(response), reward=0.0, index=index)


def load_samples(path: str | Path, tokenizer: Any, *, messages_key: str = "messages", max_seq_len: int
                 ) -> tuple[list[Sample], dict[str, float]]:
    """Every conversation of `path` as a Sample cut to `max_seq_len` tokens, and what the data holds
    (conversations, tokens, trained tokens, how many were cut)."""
    samples, cut = [], 0
    for index, (where, messages) in enumerate(read_conversations(path, messages_key)):
        tokens, trained = tokenize_chat(tokenizer, messages, where)
        if len(tokens) > max_seq_len:
            tokens, trained, cut = tokens[:max_seq_len], trained[:max_seq_len], cut + 1
        samples.append(to_sample(tokens, trained, index))
    total = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    summary = {"conversations": len(samples), "tokens": total,
               "trained_tokens": sum(sum(s.loss_mask) for s in samples), "cut_frac": cut / len(samples)}
    return samples, summary


class ConversationStream:
    """The conversations in a seeded order, reshuffled every epoch, `per_step` per train batch. `cursor` counts the
    conversations served so far: a checkpoint keeps it, and a resumed run continues from it."""

    def __init__(self, samples: list[Sample], *, per_step: int, seed: int, cursor: int = 0):
        self.samples, self.per_step, self.seed, self.cursor = samples, per_step, seed, cursor
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.samples)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def next_batch(self) -> tuple[TrainBatch, dict[str, float]]:
        """The next `per_step` conversations as a TrainBatch (loss mask on the assistant tokens), and its metrics."""
        n = len(self.samples)
        chosen = [self.samples[self._order(c // n)[c % n]] for c in range(self.cursor, self.cursor + self.per_step)]
        self.cursor += self.per_step
        batch = TrainBatch.from_samples(chosen, [0.0] * len(chosen))
        metrics = {"sft/epoch": self.cursor / n, "sft/tokens": float(sum(batch.seq_lens)),
                   "sft/trained_tokens": float(batch.logprob_mask.sum())}
        return batch, metrics


def write_example_chats(path: str | Path, num_rows: int, seed: int = 0) -> str:
    """`num_rows` generated arithmetic chats ("What is 3+4?" -> "3+4=7"; a system turn in some, a second question
    in others) as JSONL at `path`, written aside and renamed: the data examples/configs/sft.yaml trains on."""
    rng = random.Random(seed)

    def question() -> tuple[str, str]:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"What is {a}+{b}?", f"{a}+{b}={a + b}"

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial-{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as handle:
        for _ in range(num_rows):
            messages = [{"role": "system", "content": "Solve the problem."}] if rng.random() < 0.5 else []
            for _ in range(1 + (rng.random() < 0.3)):
                asked, answer = question()
                messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    os.replace(partial, path)
    return str(path)
