"""Sequence packing in the trainer (`trainer.max_tokens_per_micro_batch`): first-fit-decreasing rows, the same
number (and, under expert parallelism, shape) of forwards on every DP rank, and, for real on megatron-core/gloo, a
packed step that trains exactly like the padded one while attention and positions stay within each sample."""
from __future__ import annotations

import pytest
import torch

from glue.trainer.config import TrainerConfig
from glue.trainer.packing import MicroBatch, first_fit_decreasing, packed_plan, plan_micro_batches
from glue.types import TrainBatch
from loss import LossConfig
from helpers.packing import LOSS, PROMPT_LEN, RESPONSE_LENS, real_positions, spread_batch

BUDGET = 64  # rows of up to 64 tokens: several samples share a row


def sample_tokens(batch: TrainBatch) -> torch.Tensor:
    """1 at every real (unpadded) token of the batch, 0 on padding."""
    return (torch.arange(batch.tokens.shape[1])[None, :] < torch.tensor(batch.seq_lens)[:, None]).long()


# ---- the plan: pure ----

def test_first_fit_decreasing_places_each_item_longest_first_into_the_first_bin_with_room():
    # sorted: 7 (0), 6 (3), 5 (4), 4 (1), 3 (5), 2 (2); capacity 10
    # 7 -> bin0 [7]; 6 -> bin1 [6]; 5 -> bin2 [5]; 4 -> bin1 (6+4=10); 3 -> bin0 (7+3=10); 2 -> bin2 (5+2)
    assert first_fit_decreasing([7, 4, 2, 6, 5, 3], 10) == [[0, 5], [3, 1], [4, 2]]


def test_an_item_longer_than_the_budget_gets_a_bin_of_its_own_and_is_never_split():
    assert first_fit_decreasing([3, 25, 4], 10) == [[1], [2, 0]]


def test_each_rank_packs_its_share_and_runs_its_rows_heaviest_first():
    seq_lens = [9, 8, 7, 1, 1]
    # by tokens: 9 -> r0, 8 -> r1, 7 -> r1 (8 < 9), 1 -> r0 (9 < 15), 1 -> r0 (10 < 15); budget 9: r0 packs [9],
    # [1, 1]; r1 [8], [7]; by count: r0 takes samples 0-1 (17 tokens, two rows), r1 samples 2-4 (9 tokens, one row)
    assert packed_plan(seq_lens, slice(0, 5), 9, 2, "tokens") == [[[[0]], [[3, 4]]], [[[1]], [[2]]]]
    assert packed_plan(seq_lens, slice(0, 5), 9, 2, "rows") == [[[[0]], [[1]]], [[[2, 3, 4]]]]


def test_every_dp_rank_runs_the_same_number_of_packed_micro_batches_and_each_sample_once():
    seq_lens = [PROMPT_LEN + n for n in RESPONSE_LENS] + [5]  # 9 samples: an odd number of rows
    plan = packed_plan(seq_lens, slice(0, 9), BUDGET, dp_size=2)
    placed = sorted(b for rank in plan for mb in rank for row in mb for b in row)
    assert placed == list(range(9))
    assert all(sum(seq_lens[b] for b in mb[0]) <= BUDGET for rank in plan for mb in rank)
    counts = [len(plan_micro_batches(seq_lens, 60, slice(0, 9), max_tokens=BUDGET, micro_batch_size=4, dp_rank=r,
                                     dp_size=2, even_shapes=False)) for r in range(2)]
    assert counts[0] == counts[1] == max(len(rank) for rank in plan)


def test_a_rank_short_of_work_runs_a_padding_micro_batch_of_the_same_shape_under_expert_parallelism():
    seq_lens = [40, 30, 20]  # budget 45: rows [40], [30], [20]; rank 0 gets [40], rank 1 [30] and [20]
    per_rank = [plan_micro_batches(seq_lens, 40, slice(0, 3), max_tokens=45, micro_batch_size=1, dp_rank=r,
                                   dp_size=2, even_shapes=True) for r in range(2)]
    assert [len(m) for m in per_rank] == [2, 2]
    for i in range(2):
        assert per_rank[0][i].index.shape == per_rank[1][i].index.shape
    assert [mb.is_real for m in per_rank for mb in m].count(False) == 1


