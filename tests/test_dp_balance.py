"""Token-balanced data parallelism (`trainer.dp_balance`, glue/trainer/packing.py): the samples of a mini-batch are
split over DP ranks by token count, so a group of long answers does not pile onto one rank while the others idle;
every rank still runs the same number of micro-batches, the split is the same on every rank, and per-token results
come back in the batch's order. End to end (spawned gloo ranks): a balanced DP=2 packed step trains like one rank."""
from __future__ import annotations

import pytest
import torch

from glue.trainer.config import TrainerConfig
from glue.trainer.packing import balance_by_tokens, dp_shares, plan_micro_batches

# a GRPO batch in group order: 4 answers per prompt, the first prompt's answers long (the long tail), the rest short
LONG_TAIL = [1000, 900, 950, 800] + [60, 80, 50, 70, 40, 90, 65, 75, 55, 85, 45, 95]
BUDGET = 1024


def rank_tokens(seq_lens: list[int], dp_size: int, balance: str, max_tokens: int | None = BUDGET,
                micro_batch_size: int = 4) -> list[int]:
    """Real tokens each DP rank runs, read off the micro-batches `plan_micro_batches` gives each rank."""
    width = max(seq_lens)
    loads = []
    for rank in range(dp_size):
        mbs = plan_micro_batches(seq_lens, width, slice(0, len(seq_lens)), max_tokens=max_tokens,
                                 micro_batch_size=micro_batch_size, dp_rank=rank, dp_size=dp_size,
                                 even_shapes=False, balance=balance)
        loads.append(sum(int((mb.index >= 0).sum()) for mb in mbs if mb.is_real) if max_tokens else
                     sum(seq_lens[int(i) // width] for mb in mbs for i in mb.index[:, 0] if i >= 0))
    return loads


def test_balancing_by_tokens_evens_out_a_long_tailed_batch_that_a_split_by_count_leaves_lopsided():
    total = sum(LONG_TAIL)
    by_count, by_tokens = rank_tokens(LONG_TAIL, 2, "rows"), rank_tokens(LONG_TAIL, 2, "tokens")
    assert sum(by_count) == sum(by_tokens) == total
    # by count, rank 0 takes the long group: 3,650 + 280 of 4,560 tokens against 630 on rank 1
    assert max(by_count) > 0.85 * total
    # by tokens, the heavier rank is within one short sample of half
    assert max(by_tokens) - total / 2 <= max(LONG_TAIL[4:]), by_tokens
    assert max(by_tokens) < 0.6 * max(by_count)


@pytest.mark.parametrize("dp_size", [2, 3, 4])
def test_padded_rows_keep_equal_row_counts_per_rank_and_still_balance_tokens(dp_size):
    by_count = rank_tokens(LONG_TAIL, dp_size, "rows", max_tokens=None)
    by_tokens = rank_tokens(LONG_TAIL, dp_size, "tokens", max_tokens=None)
    assert sum(by_tokens) == sum(LONG_TAIL)
    assert max(by_tokens) < max(by_count)
    counts = [len(rank) for rank in dp_shares(LONG_TAIL, slice(0, 16), dp_size, "tokens", equal_rows=True)]
    assert counts == [len(rank) for rank in dp_shares(LONG_TAIL, slice(0, 16), dp_size, "rows", equal_rows=True)]


def test_greedy_longest_first_assigns_each_item_to_the_lightest_rank():
    # sorted: 9 (0), 7 (3), 5 (1), 4 (2), 2 (4); 9 -> r0, 7 -> r1, 5 -> r1 (7 < 9), 4 -> r0 (9 < 12), 2 -> r1 (12 < 13)
    assert balance_by_tokens([9, 5, 4, 7, 2], 2) == [[0, 2], [1, 3, 4]]
    # with sizes the full rank is passed over: r0 may take only one item
    assert balance_by_tokens([9, 5, 4, 7, 2], 2, sizes=[1, 4]) == [[0], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="do not add up"):
        balance_by_tokens([1, 2, 3], 2, sizes=[1, 1])


@pytest.mark.parametrize("max_tokens", [BUDGET, None])
def test_every_rank_computes_the_same_split_and_runs_the_same_number_of_micro_batches(max_tokens):
    rows = slice(2, 16)  # a mini-batch that does not start at row 0
    plans = [[plan_micro_batches(LONG_TAIL, 1000, rows, max_tokens=max_tokens, micro_batch_size=3, dp_rank=r,
                                 dp_size=3, even_shapes=True) for r in range(3)] for _ in range(2)]
    for first, again in zip(*plans):  # deterministic: the same index maps on a second call
        assert all(torch.equal(a.index, b.index) for a, b in zip(first, again))
    per_rank = plans[0]
    assert len({len(mbs) for mbs in per_rank}) == 1
    for i in range(len(per_rank[0])):  # even shapes: micro-batch i has one shape on every rank
        assert len({tuple(mbs[i].index.shape) for mbs in per_rank}) == 1
    flat = sorted(int(i) for mbs in per_rank for mb in mbs for i in mb.index.flatten() if i >= 0)
    expected = sorted(b * 1000 + t for b in range(2, 16) for t in range(LONG_TAIL[b] if max_tokens else 1000))
    assert flat == expected, "each token of the mini-batch exactly once, none of the rows outside it"


def test_balanced_results_come_back_in_the_batchs_order():
    gen = torch.Generator().manual_seed(0)
    width = max(LONG_TAIL)
    values = torch.rand(len(LONG_TAIL), width, generator=gen)
    real = torch.arange(width)[None, :] < torch.tensor(LONG_TAIL)[:, None]
    out = torch.zeros_like(values)
    for rank in range(2):
        for mb in plan_micro_batches(LONG_TAIL, width, slice(0, 16), max_tokens=BUDGET, micro_batch_size=1,
                                     dp_rank=rank, dp_size=2, even_shapes=True):
            if mb.is_real:
                mb.put(mb.take(values) * 2, out)
    assert torch.equal(out, values * 2 * real)


def test_the_switch_takes_tokens_or_rows():
    assert TrainerConfig().dp_balance == "tokens"
    assert TrainerConfig(dp_balance="rows").dp_balance == "rows"
    with pytest.raises(ValueError, match="trainer.dp_balance must be 'tokens' or 'rows'"):
        TrainerConfig(dp_balance="samples")
    with pytest.raises(ValueError, match="trainer.dp_balance"):
        plan_micro_batches([3, 4], 4, slice(0, 2), max_tokens=8, micro_batch_size=1, dp_rank=0, dp_size=2,
                           even_shapes=False, balance="count")


# ---- spawned ranks on gloo ----

@pytest.mark.slow
def test_a_token_balanced_packed_dp2_step_trains_like_one_rank_and_splits_unlike_by_count(tmp_path):
    from glue.embedded_engine.tiny_model import save_tiny_model
    from helpers.packing import LOSS, real_positions, spread_batch
    from helpers.trainer import run_trainer_ranks
    from loss import LossConfig

    # the long answers first, as one prompt's group would be: by count, rank 0 would get 137 of 176 tokens
    batch = spread_batch([57, 41, 50, 30, 3, 9, 5, 14])
    lens = batch.seq_lens
    assert max(rank_tokens(lens, 2, "tokens", 64)) < max(rank_tokens(lens, 2, "rows", 64)), "the split must change"
    model = save_tiny_model(str(tmp_path / "model"), family="qwen2", seed=3)
    loss_cfg = LossConfig(**LOSS)
    one = run_trainer_ranks(model, 1, batch, loss_cfg=loss_cfg, adam_eps=1e-5, max_tokens_per_micro_batch=64)
    two = run_trainer_ranks(model, 1, batch, loss_cfg=loss_cfg, adam_eps=1e-5, data_parallel_size=2,
                            max_tokens_per_micro_batch=64)
    for name in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"):
        assert abs(one["metrics"][name] - two["metrics"][name]) < 1e-5, \
            f"{name}: {two['metrics'][name]} != {one['metrics'][name]}"
    real = real_positions(batch)
    for what in ("before", "entropy", "after"):
        assert (two[what] - one[what])[real].abs().max().item() < 1e-5, what
    for name, w1 in one["weights"].items():
        assert (two["weights"][name] - w1).abs().max().item() < 1e-5, name
