"""glue.trainer.logprobs on CPU/gloo, for real (2 spawned ranks, megatron's parallel state at TP=1 and then TP=2):
per-token logprobs and entropy from a vocab shard of the logits, in row chunks, equal the full-vocabulary formulas
and today's megatron vocab-parallel cross entropy (gradients included, fp32 and bf16), and forward + backward hold
far less than the fp32 copy of the logits that today's functions make, counted in tensor bytes."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from helpers.trainer import _free_port, join_gloo, results_of_ranks
from helpers.forkserver import rank_context

TEMPERATURE = 0.7
BATCH, SEQ, VOCAB = 3, 7, 40
CHUNK_ROWS = 4  # 21 rows of logits: five chunks of 4 and a ragged last chunk of 1
SEQ_IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0]])  # packed rows
# the memory case: 2048 tokens x vocab 8192, the default chunk sized so that the logits take 16 chunks
MEMORY_BATCH, MEMORY_SEQ, MEMORY_VOCAB, MEMORY_CHUNKS = 2, 1024, 8192, 16


def case_inputs(batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> dict:
    """Full-vocab fp32 logits spread wide enough that softmax is far from uniform, next tokens over the whole
    vocabulary (so both TP shards own some), and random upstream gradients for the logprobs and the entropy."""
    gen = torch.Generator().manual_seed(3)
    return {"logits": 3 * torch.randn(batch, seq, vocab, generator=gen),
            "tokens": torch.randint(0, vocab, (batch, seq), generator=gen),
            "g_lp": torch.randn(batch, seq, generator=gen), "g_ent": torch.randn(batch, seq, generator=gen)}


def reference(inputs: dict, seq_ids: torch.Tensor) -> dict:
    """The formulas on fp32 full-vocab logits: log_softmax at the next token (0 in the last column and at each
    sample's last token), -sum p log p, and the gradient of sum(g_lp * logprobs + g_ent * entropy)."""
    x = inputs["logits"].float().detach().requires_grad_()
    tokens = inputs["tokens"]
    logp = torch.log_softmax(x / TEMPERATURE, dim=-1)
    logprobs = logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    logprobs = F.pad(torch.where(seq_ids[:, 1:] == seq_ids[:, :-1], logprobs, 0.0), (0, 1))
    entropy = -(logp.exp() * logp).sum(-1)
    (grad,) = torch.autograd.grad(loss_of(logprobs, entropy, inputs), x)
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grad": grad}


def loss_of(logprobs: torch.Tensor, entropy: torch.Tensor | None, inputs: dict) -> torch.Tensor:
    """sum(g_lp * logprobs + g_ent * entropy): a random upstream gradient on both outputs."""
    return (logprobs * inputs["g_lp"]).sum() + (0 if entropy is None else (entropy * inputs["g_ent"]).sum())


def chunked(seq_ids: torch.Tensor | None, with_entropy: bool = True, chunk_rows: int | None = CHUNK_ROWS):
    """The forward under test: glue.trainer.logprobs on this rank's shard `x` of the logits."""
    from glue.trainer.logprobs import token_logprobs_and_entropy

    return lambda x, tokens: token_logprobs_and_entropy(x, tokens, TEMPERATURE, seq_ids, with_entropy=with_entropy,
                                                        chunk_rows=chunk_rows)


def today(seq_ids: torch.Tensor | None):
    """The forward the trainer had before: megatron's vocab_parallel_cross_entropy on a full fp32 copy of the logits,
    and the entropy from another full fp32 copy (all-reduced max, then the shard sums all-reduced)."""
    from megatron.core import parallel_state, tensor_parallel

    def forward(x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = -tensor_parallel.vocab_parallel_cross_entropy(x[:, :-1].float() / TEMPERATURE, tokens[:, 1:])
        if seq_ids is not None:
            logprobs = torch.where(seq_ids[:, 1:] == seq_ids[:, :-1], logprobs, 0.0)
        scaled = x.float() / TEMPERATURE
        peak = scaled.detach().max(dim=-1, keepdim=True).values
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
        shifted = scaled - peak
        exp = shifted.exp()
        sums = tensor_parallel.reduce_from_tensor_model_parallel_region(
            torch.stack([exp.sum(-1), (exp * shifted).sum(-1)]))
        return F.pad(logprobs, (0, 1)), sums[0].log() - sums[1] / sums[0]

    return forward


def with_grad(forward, logits: torch.Tensor, inputs: dict) -> dict:
    """`forward`'s logprobs and entropy of `logits`, and the gradient of loss_of them with respect to `logits`."""
    x = logits.detach().requires_grad_()
    logprobs, entropy = forward(x, inputs["tokens"])
    (grad,) = torch.autograd.grad(loss_of(logprobs, entropy, inputs), x)
    return {"logprobs": logprobs.detach(), "entropy": None if entropy is None else entropy.detach(), "grad": grad}


def bytes_held(forward, logits: torch.Tensor, inputs: dict) -> dict:
    """Tensor bytes `forward` and its backward allocate: the most alive at once in forward, and in backward beside
    the logits' gradient (logits-sized by necessity, reported as `grad`)."""
    from tensor_census import TensorCensus

    census, x = TensorCensus(), logits.detach().requires_grad_()
    with census:
        logprobs, entropy = forward(x, inputs["tokens"])
        forward_peak = census.peak
        census.reset_peak()
        (grad,) = torch.autograd.grad(loss_of(logprobs, entropy, inputs), x)
    grad_bytes = grad.numel() * grad.element_size()
    return {"forward": forward_peak, "backward": census.peak - grad_bytes, "grad": grad_bytes}


def memory_case(dtype: torch.dtype) -> dict:
    """Bytes held by the chunked function (its default chunk scaled to a sixteenth of the logits) and by today's,
    for 2048 tokens x vocab 8192 at TP=1."""
    from glue.trainer import logprobs

    inputs = case_inputs(MEMORY_BATCH, MEMORY_SEQ, MEMORY_VOCAB)
    logits = inputs["logits"].to(dtype)
    default = logprobs.CHUNK_BYTES
    logprobs.CHUNK_BYTES = MEMORY_BATCH * MEMORY_SEQ * MEMORY_VOCAB * 4 // MEMORY_CHUNKS
    try:
        rows = logprobs.default_chunk_rows(MEMORY_VOCAB)
        ours = bytes_held(chunked(None, chunk_rows=None), logits, inputs)
    finally:
        logprobs.CHUNK_BYTES = default
    return {"chunk_rows": rows, "ours": ours, "today": bytes_held(today(None), logits, inputs)}


def _cases(tp: int) -> dict:
    """Every case of one TP layout, on this rank's vocab shard of the same full-vocab inputs."""
    from megatron.core import parallel_state

    inputs = case_inputs()
    width = VOCAB // tp
    start = parallel_state.get_tensor_model_parallel_rank() * width
    shard = inputs["logits"][..., start:start + width].contiguous()
    out = {"start": start, "width": width, "fp32": with_grad(chunked(SEQ_IDS), shard, inputs),
           "bf16": with_grad(chunked(SEQ_IDS), shard.bfloat16(), inputs),
           "today": with_grad(today(SEQ_IDS), shard, inputs),
           "logprobs_only": with_grad(chunked(None, with_entropy=False), shard, inputs)}
    if tp == 1:
        out["memory"] = {dtype: memory_case(dtype) for dtype in (torch.float32, torch.bfloat16)}
    return out


def _rank_main(rank: int, port: int, results) -> None:
    from megatron.core import parallel_state

    join_gloo(rank, port)
    out = {}
    for tp in (1, 2):  # at TP=1 the two ranks are data-parallel and rank 0 alone runs the cases
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        out[tp] = _cases(tp) if tp == 2 or rank == 0 else None
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    results.put(pickle.dumps((rank, out)))  # plain bytes: a queued tensor would live in this process's shm


@pytest.fixture(scope="module")
def ranks() -> dict:
    """{tp: [rank 0's cases, rank 1's cases]} (at TP=1, rank 0's only), from one pair of spawned gloo ranks."""
    ctx = rank_context()
    results = ctx.Queue()
    port = _free_port()
    outs = results_of_ranks([ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)], results)
    return {1: [outs[0][0][1]], 2: [outs[0][0][2], outs[1][0][2]]}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    gap = (actual.float() - expected).abs().max().item()
    assert gap <= tol, f"{what}: off by {gap:.3g} (tolerance {tol:.3g})"


def assert_matches(case: dict, expected: dict, start: int, width: int, tol: float, what: str) -> None:
    """Logprobs and entropy against the full-vocab `expected`, the gradient against its columns of this shard."""
    assert_close(case["logprobs"], expected["logprobs"], tol, f"{what} logprobs")
    assert_close(case["entropy"], expected["entropy"], tol, f"{what} entropy")
    assert_close(case["grad"], expected["grad"][..., start:start + width], tol, f"{what} gradient")


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_logprobs_and_entropy_equal_the_softmax_formulas_with_gradients_on_every_tp_rank(ranks, tp):
    expected = reference(case_inputs(), SEQ_IDS)
    assert (expected["logprobs"][:, -1] == 0).all() and (expected["logprobs"][1, [1, 4]] == 0).all()
    for rank, case in enumerate(ranks[tp]):
        assert_matches(case["fp32"], expected, case["start"], case["width"], 1e-5, f"TP={tp} rank {rank} fp32")


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_function_equals_todays_megatron_cross_entropy_and_entropy_gradients_included(ranks, tp):
    for rank, case in enumerate(ranks[tp]):
        assert_matches(case["fp32"], case["today"], 0, case["width"], 1e-5, f"TP={tp} rank {rank} against today's")


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_logits_give_the_fp32_reference_up_to_the_bf16_rounding_of_the_gradient(ranks, tp):
    inputs = case_inputs()
    expected = reference({**inputs, "logits": inputs["logits"].bfloat16().float()}, SEQ_IDS)
    for rank, case in enumerate(ranks[tp]):
        bf16 = case["bf16"]
        assert bf16["grad"].dtype == torch.bfloat16
        assert_close(bf16["logprobs"], expected["logprobs"], 1e-5, f"TP={tp} rank {rank} bf16 logprobs")
        assert_close(bf16["entropy"], expected["entropy"], 1e-5, f"TP={tp} rank {rank} bf16 entropy")
        shard_grad = expected["grad"][..., case["start"]:case["start"] + case["width"]]
        # rounding to bf16 (8 significant bits) moves each gradient entry by at most 2^-8 of itself
        gap = (bf16["grad"].float() - shard_grad).abs()
        assert (gap <= 2**-8 * shard_grad.abs() + 1e-6).all(), f"TP={tp} rank {rank}: bf16 gradient off by {gap.max()}"


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_alone_skip_the_entropy_and_get_the_gradient_of_the_logprobs_alone(ranks, tp):
    inputs = case_inputs()
    expected = reference({**inputs, "g_ent": torch.zeros(BATCH, SEQ)}, torch.zeros(BATCH, SEQ, dtype=torch.long))
    for rank, case in enumerate(ranks[tp]):
        alone = case["logprobs_only"]
        assert alone["entropy"] is None
        assert_close(alone["logprobs"], expected["logprobs"], 1e-5, f"TP={tp} rank {rank} logprobs alone")
        assert_close(alone["grad"], expected["grad"][..., case["start"]:case["start"] + case["width"]], 1e-5,
                     f"TP={tp} rank {rank} gradient of the logprobs alone")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_hold_under_a_quarter_of_an_fp32_copy_of_the_logits_where_todays_hold_more(ranks, dtype):
    memory = ranks[1][0]["memory"][dtype]
    tokens = MEMORY_BATCH * MEMORY_SEQ
    assert tokens // memory["chunk_rows"] >= 8, f"only {tokens / memory['chunk_rows']:.1f} chunks"
    fp32_copy = tokens * MEMORY_VOCAB * 4
    ours, old = memory["ours"], memory["today"]
    assert ours["grad"] == tokens * MEMORY_VOCAB * dtype.itemsize
    assert ours["backward"] > 0, "the census did not see the gradient that backward allocates"
    ours_ratio = max(ours["forward"], ours["backward"]) / fp32_copy
    old_ratio = max(old["forward"], old["backward"]) / fp32_copy
    print(f"{dtype}: chunked {ours_ratio:.4f} (forward {ours['forward'] / fp32_copy:.4f}, backward beside the "
          f"gradient {ours['backward'] / fp32_copy:.4f}); today's {old_ratio:.4f} of the fp32 logits' "
          f"{fp32_copy >> 20} MiB; the gradient {ours['grad'] / fp32_copy:.2f} of it")
    assert ours_ratio <= 0.25, f"the chunked function holds {ours_ratio:.3f} of an fp32 copy of the logits"
    assert old_ratio > 0.25, f"today's functions hold only {old_ratio:.3f}: this test could not tell them apart"


def test_a_chunk_of_no_rows_and_logits_that_do_not_match_the_tokens_are_refused():
    from glue.trainer.logprobs import token_logprobs_and_entropy

    logits, tokens = torch.zeros(2, 5, 8), torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_rows must be at least 1"):
        token_logprobs_and_entropy(logits, tokens, 1.0, with_entropy=True, chunk_rows=0)
    with pytest.raises(ValueError, match="do not match tokens"):
        token_logprobs_and_entropy(logits, tokens[:, :4], 1.0, with_entropy=True)
