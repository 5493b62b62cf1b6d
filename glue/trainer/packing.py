"""Which samples of a train batch each trainer rank runs in each forward, and how per-token tensors move between the
batch's right-padded [B, T] layout and a micro-batch's [R, L] rows. Packed (`trainer.max_tokens_per_micro_batch`),
a micro-batch is one row of whole samples, first-fit decreasing up to the token budget, whose tokens carry their
sample's id and restart their positions; padded, it is up to `micro_batch_size` rows of the full width T.

Data parallelism (`trainer.dp_balance`): with `tokens` (the default) the samples are split over the DP ranks by
token count, longest first to the rank with the fewest tokens so far, so one long answer does not leave the other
ranks idle; with `rows`, each rank takes a contiguous near-equal share by sample count. Either way every rank
computes the whole plan from the same seq_lens, so all ranks agree on it without talking.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# plan[dp_rank][micro-batch][row] = the samples (batch rows) laid end to end in that row
Plan = list[list[list[list[int]]]]


def row_share(rows: slice, part: int, num_parts: int) -> slice:
    """Part `part` of `rows` cut into `num_parts` contiguous near-equal shares, in order (a share may be empty):
    a data-parallel rank's rows, or a PPO mini-batch."""
    n = rows.stop - rows.start
    return slice(rows.start + round(part * n / num_parts), rows.start + round((part + 1) * n / num_parts))


