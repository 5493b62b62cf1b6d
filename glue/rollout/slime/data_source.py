"""The `data_source` a slime whole-rollout function is handed (slime `rollout/data_source.py`,
RolloutDataSourceWithBuffer): `get_samples(n)` returns `n` groups of `args.n_samples_per_prompt` fresh samples,
always, never fewer and never an empty list: first the groups given back with `add_samples` (oldest first), then the
prompts sluice's steps admitted, then further prompts of the task, as slime's data set never runs dry. Each sample
carries slime's running `group_index` and `index`. Functions call it from their own threads."""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from glue.rollout.slime.sample import Sample


class PromptDataSource:
    """`offer(prompt)` queues a prompt a step admitted; `draw()` gives the task's next prompt beyond those;
    `to_sample(prompt, group_index, index)` makes one fresh slime sample of a prompt."""

    def __init__(self, *, samples_per_prompt: int, draw: Callable[[], dict],
                 to_sample: Callable[[dict, int, int], Sample]):
        self.samples_per_prompt = samples_per_prompt
        self._draw, self._to_sample = draw, to_sample
        self._offered: collections.deque[dict] = collections.deque()
        self.buffer: list[list[Sample]] = []
        self.sample_group_index = self.sample_index = 0
        self.drawn = 0  # prompts taken from the task beyond those offered
        self.metadata: dict = {}
        self._lock = threading.Lock()

    def offer(self, prompt: dict) -> None:
        with self._lock:
            self._offered.append(prompt)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` groups: given-back ones first, then fresh ones."""
        with self._lock:
            groups = self.buffer[:num_samples]
            del self.buffer[:num_samples]
            while len(groups) < num_samples:
                groups.append(self._fresh_group())
            return groups

    def _fresh_group(self) -> list[Sample]:
        if self._offered:
            prompt = self._offered.popleft()
        else:
            prompt, self.drawn = self._draw(), self.drawn + 1
        group = [self._to_sample(prompt, self.sample_group_index, self.sample_index + i)
                 for i in range(self.samples_per_prompt)]
        self.sample_group_index += 1
        self.sample_index += self.samples_per_prompt
        return group

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Give groups back (an aborted group, to be generated on); the next `get_samples` hands them out first."""
        if not samples:
            return
        if not isinstance(samples, list) or not all(isinstance(g, list) for g in samples):
            raise TypeError(f"data_source.add_samples takes a list of groups (lists of Sample), got "
                            f"{type(samples).__name__} of {type(samples[0]).__name__}")
        for group in samples:
            if len(group) != self.samples_per_prompt:
                raise ValueError(f"data_source.add_samples: a group of {len(group)} samples; each holds "
                                 f"n_samples_per_prompt={self.samples_per_prompt}")
        with self._lock:
            self.buffer.extend(samples)

    def get_buffer_length(self) -> int:
        return len(self.buffer)

    def update_metadata(self, metadata: dict) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict:
        return self.metadata

    def save(self, rollout_id: int) -> None:
        pass  # sluice's checkpoints hold the task's cursor

    def load(self, rollout_id: Any = None) -> None:
        pass

    def __len__(self) -> int:
        """Groups ready without drawing from the task: given back, plus prompts admitted and not yet handed out."""
        return len(self.buffer) + len(self._offered)