def test_a_packed_micro_batch_takes_and_puts_back_each_samples_tokens_with_restarting_positions():
    batch = spread_batch([4, 2, 1])  # seq_lens 7, 5, 4; T = 7
    (mb,) = plan_micro_batches(batch.seq_lens, 7, slice(0, 3), max_tokens=16, micro_batch_size=1, dp_rank=0,
                               dp_size=1, even_shapes=False)
    assert mb.seq_ids.tolist() == [[0] * 7 + [1] * 5 + [2] * 4]
    assert mb.position_ids.tolist() == [list(range(7)) + list(range(5)) + list(range(4))]
    row = mb.take(batch.tokens)
    assert row.tolist() == [batch.tokens[0, :7].tolist() + batch.tokens[1, :5].tolist() + batch.tokens[2, :4].tolist()]
    back = torch.zeros_like(batch.tokens)
    mb.put(row, back)
    assert torch.equal(back, batch.tokens * sample_tokens(batch))


def test_padding_in_a_packed_row_reads_as_zero_and_is_never_written_back():
    mb = MicroBatch(index=torch.tensor([[1, 0, -1]]), seq_ids=torch.tensor([[0, 0, -1]]),
                    position_ids=torch.tensor([[0, 1, 0]]), is_real=True)
    assert mb.take(torch.tensor([[5.0, 6.0]])).tolist() == [[6.0, 5.0, 0.0]]
    out = torch.full((1, 2), -9.0)
    mb.put(torch.tensor([[1.0, 2.0, 3.0]]), out)
    assert out.tolist() == [[2.0, 1.0]]


def test_the_budget_must_be_a_positive_token_count_or_null():
    assert TrainerConfig(max_tokens_per_micro_batch=0).max_tokens_per_micro_batch == 0
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch must be an integer >= 1"):
        TrainerConfig(max_tokens_per_micro_batch=-5)


def test_thd_params_for_transformer_engine_start_a_sequence_wherever_the_id_changes():
    from glue.trainer.model import thd_packed_seq_params

    params = thd_packed_seq_params(torch.tensor([[4, 4, 4, 0, 0, 7, -1, -1]]))
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 5, 6, 8]
    assert params.max_seqlen_q == params.max_seqlen_kv == 3


# ---- megatron-core on gloo: one rank in a spawned process ----

def _packed_and_padded_scenario(model_dir: str) -> dict:
    """The same batch through a padded and a packed worker: logprobs and entropy, one train step's metrics and raw
    gradients (no clipping), logprobs after the step, and the shape of every forward."""
    from helpers.trainer_process import start_worker, stop_worker

    batch = spread_batch()
    out = {}
    for name, budget in (("padded", None), ("packed", BUDGET)):
        worker = start_worker(model_dir, LossConfig(**LOSS), grad_clip=0.0, micro_batch_size=3,
                              max_tokens_per_micro_batch=budget)
        forwards, forward = [], worker._forward
        worker._forward = lambda tokens, *args, **kwargs: forwards.append(tuple(tokens.shape)) or forward(
            tokens, *args, **kwargs)
        logprobs, entropy = worker.compute_logprobs(batch, with_entropy=True)
        metrics = worker.train_step(batch)
        grads = {n: p.main_grad.clone() for n, p in worker.model.named_parameters()}  # megatron DDP's buffer
        out[name] = dict(logprobs=logprobs, entropy=entropy, metrics=metrics, grads=grads,
                         after=worker.compute_logprobs(batch), forwards=list(forwards))
        stop_worker(worker)
    return out


@pytest.fixture(scope="module")
def packed_and_padded(tiny_model_dir) -> dict:
    from helpers.trainer_process import run_in_trainer_process

    return run_in_trainer_process(_packed_and_padded_scenario, tiny_model_dir)


def test_a_packed_train_step_gives_the_padded_steps_loss_and_gradients(packed_and_padded):
    padded, packed = packed_and_padded["padded"], packed_and_padded["packed"]
    for name in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/clipfrac", "train/grad_norm"):
        assert abs(packed["metrics"][name] - padded["metrics"][name]) < 1e-5, \
            f"{name}: packed {packed['metrics'][name]} != padded {padded['metrics'][name]}"
    assert padded["metrics"]["train/grad_norm"] > 1e-3, "the step must have a gradient to compare"
    for name, grad in padded["grads"].items():
        diff = (packed["grads"][name] - grad).abs().max().item()
        assert diff < 1e-5 * max(1.0, grad.abs().max().item()), f"{name}: gradients differ by {diff}"


def test_packed_logprobs_come_back_per_sample_in_the_batchs_order(packed_and_padded):
    padded, packed = packed_and_padded["padded"], packed_and_padded["packed"]
    real = real_positions(spread_batch())
    for what in ("logprobs", "entropy", "after"):
        assert (packed[what] - padded[what])[real].abs().max().item() < 1e-5, what
    assert (packed["logprobs"][~real] == 0).all(), "a sample's last token predicts nothing: 0, as in the last column"


