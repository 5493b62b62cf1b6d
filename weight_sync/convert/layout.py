"""Where a megatron tensor lives in a parallel layout: how tensor parallelism splits it (by layout kind), which
pipeline stage holds a layer, which expert-parallel rank holds an expert, and the padded vocab. Pure tensor code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weight_sync.families.table import GATE_UP, REPLICATED, ROW  # layout kinds: the family name tables give them


@dataclass(frozen=True)
class ParallelLayout:
    """One megatron rank's place: TP rank/size, PP stage and its global layer range, EP rank and its experts.

    `num_layers=None` means every layer from `first_layer` on (one stage); `num_local_experts=None` means
    num_experts / ep_size; `padded_vocab_size=None` means no vocab padding; expert TP defaults to TP.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    first_layer: int = 0
    num_layers: int | None = None
    ep_rank: int = 0
    ep_size: int = 1
    num_local_experts: int | None = None
    padded_vocab_size: int | None = None
    etp_rank: int | None = None
    etp_size: int | None = None

    def __post_init__(self):
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"), (self.pp_rank, self.pp_size, "pp"),
                                 (self.ep_rank, self.ep_size, "ep"), (self.expert_tp[0], self.expert_tp[1], "etp")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"ParallelLayout: {what}_rank={rank} must lie in [0, {what}_size={size})")
        if self.pp_size > 1 and self.num_layers is None:
            raise ValueError("ParallelLayout: with pp_size > 1 give this stage's first_layer and num_layers "
                             "(ParallelLayout.even computes megatron's even split)")

    @classmethod
    def even(cls, num_layers: int, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
             ep_rank: int = 0, ep_size: int = 1, padded_vocab_size: int | None = None) -> "ParallelLayout":
        """Megatron's default layout: num_layers / pp_size consecutive layers per stage, experts split evenly."""
        if num_layers % pp_size:
            raise ValueError(f"num_layers={num_layers} does not split evenly over pipeline_model_parallel_size="
                             f"{pp_size}; choose a PP size that divides it or give first_layer/num_layers per stage")
        per_stage = num_layers // pp_size
        return cls(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, first_layer=pp_rank * per_stage,
                   num_layers=per_stage, ep_rank=ep_rank, ep_size=ep_size, padded_vocab_size=padded_vocab_size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def expert_tp(self) -> tuple[int, int]:
        """(rank, size) of expert tensor parallelism; megatron's default is the dense TP."""
        if self.etp_size is None:
            return self.tp_rank, self.tp_size
        return (self.etp_rank or 0), self.etp_size

    def holds_layer(self, layer: int) -> bool:
        return layer >= self.first_layer and (self.num_layers is None or layer < self.first_layer + self.num_layers)

    def local_experts(self, num_experts: int) -> int:
        """How many experts each EP rank holds."""
        if self.num_local_experts is not None:
            return self.num_local_experts
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} does not split over expert_model_parallel_size="
                             f"{self.ep_size}; choose an EP size that divides it")
        return num_experts // self.ep_size

    def holds_expert(self, expert: int, num_experts: int) -> bool:
        return expert // self.local_experts(num_experts) == self.ep_rank


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding rule: the smallest multiple of divisible_by * tp_size that holds the vocab."""
    multiple = divisible_by * tp_size
    return math.ceil(vocab_size / multiple) * multiple


def pad_vocab(t: torch.Tensor, padded: int | None) -> torch.Tensor:
    """Zero rows appended up to `padded` (megatron's padded embedding / output layer)."""
    if padded is None or padded == t.shape[0]:
        return t
    if padded < t.shape[0]:
        raise ValueError(f"padded_vocab_size={padded} is smaller than the vocab ({t.shape[0]}); it must be >= vocab_size")
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])], dim=0)


def shard(kind: str, name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The slice of a full megatron tensor of layout `kind` that TP rank `rank` of `size` holds (a view when it
    can be one, so a replicated tensor may share storage with `full`)."""
    if kind == REPLICATED or size == 1:
        return full
    if kind == GATE_UP:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([_chunk(name, gate, 0, rank, size), _chunk(name, up, 0, rank, size)], dim=0)
    return _chunk(name, full, 1 if kind == ROW else 0, rank, size)


def gather(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every TP rank's shard, in rank order."""
    if kind == REPLICATED or len(shards) == 1:
        return shards[0]
    if kind == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if kind == ROW else 0)


def _chunk(name: str, t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of size {t.shape[dim]} does not split over tensor_model_parallel_size="
                         f"{size}; choose a TP size that divides it")
    return t.chunk(size, dim=dim)[rank].contiguous()
