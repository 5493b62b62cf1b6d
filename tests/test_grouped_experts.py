"""glue.trainer.grouped_experts: sluice's grouped experts give megatron's SequentialMLP's outputs and gradients on
the same weights, inside megatron's real MoE layer (router and allgather token dispatcher) on gloo: at EP = 1, at
EP = 2 across two ranks, and with expert TP = 2; for a SwiGLU family (qwen3_moe) and gpt-oss's biased, clamped
quick-GELU experts; fp32 within 1e-5, bf16 within bf16 rounding. Both module kinds hold the same state dict and
distributed-checkpoint shards, and the stacked weight gradient lands in megatron DDP's evenly spaced buffers."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from helpers.forkserver import rank_context
from helpers.trainer import _free_port, join_gloo, results_of_ranks

from glue.trainer.grouped_experts import (GROUPED_MM, PADDED_BMM, ExpertGroups, _StackedExperts, evenly_spaced,
                                          experts_kernel)

FAMILIES = ("qwen3_moe", "gpt_oss")
# (TP, EP, expert TP) on two ranks (sequence parallel where TP = 2); biased experts (gpt-oss) only at expert TP 1
LAYOUTS = ((1, 1, 1), (1, 2, 1), (2, 1, 2), (2, 1, 1))
CASES = [(family, layout) for layout in LAYOUTS for family in FAMILIES
         if not (family == "gpt_oss" and layout[2] > 1)]


def _moe_layer(family: str, layout: tuple[int, int, int], grouped: bool, dtype: torch.dtype):
    """megatron's MoE layer of the trainer's local spec for a tiny `family` model (8 experts, top 2)."""
    from megatron.core.transformer.spec_utils import build_module

    from glue.embedded_engine.tiny_model import tiny_config
    from glue.trainer.layer_spec import layer_spec
    from glue.trainer.model import transformer_config

    tp, ep, etp = layout
    hf = tiny_config(family=family, vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2,
                     intermediate_size=32, num_experts=8, moe_top_k=2)
    config = dataclasses.replace(transformer_config(hf, tp_size=tp), expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, moe_grouped_gemm=grouped, params_dtype=dtype,
                                 moe_token_dispatcher_type="allgather", sequence_parallel=tp > 1)
    spec = layer_spec(config, "local")
    mlp = next(s.submodules.mlp for s in spec.layer_specs if "MoE" in s.submodules.mlp.module.__name__)
    return build_module(mlp, config=config, layer_number=1).to(dtype)


def _run(layer, hidden: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """Output, input gradient and every parameter's gradient of one forward + backward."""
    x = hidden.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None, "routed experts add their own biases"
    out.backward(grad_out)
    return {"out": out.detach(), "input_grad": x.grad,
            **{f"grad/{name}": p.grad for name, p in layer.named_parameters() if p.grad is not None}}


def _shards(experts) -> list[tuple]:
    """(key, global shape, global offset, replica id) of every distributed-checkpoint shard the experts hold."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    state = experts.sharded_state_dict("e.")
    apply_factories(state)  # the gated fc1's factory: its gate and up halves
    return sorted((t.key, t.global_shape, t.global_offset, t.replica_id) for t in nested_values(state))


def _case(family: str, layout: tuple[int, int, int], dtype: torch.dtype, rank: int) -> dict:
    torch.manual_seed(1)
    sequential = _moe_layer(family, layout, grouped=False, dtype=dtype)
    grouped = _moe_layer(family, layout, grouped=True, dtype=dtype)
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():  # weights of order one (megatron's init, std 0.02, gives outputs of order 1e-4)
        for p in sequential.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    grouped.load_state_dict(sequential.state_dict())  # strict: the same names
    hidden = torch.randn(12, 2, 64, generator=gen).to(dtype)
    grad_out = torch.randn(12, 2, 64, generator=gen).to(dtype)
    shards = {layer: _shards(m.experts) for layer, m in (("sequential", sequential), ("grouped", grouped))}
    return {"sequential": _run(sequential, hidden, grad_out), "grouped": _run(grouped, hidden, grad_out),
            "kinds": (type(sequential.experts).__name__, type(grouped.experts).__name__),
            "kernel": grouped.experts.kernel(dtype, "cpu"), "shards": shards,
            "keys": (sorted(sequential.state_dict()), sorted(grouped.state_dict()))}


def _rank_main(rank: int, port: int, results) -> None:
    from megatron.core import parallel_state

    join_gloo(rank, port)
    out = {}
    for tp, ep, etp in LAYOUTS:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp)
        for family in [f for f, layout in CASES if layout == (tp, ep, etp)]:
            for dtype in (torch.float32, torch.bfloat16):
                out[(family, (tp, ep, etp), dtype)] = _case(family, (tp, ep, etp), dtype, rank)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    results.put(pickle.dumps((rank, out)))


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Both ranks' cases, from one pair of forked gloo ranks."""
    ctx = rank_context()
    results = ctx.Queue()
    port = _free_port()
    outs = results_of_ranks([ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)], results)
    return [outs[0][0], outs[1][0]]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-tp{t}-ep{e}-etp{x}" for f, (t, e, x) in CASES])
