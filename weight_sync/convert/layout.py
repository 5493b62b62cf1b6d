"""Where a megatron tensor lives in a parallel layout: how tensor parallelism splits it (by layout kind), which
pipeline stage holds a layer (megatron-core's split, even or with its own first / last stage sizes), which
expert-parallel rank holds an expert, and the padded vocab. Pure tensor code.
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
                             "(ParallelLayout.pipeline computes megatron's split)")

    @classmethod
    def pipeline(cls, num_layers: int, *, pp_rank: int = 0, pp_size: int = 1, first: int | None = None,
                 last: int | None = None, **place: int | None) -> "ParallelLayout":
        """The layout of stage `pp_rank` under megatron-core's split (`stage_layer_ranges`: even, or `first` /
        `last` layers on the first / last stage); `place`: the other fields (tp_rank, ep_size, padded_vocab_size...)."""
        layers = stage_layer_ranges(num_layers, pp_size, first=first, last=last)[pp_rank]
        return cls(pp_rank=pp_rank, pp_size=pp_size, first_layer=layers.start, num_layers=len(layers), **place)

    @classmethod
    def even(cls, num_layers: int, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
             ep_rank: int = 0, ep_size: int = 1, padded_vocab_size: int | None = None) -> "ParallelLayout":
        """Megatron's default layout: num_layers / pp_size consecutive layers per stage, experts split evenly."""
        return cls.pipeline(num_layers, pp_rank=pp_rank, pp_size=pp_size, tp_rank=tp_rank, tp_size=tp_size,
                            ep_rank=ep_rank, ep_size=ep_size, padded_vocab_size=padded_vocab_size)

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


FIRST_STAGE, LAST_STAGE = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"
SPLIT_FLAGS = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"


def stage_layer_ranges(num_layers: int, pp_size: int, *, first: int | None = None,
                       last: int | None = None) -> tuple[range, ...]:
    """The global layers of every pipeline stage, as megatron-core builds them: `first` / `last` layers on the first /
    last stage where given (its num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage), the other
    stages splitting the rest evenly. A split megatron-core refuses (or would build a stage of no layers with) is
    refused naming the values."""
    if pp_size < 1:
        raise ValueError(f"pipeline_model_parallel_size={pp_size} must be at least 1")
    given = {name: value for name, value in ((FIRST_STAGE, first), (LAST_STAGE, last)) if value is not None}
    for name, value in given.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1 (megatron-core refuses an empty first or last "
                             "stage); give a positive number of layers or leave it unset")
    if pp_size == 1:
        for name, value in given.items():
            if value != num_layers:
                raise ValueError(f"{name}={value}: pipeline_model_parallel_size=1 holds all num_layers={num_layers} "
                                 "in its one stage; leave it unset or raise the PP size")
        return (range(num_layers),)
    middle = pp_size - len(given)
    rest = num_layers - sum(given.values())
    _check_middle(num_layers, pp_size, given, middle, rest)
    sizes = [rest // middle if middle else 0] * pp_size
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    starts = [sum(sizes[:s]) for s in range(pp_size)]
    return tuple(range(start, start + size) for start, size in zip(starts, sizes))


def _check_middle(num_layers: int, pp_size: int, given: dict[str, int], middle: int, rest: int) -> None:
    """What is left for the stages between the first and the last splits evenly into at least one layer each."""
    if not given:
        if num_layers % pp_size:
            raise ValueError(f"num_layers={num_layers} does not split evenly over pipeline_model_parallel_size="
                             f"{pp_size}; choose a PP size that divides it, or set {FIRST_STAGE} / {LAST_STAGE} "
                             f"({SPLIT_FLAGS})")
        return
    values = " and ".join(f"{name}={value}" for name, value in given.items())
    if middle == 0:
        if rest:
            raise ValueError(f"{values} must add up to num_layers={num_layers} at pipeline_model_parallel_size="
                             f"{pp_size} (no middle stages); choose values that do, or leave one unset")
        return
    leaves = (f"{values} leave{'s' if len(given) == 1 else ''} {rest} of num_layers={num_layers} for {middle} middle "
              f"pipeline stage{'s' if middle > 1 else ''}")
    if rest < middle:
        raise ValueError(f"{leaves}, and megatron-core builds at least one layer on each; choose smaller values or "
                         "a smaller PP size")
    if rest % middle:
        raise ValueError(f"{leaves}, which megatron-core splits evenly and {rest} does not divide by {middle}; "
                         f"choose values that leave a multiple of {middle}")


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