def test_packing_runs_one_row_per_forward_and_fewer_than_half_the_token_slots(packed_and_padded):
    # 8 samples of 6..60 tokens (203 in all): padded, micro-batches of 3, 2, 3 rows x 60 columns (480 slots);
    # packed, first-fit decreasing at 64 tokens: [60], [44, 17], [33, 23, 8], [12, 6], dealt heaviest first (203
    # slots). Five passes: logprobs, old and reference logprobs, the training forward, logprobs after.
    assert packed_and_padded["padded"]["forwards"] == [(3, 60), (2, 60), (3, 60)] * 5
    assert packed_and_padded["packed"]["forwards"] == [(1, 64), (1, 61), (1, 60), (1, 18)] * 5


def _isolation_scenario(model_dir: str) -> dict:
    """Logprobs of a packed batch before and after sample A's tokens change (A sits before B in B's packed row),
    and the rotary angles megatron applied in the packed forward."""
    from glue.trainer import rope
    from glue.trainer.packing import packed_plan
    from helpers.trainer_process import start_worker, stop_worker

    batch = spread_batch()
    rows = [row for rank in packed_plan(batch.seq_lens, slice(0, 8), BUDGET, 1) for mb in rank for row in mb]
    worker = start_worker(model_dir, LossConfig(), max_tokens_per_micro_batch=BUDGET)
    angles = []
    apply = rope.rotate

    def recording(t, freqs, packed=False):
        angles.append(freqs.detach().clone())
        return apply(t, freqs, packed)

    rope.rotate = recording
    before = worker.compute_logprobs(batch)
    rope.rotate = apply
    table = worker.model.rotary_pos_emb(max(batch.seq_lens))[:, 0, 0]
    changed = spread_batch()
    a, b = next(row[:2] for row in rows if len(row) > 2)
    changed.tokens[a, : changed.seq_lens[a]] = (changed.tokens[a, : changed.seq_lens[a]] + 7) % 30 + 2
    after = worker.compute_logprobs(changed)
    stop_worker(worker)
    return dict(rows=rows, a=a, b=b, before=before, after=after, angles=angles, table=table)


def test_changing_one_sample_leaves_the_next_sample_in_its_packed_row_unchanged(tiny_model_dir):
    from helpers.trainer_process import run_in_trainer_process

    out = run_in_trainer_process(_isolation_scenario, tiny_model_dir)
    a, b = out["a"], out["b"]
    real = real_positions(spread_batch())
    assert (out["after"][a] - out["before"][a])[real[a]].abs().max().item() > 1e-2, "sample A itself must change"
    assert (out["after"][b] - out["before"][b]).abs().max().item() < 1e-6, "attention crossed from A into B"

    # every packed forward rotated each token by its position within its own sample, 0 at each sample's start
    seq_lens = spread_batch().seq_lens
    assert len(out["angles"]) == 2 * 2 * len(out["rows"]), "query and key, 2 layers, one forward per packed row"
    for row, freqs in zip(out["rows"], out["angles"][::4]):
        positions = torch.cat([torch.arange(seq_lens[s]) for s in row])
        assert freqs.shape[:2] == (len(positions), 1)
        assert torch.equal(freqs[:, 0, 0], out["table"][positions])


# ---- spawned ranks: data and expert parallelism ----

@pytest.mark.slow
def test_packed_rows_over_two_expert_parallel_ranks_train_like_one_padded_rank(tmp_path_factory):
    # 9 samples of 6..60 tokens packed into 5 rows dealt 3 + 2 to DP=2: the rank with fewer runs a padding
    # micro-batch, and under EP=2 each micro-batch is padded to the other rank's shape, because every forward's
    # token all-gather concatenates equal shares. Unequal counts or shapes would fail the collective or hang.
    from glue.embedded_engine.tiny_model import save_tiny_model
    from helpers.trainer import run_trainer_ranks

    batch = spread_batch(RESPONSE_LENS + [50])
    model = save_tiny_model(str(tmp_path_factory.mktemp("moe_packed")), family="qwen3_moe", seed=3)
    loss_cfg = LossConfig(**LOSS)
    one = run_trainer_ranks(model, 1, batch, loss_cfg=loss_cfg, adam_eps=1e-5)
    two = run_trainer_ranks(model, 1, batch, loss_cfg=loss_cfg, adam_eps=1e-5, data_parallel_size=2,
                            expert_model_parallel_size=2, max_tokens_per_micro_batch=BUDGET)
    for name in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"):
        assert abs(one["metrics"][name] - two["metrics"][name]) < 1e-5, \
            f"{name}: {two['metrics'][name]} != {one['metrics'][name]}"
    real = real_positions(batch)
    for what in ("before", "entropy", "after"):
        assert (two[what] - one[what])[real].abs().max().item() < 1e-5, what
    for name, w1 in one["weights"].items():
        assert (two["weights"][name] - w1).abs().max().item() < 1e-5, name