def test_grouped_experts_give_sequential_outputs_and_gradients_within_1e_5_in_fp32(ranks, family, layout):
    for rank in ranks:
        case = rank[(family, layout, torch.float32)]
        assert case["kinds"] == ("SequentialMLP", "GroupedExperts")
        assert case["kernel"] == GROUPED_MM  # widths 64 and 32: 16-byte rows, fp32 runs on CPU
        seq, grouped = case["sequential"], case["grouped"]
        assert seq.keys() == grouped.keys() and any(".local_experts.3.linear_fc2.weight" in k for k in seq)
        assert seq["out"].abs().max() > 0.5
        for name in seq:
            assert _gap(grouped[name], seq[name]) <= 1e-5, f"{name}: off by {_gap(grouped[name], seq[name]):.3g}"


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-tp{t}-ep{e}-etp{x}" for f, (t, e, x) in CASES])
def test_grouped_experts_in_bf16_give_sequential_results_up_to_bf16_rounding(ranks, family, layout):
    for rank in ranks:
        case = rank[(family, layout, torch.bfloat16)]
        seq, grouped = case["sequential"], case["grouped"]
        for name in seq:
            scale = seq[name].float().abs().max().item()
            # a few bf16 roundings of sums of a handful of products (eps 2^-8)
            assert _gap(grouped[name], seq[name]) <= 2 ** -6 * max(scale, 1e-3), name


def test_both_expert_kinds_hold_the_same_state_dict_and_checkpoint_shards_at_ep2(ranks):
    for r, rank in enumerate(ranks):
        case = rank[("qwen3_moe", (1, 2, 1), torch.float32)]
        assert case["keys"][0] == case["keys"][1]
        assert case["shards"]["sequential"] == case["shards"]["grouped"]
        first_experts = {offset[0] for key, shape, offset, replica in case["shards"]["grouped"]}
        assert first_experts == {4 * r + i for i in range(4)}, "rank r holds global experts 4r .. 4r + 3"


def test_the_padded_product_gives_the_grouped_products_result_with_an_expert_of_no_tokens():
    torch.manual_seed(0)
    x, weight = torch.randn(10, 16), torch.randn(4, 8, 16)
    groups = ExpertGroups(torch.tensor([3, 0, 5, 2]), 10, x.device)
    expected = torch.cat([x[:3] @ weight[0].T, x[3:8] @ weight[2].T, x[8:] @ weight[3].T])
    assert _gap(groups.product(x, weight, PADDED_BMM), expected) <= 1e-6
    assert _gap(groups.product(x, weight, GROUPED_MM), expected) <= 1e-6
    assert groups.expert_of_row.tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 3]
    none = ExpertGroups(torch.zeros(4, dtype=torch.int64), 0, x.device)  # an EP rank no token was routed to
    for kernel in (GROUPED_MM, PADDED_BMM):
        assert none.product(x[:0], weight, kernel).shape == (0, 8)


def test_unaligned_widths_take_the_padded_product():
    assert experts_kernel("cpu", torch.float32, (64, 32)) == GROUPED_MM
    assert experts_kernel("cpu", torch.float32, (64, 6)) == PADDED_BMM  # 24-byte rows break _grouped_mm's rule
    assert experts_kernel("cpu", torch.bfloat16, (64, 12)) == PADDED_BMM


def test_the_stacked_gradient_lands_in_megatrons_reversed_evenly_spaced_buffers_in_one_add():
    """megatron DDP lays a bucket's parameters out in reverse order (expert 3's fc2, fc1, ..., expert 0's fc1), each
    weight's `main_grad` a view of one buffer; the gradient goes there and DDP's hook is told it was added."""
    weights = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(4)]
    buffer = torch.zeros(4 * (24 + 10))
    for i, w in enumerate(weights):  # 24 elements of weight i after 10 of another parameter, in reverse order
        start = (3 - i) * 34 + 10
        w.main_grad, w.grad_added_to_main_grad = buffer[start:start + 24].view(6, 4), False
    run = evenly_spaced([w.main_grad for w in weights])
    assert run is not None and run[1], "evenly spaced, descending"
    grad = torch.randn(4, 6, 4)
    for _ in range(2):  # two micro-batches accumulate
        _StackedExperts.apply(*weights).backward(grad.clone())
    for i, w in enumerate(weights):
        assert torch.equal(w.main_grad, 2 * grad[i]) and w.grad_added_to_main_grad
    assert buffer[:10].abs().sum() == 0, "the other parameter's gradient is untouched"
    apart = [torch.zeros(6, 4), torch.zeros(6, 4)]
    assert evenly_spaced(apart) is None  # two storages: one add each


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    from glue.embedded_engine.tiny_model import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("moe")), family="qwen3_moe", seed=3)


def test_a_train_step_with_grouped_experts_is_the_sequential_step_through_megatron_ddp(moe_model):
    """The trainer's real step (megatron DDP's gradient buffers, the distributed optimizer): the same loss, gradient
    norm, logprobs and updated weights, the stacked gradients having gone into DDP's buffers directly."""
    from helpers.trainer import ADAM, assert_same_step, make_batch, run_trainer_ranks

    batch = make_batch()
    sequential = run_trainer_ranks(moe_model, 1, batch, **ADAM)
    grouped = run_trainer_ranks(moe_model, 1, batch, **ADAM, megatron={"moe_grouped_gemm": True})
    assert_same_step(sequential, grouped, "grouped experts")


@pytest.mark.long  # two pairs of trainer ranks; the step at EP = 1 above and the layer at EP = 2 stay in CI
def test_grouped_experts_over_two_expert_parallel_ranks_train_like_sequential_ones_on_one(moe_model):
    from helpers.trainer import ADAM, assert_same_step, make_batch, run_trainer_ranks

    batch = make_batch()
    one = run_trainer_ranks(moe_model, 1, batch, **ADAM)
    two = run_trainer_ranks(moe_model, 1, batch, **ADAM, data_parallel_size=2, expert_model_parallel_size=2,
                            megatron={"moe_grouped_gemm": True})
    assert_same_step(one, two, "grouped experts, EP=2 x DP=2")