@dataclass
class MicroBatch:
    """One forward's inputs as index maps into the batch; `take` gathers a [B, T] tensor into [R, L], `put` scatters
    results back. Padding (index -1) reads as 0 and is never written back."""

    index: torch.Tensor  # long [R, L]: flat position b * T + t in the batch's [B, T] tensors, -1 on padding
    seq_ids: torch.Tensor | None  # long [R, L]: each token's sample (batch row), -1 on padding; None: one per row
    position_ids: torch.Tensor | None  # long [R, L]: 0, 1, ... from each sample's first token; None: 0..L-1 per row
    is_real: bool  # False for a padding micro-batch a rank runs only to keep in step with the other ranks

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This micro-batch's entries of a per-token [B, T] tensor, [R, L], 0 on padding."""
        index = self.index.to(x.device)
        return torch.where(index >= 0, x.reshape(-1)[index.clamp(min=0)], torch.zeros((), dtype=x.dtype))

    def put(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write `values` [R, L] into the [B, T] tensor `out` at this micro-batch's real tokens."""
        valid = self.index >= 0
        out.view(-1)[self.index[valid].to(out.device)] = values[valid.to(values.device)].to(out.dtype)


def split_mini_batches(batch_size: int, num_parts: int) -> list[slice]:
    """`num_parts` contiguous row ranges of near-equal size: the PPO mini-batches, packed one by one."""
    if num_parts > batch_size:
        raise ValueError(f"trainer.num_mini_batches={num_parts} exceeds the batch size {batch_size}; lower it")
    return [row_share(slice(0, batch_size), i, num_parts) for i in range(num_parts)]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` packed into bins of at most `capacity` tokens: longest first (ties by index), each into
    the first bin with room. An item longer than `capacity` gets a bin of its own rather than being split: a
    sequence must stay whole in one micro-batch for the loss's per-sequence terms."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def balance_by_tokens(lengths: list[int], num_ranks: int, sizes: list[int] | None = None) -> list[list[int]]:
    """Indices of `lengths` split over `num_ranks` ranks by token count: longest first (ties by index), each to the
    rank with the fewest tokens so far (ties: the lowest rank), the greedy longest-first rule, whose largest load is
    within 4/3 of the best split's. With `sizes`, rank r takes exactly sizes[r] items (full ranks are passed over).
    Each rank's indices come back in ascending order. Deterministic: the same lengths give the same split anywhere."""
    if sizes is not None and sum(sizes) != len(lengths):
        raise ValueError(f"rank sizes {sizes} do not add up to {len(lengths)} items")
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        open_ranks = [r for r in range(num_ranks) if sizes is None or len(ranks[r]) < sizes[r]]
        r = min(open_ranks, key=lambda r: (loads[r], r))
        ranks[r].append(i)
        loads[r] += lengths[i]
    return [sorted(rank) for rank in ranks]


def dp_shares(seq_lens: list[int], rows: slice, dp_size: int, balance: str, *, equal_rows: bool) -> list[list[int]]:
    """Each DP rank's samples (batch rows, ascending) of `rows`: `rows` balance gives contiguous near-equal shares by
    count (`row_share`); `tokens` balances their token counts, keeping the same row count per rank as
    `rows` would when `equal_rows` (padded rows all cost the full width, so a rank with more of them would run
    longer)."""
    if balance not in ("tokens", "rows"):
        raise ValueError(f"trainer.dp_balance must be 'tokens' or 'rows', got {balance!r}")
    by_count = [row_share(rows, r, dp_size) for r in range(dp_size)]
    if balance == "rows" or dp_size == 1:
        return [list(range(share.start, share.stop)) for share in by_count]
    samples = list(range(rows.start, rows.stop))
    sizes = [share.stop - share.start for share in by_count] if equal_rows else None
    parts = balance_by_tokens([seq_lens[b] for b in samples], dp_size, sizes)
    return [[samples[i] for i in part] for part in parts]


def packed_plan(seq_lens: list[int], rows: slice, max_tokens: int, dp_size: int, balance: str = "tokens") -> Plan:
    """The samples of `rows` split over the DP ranks (`dp_shares`), each rank's share packed first-fit decreasing
    into rows of at most `max_tokens` tokens, one row per micro-batch, heaviest first (so under expert parallelism
    micro-batch i pairs rows of similar widths across ranks)."""
    plan = []
    for share in dp_shares(seq_lens, rows, dp_size, balance, equal_rows=False):
        bins = [[share[i] for i in bin_] for bin_ in first_fit_decreasing([seq_lens[b] for b in share], max_tokens)]
        bins.sort(key=lambda bin_: -sum(seq_lens[b] for b in bin_))  # stable: equal loads keep their packing order
        plan.append([[bin_] for bin_ in bins])
    return plan


def padded_plan(seq_lens: list[int], rows: slice, micro_batch_size: int, dp_size: int, balance: str = "tokens"
                ) -> Plan:
    """One sample per row: each DP rank's share of `rows` (`dp_shares`; the same row count per rank either way) cut
    into near-equal micro-batches, as many on every rank as the largest share needs at `micro_batch_size` rows each
    (a smaller share gets empty ones)."""
    largest = math.ceil((rows.stop - rows.start) / dp_size)
    count = max(1, math.ceil(largest / micro_batch_size))
    plan = []
    for share in dp_shares(seq_lens, rows, dp_size, balance, equal_rows=True):
        parts = [row_share(slice(0, len(share)), i, count) for i in range(count)]
        plan.append([[[b] for b in share[part]] for part in parts])
    return plan


def micro_batches(plan: Plan, dp_rank: int, seq_lens: list[int], seq_len: int, *, is_packed: bool,
                  even_shapes: bool) -> list[MicroBatch]:
    """This rank's micro-batches: as many as the busiest rank has, so every rank runs the same number of forwards
    (expert parallelism makes each forward a collective); a rank short of work runs padding ones. With
    `even_shapes`, micro-batch i has the same [R, L] on every rank, as megatron's all-gather token dispatcher needs.
    `seq_len` is the batch's width T; a padded row spans all of it, a packed row its samples' real tokens."""
    def width(row: list[int]) -> int:
        return sum(seq_lens[b] for b in row) if is_packed else seq_len

    def shape(rows: list[list[int]]) -> tuple[int, int]:
        return len(rows), max((width(row) for row in rows), default=0)

    count = max(len(rank) for rank in plan)
    out = []
    for i in range(count):
        mine = plan[dp_rank][i] if i < len(plan[dp_rank]) else []
        shapes = [shape(rank[i]) for rank in plan if i < len(rank)] if even_shapes else [shape(mine)]
        num_rows, num_cols = max(max(s[0] for s in shapes), 1), max(max(s[1] for s in shapes), 1)
        out.append(_build(mine, seq_lens, seq_len, (num_rows, num_cols), is_packed))
    return out


def _build(rows: list[list[int]], seq_lens: list[int], seq_len: int, shape: tuple[int, int],
           is_packed: bool) -> MicroBatch:
    """The index maps of `rows` laid into a [R, L] grid; trailing padding in a packed row is a block of its own
    (seq id -1) with positions from 0, so it never shares attention with a sample."""
    num_rows, num_cols = shape
    index = torch.full(shape, -1, dtype=torch.long)
    seq_ids = torch.full(shape, -1, dtype=torch.long) if is_packed else None
    positions = torch.arange(num_cols).repeat(num_rows, 1) if is_packed else None
    for r, samples in enumerate(rows):
        start = 0
        for b in samples:
            n = seq_lens[b] if is_packed else seq_len
            index[r, start:start + n] = b * seq_len + torch.arange(n)
            if is_packed:
                seq_ids[r, start:start + n] = b
                positions[r, start:start + n] = torch.arange(n)
            start += n
        if is_packed:
            positions[r, start:] = torch.arange(num_cols - start)
    return MicroBatch(index=index, seq_ids=seq_ids, position_ids=positions, is_real=bool(rows))


def plan_micro_batches(seq_lens: list[int], seq_len: int, rows: slice, *, max_tokens: int | None,
                       micro_batch_size: int, dp_rank: int, dp_size: int, even_shapes: bool,
                       balance: str = "tokens") -> list[MicroBatch]:
    """This DP rank's micro-batches over `rows` of a [B, T = seq_len] batch: packed when `max_tokens` is set, else
    padded rows of `micro_batch_size`; the samples split over DP ranks per `balance` (trainer.dp_balance). Every
    rank computes the whole plan (each holds the whole batch), so the ranks agree on counts and shapes without
    talking."""
    if max_tokens:
        plan = packed_plan(seq_lens, rows, max_tokens, dp_size, balance)
    else:
        plan = padded_plan(seq_lens, rows, micro_batch_size, dp_size, balance)
    return micro_batches(plan, dp_rank, seq_lens, seq_len, is_packed=bool(max_tokens), even_shapes=even_shapes)
