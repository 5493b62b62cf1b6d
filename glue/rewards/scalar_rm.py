"""The scalar reward model: an HF sequence-classification checkpoint (one label) that reads prompt + response and
outputs the reward. It runs on one worker thread of the driver; the responses of the groups that finish while a
forward runs are queued and scored together in the next one, up to `batch_size` (glue.rewards.models calls it)."""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from glue.embedded_engine.tiny_model import tiny_config
from glue.embedded_engine.tiny_text_model import arithmetic_corpus, train_tokenizer
from glue.rewards.models import Counters, SampleText

COUNTED = ("calls", "batches", "timeouts")


class ScalarRewardModel:
    """`await score(texts)`: one verdict {"score": float | None, "error": ...} per text. A text still unscored
    `timeout_s` after it was queued gets score None (counted in reward/rm_timeouts; a forward already running is
    not interrupted, its result is dropped). An error in the forward itself propagates: the group fails."""

    name, section = "rm", "reward_model"

    def __init__(self, *, path: str, batch_size: int = 16, max_length: int = 1024, timeout_s: float = 60.0,
                 apply_chat_template: bool = True, weight: float = 1.0, on_failure: str = "zero"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True,
                                                                        dtype=torch.float32).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward_model.model.path {path}: a scalar reward model has one label (num_labels 1), "
                             f"this checkpoint has {self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:  # the model finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if self.model.config.pad_token_id is None:
            raise ValueError(f"reward_model.model.path {path}: neither the config nor the tokenizer has a pad token; "
                             "set pad_token_id in config.json")
        self.batch_size, self.max_length, self.timeout_s = batch_size, max_length, timeout_s
        self.apply_chat_template = apply_chat_template and bool(self.tokenizer.chat_template)
        self.weight, self.on_failure = weight, on_failure
        self.counters = Counters("rm")
        self.batch_sizes: list[int] = []  # rows of every forward so far (what tests and metrics read)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None

    def render(self, text: SampleText) -> str:
        """The text the model reads: the chat template's user + assistant turns, or prompt + response."""
        if not self.apply_chat_template:
            return text.prompt + text.response
        chat = [{"role": "user", "content": text.prompt}, {"role": "assistant", "content": text.response}]
        return self.tokenizer.apply_chat_template(chat, tokenize=False)

    def forward(self, texts: list[str]) -> list[float]:
        """One forward over `texts`, right-padded into one batch; blocking (runs on the worker thread)."""
        import torch

        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_length, add_special_tokens=False)
        with torch.no_grad():
            logits = self.model(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask).logits
        self.batch_sizes.append(len(texts))
        return [float(v) for v in logits[:, 0]]

    async def score(self, texts: list[SampleText]) -> list[dict]:
        loop = asyncio.get_running_loop()
        queue = self._ensure_worker(loop)
        futures = [loop.create_future() for _ in texts]
        for text, future in zip(texts, futures):
            queue.put_nowait((self.render(text), future))
        self.counters.add("calls", len(texts))
        return list(await asyncio.gather(*(self._wait(f) for f in futures)))

    async def _wait(self, future: asyncio.Future) -> dict:
        started = time.perf_counter()
        try:
            value = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            future.cancel()  # the worker skips it if it has not taken it yet
            self.counters.add("timeouts")
            return {"score": None, "error": f"timed out after reward_model.timeout_s={self.timeout_s:g} s"}
        self.counters.seconds.append(time.perf_counter() - started)
        return {"score": value, "error": None}

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """The queue and the task that drains it, on the running loop (made again if a previous loop finished)."""
        if self._worker is None or self._worker.get_loop() is not loop or self._worker.done():
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._drain(self._queue))
        return self._queue

    async def _drain(self, queue: asyncio.Queue) -> None:
        """Take what is queued (up to batch_size), score it in one forward on the worker thread, repeat."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            while len(batch) < self.batch_size and not queue.empty():
                batch.append(queue.get_nowait())
            batch = [(text, f) for text, f in batch if not f.done()]
            if not batch:
                continue
            self.counters.add("batches")
            try:
                scores = await loop.run_in_executor(self._thread, self.forward, [text for text, _ in batch])
            except Exception as err:  # noqa: BLE001 - handed to the groups waiting on it, which fail with it
                for _, f in batch:
                    if not f.done():
                        f.set_exception(err)
                continue
            for (_, f), value in zip(batch, scores):
                if not f.done():
                    f.set_result(value)

    def metrics(self) -> dict[str, float]:
        """reward/rm_calls (responses queued), _batches (forwards), _timeouts since the last call, and reward/rm_s
        (mean seconds from queued to scored) and reward/rm_s_max when some were scored."""
        return self.counters.take(COUNTED)

    async def aclose(self) -> None:
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        self._thread.shutdown(wait=False, cancel_futures=True)


def save_tiny_reward_model(path: str | os.PathLike, *, family: str = "qwen2", vocab_size: int = 272,
                           seed: int = 0, **shape: Any) -> str:
    """A tiny random sequence-classification model with one label (`family`'s *ForSequenceClassification) and the
    tiny text tokenizer (glue.embedded_engine.tiny_text_model) at `path`: the CPU stand-in for a reward model checkpoint. `shape`:
    hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, num_experts, moe_top_k."""
    import torch
    from transformers import AutoModelForSequenceClassification

    tokenizer = train_tokenizer(arithmetic_corpus(seed), vocab_size)
    config = tiny_config(family=family, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return str(path)
