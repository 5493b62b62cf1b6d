"""The running batch's KV cache: rows of different lengths kept left-padded so they decode in one forward.

Rows join after their own prefill and leave when they finish (continuous batching); padding columns are masked
out of attention and trimmed once no row needs them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values), each `[B, H_kv, T, D]`, from an HF cache after a forward."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if n == 0:
        return kv
    return [(F.pad(k, (0, 0, n, 0)), F.pad(v, (0, 0, n, 0))) for k, v in kv]


class KVBatch:
    """Left-padded KV for B rows plus the attention mask `[B, T]` (1 = real token) that goes with it."""

    def __init__(self) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    def add(self, kv: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int]) -> None:
        """Append rows whose KV holds `lengths[i]` real tokens, right-aligned in a `[b, H, t, D]` block."""
        t = kv[0][0].shape[2]
        mask = torch.zeros(len(lengths), t, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, t - n:] = 1
        if self.size == 0:
            self.kv, self.mask = kv, mask
            return
        width = max(t, self.mask.shape[1])
        old, new = _pad_left(self.kv, width - self.mask.shape[1]), _pad_left(kv, width - t)
        self.kv = [(torch.cat([ko, kn]), torch.cat([vo, vn])) for (ko, vo), (kn, vn) in zip(old, new)]
        self.mask = torch.cat([F.pad(self.mask, (width - self.mask.shape[1], 0)), F.pad(mask, (width - t, 0))])

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (indices into the current batch, in the order to keep)."""
        if len(rows) == self.size:
            return
        if not rows:
            self.__init__()
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.mask = self.mask.index_select(0, index)
        first = int(self.mask.any(0).nonzero()[0])  # leading columns that are padding in every row go
        self.mask = self.mask[:, first:]
        index = index.to(self.kv[0][0].device)
        self.kv = [(k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:]) for k, v in self.kv]

    def decode_inputs(self) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """HF forward inputs for one new token per row: the cache, the mask including it, and its position."""
        cache = DynamicCache(ddp_cache_data=self.kv)
        mask = F.pad(self.mask, (0, 1), value=1)
        positions = self.mask.sum(1, keepdim=True)
        return cache, mask, positions

    def advance(self, cache: DynamicCache) -> None:
        """Take the cache back after a decode forward: every row gained one real token."""
        self.kv = cache_tensors(cache)
        self.mask = F.pad(self.mask, (0, 1), value=1)
