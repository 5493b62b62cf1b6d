"""sluice's core attention (glue.trainer.attention) against megatron's unfused DotProductAttention on the same
inputs, and packed rows reaching megatron as THD: no [T, T] tensor in a packed step, RoPE per token without
megatron's per-sample split. Each scenario runs in a spawned process (megatron's global state stays out of pytest's).
"""
from __future__ import annotations

import os
import socket

import pytest
import torch

from loss import LossConfig
from helpers.packing import LOSS, spread_batch
from helpers.trainer_process import run_in_trainer_process

HEADS, GROUPS, HEAD_DIM = 4, 2, 16
SPANS = [5, 9, 3, 7]  # one packed row of four samples


def _init_world_of_one() -> None:
    from megatron.core import parallel_state, tensor_parallel

    from glue.trainer import cpu_compat

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    cpu_compat.apply()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def _pair_scenario(dtype: torch.dtype) -> dict:
    """Outputs and input gradients of megatron's DotProductAttention and SluiceCoreAttention for padded rows (a
    causal mask vs none) and one packed row (a block-diagonal mask vs THD cu_seqlens)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from glue.trainer.attention import SluiceCoreAttention
    from glue.trainer.model import causal_attention_mask

    _init_world_of_one()
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0,
                               bf16=dtype == torch.bfloat16, params_dtype=dtype, attention_softmax_in_fp32=True)
    reference = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    ours = SluiceCoreAttention(config, 1, AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(0)
    total = sum(SPANS)

    def inputs(batch: int) -> list[torch.Tensor]:
        return [torch.randn(total, batch, n, HEAD_DIM, generator=gen).to(dtype).requires_grad_()
                for n in (HEADS, GROUPS, GROUPS)]

    def run(module, qkv, *args, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = module(*args, **kwargs)
        out.float().pow(2).sum().backward()
        grads = [x.grad.float().clone() for x in qkv]
        for x in qkv:
            x.grad = None
        return out.detach().float().reshape(total, -1, HEADS * HEAD_DIM), grads

    padded = inputs(3)
    results = {"padded": (run(reference, padded, *padded, causal_attention_mask(total)),
                          run(ours, padded, *padded, None))}
    packed = inputs(1)
    ids = torch.repeat_interleave(torch.arange(len(SPANS)), torch.tensor(SPANS))[None]
    cu = torch.tensor([0, *torch.tensor(SPANS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(SPANS),
                             max_seqlen_kv=max(SPANS))
    results["packed"] = (run(reference, packed, *packed, causal_attention_mask(total, seq_ids=ids)),
                         run(ours, packed, *(x.squeeze(1) for x in packed), None, packed_seq_params=params))
    return results


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_sluices_core_attention_equals_megatrons_unfused_attention_forward_and_backward(dtype, tolerance):
    results = run_in_trainer_process(_pair_scenario, dtype)
    for layout in ("padded", "packed"):
        (ref_out, ref_grads), (out, grads) = results[layout]
        scale = ref_out.abs().max().item()
        assert (out - ref_out).abs().max().item() <= tolerance * max(1.0, scale), layout
        for name, ref, got in zip("qkv", ref_grads, grads):
            gap = (got - ref).abs().max().item()
            assert gap <= tolerance * max(1.0, ref.abs().max().item()), f"{layout} d{name} differs by {gap}"
            assert ref.abs().max().item() > 1e-3, "the check needs gradients that are not zero"


def _flex_scenario() -> float:
    """The largest gap between the compiled flex_attention THD path (the CUDA fallback for a torch without
    varlen_attn) and the samples-as-batch SDPA path on one packed row, forward only: flex has no CPU backward."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from glue.trainer.attention import SluiceCoreAttention, _batch_layout

    _init_world_of_one()
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0)
    ours = SluiceCoreAttention(config, 1, AttnMaskType.causal, "self")
    spans = [37, 63, 1, 69, 30]  # over one 128-token flex block and across block edges; a one-token sample
    cu_seqlens = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(spans), n, HEAD_DIM, generator=gen) for n in (HEADS, GROUPS, GROUPS))
    with torch.no_grad():
        flex = ours._thd_flex(q, k, v, cu_seqlens)
        batch = ours._thd_as_batch(q, k, v, _batch_layout(cu_seqlens))
    return (flex - batch).abs().max().item()


def test_the_flex_attention_fallback_equals_the_sdpa_path_on_a_packed_row():
    assert run_in_trainer_process(_flex_scenario) < 1e-5


def _model_scenario(model_dir: str, backend: str, compiled: bool = False) -> dict:
    """Logprobs and one packed train step's loss and gradient norm with `--attention-backend` `backend` (and
    trainer.compile `compiled`), with the norm class and megatron's SwiGLU fusion the model was built with."""
    from glue.trainer import rope
    from glue.trainer.attention import attention_kernel
    from glue.trainer.model import unwrap
    from helpers.trainer_process import start_worker, stop_worker

    worker = start_worker(model_dir, LossConfig(**LOSS), max_tokens_per_micro_batch=64,
                          megatron={"attention_backend": backend}, compile=compiled)
    batch = spread_batch()
    kernel = attention_kernel(worker.model, packed=True)
    layer = unwrap(worker.model).decoder.layers[0]
    built = dict(norm=type(layer.input_layernorm).__name__, rope_compiled=rope._compiled,
                 swiglu_fused=layer.mlp.config.bias_activation_fusion)
    before = worker.compute_logprobs(batch)
    metrics = worker.train_step(batch)
    stop_worker(worker)
    return dict(before=before, loss=metrics["train/loss"], grad_norm=metrics["train/grad_norm"], kernel=kernel,
                **built)


def test_a_packed_model_step_with_the_fused_kernel_equals_the_unfused_reference(tiny_model_dir):
    fast = run_in_trainer_process(_model_scenario, tiny_model_dir, "auto")
    reference = run_in_trainer_process(_model_scenario, tiny_model_dir, "local")
    assert fast["kernel"] == "sdpa_samples_as_batch" and reference["kernel"].startswith("megatron DotProductAttention")
    assert (fast["before"] - reference["before"]).abs().max().item() < 1e-5
    assert abs(fast["loss"] - reference["loss"]) < 1e-5
    assert abs(fast["grad_norm"] - reference["grad_norm"]) < 1e-5 * max(1.0, reference["grad_norm"])


def test_a_packed_step_with_trainer_compile_equals_the_eager_one(tmp_path):
    from glue.embedded_engine.tiny_model import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "qwen3"), family="qwen3", seed=3)  # q/k norms: four norms a layer
    eager = run_in_trainer_process(_model_scenario, model_dir, "auto", False)
    compiled = run_in_trainer_process(_model_scenario, model_dir, "auto", True)
    assert (eager["norm"], eager["rope_compiled"], eager["swiglu_fused"]) == ("RMSNorm", False, False)
    assert (compiled["norm"], compiled["rope_compiled"], compiled["swiglu_fused"]) == ("CompiledRMSNorm", True, True)
    assert (compiled["before"] - eager["before"]).abs().max().item() < 1e-5
    assert abs(compiled["loss"] - eager["loss"]) < 1e-5
    assert abs(compiled["grad_norm"] - eager["grad_norm"]) < 1e-5 * max(1.0, eager["grad_norm"])


def _census_scenario(model_dir: str, row_tokens: int) -> dict:
    """The largest tensor (in elements) any aten op allocates in a packed forward + backward of one row of
    `row_tokens` tokens, and whether megatron's per-sample THD RoPE ran."""
    from megatron.core.models.common.embeddings import rope_utils

    from glue.trainer.attention import SluiceCoreAttention
    from helpers.trainer_process import start_worker, stop_worker
    from tensor_census import TensorCensus

    worker = start_worker(model_dir, LossConfig(**LOSS), max_tokens_per_micro_batch=row_tokens)
    calls = {"thd_rope": 0, "thd_attention": 0}
    split_rope = rope_utils._apply_rotary_pos_emb_thd

    def counting(*args, **kwargs):
        calls["thd_rope"] += 1
        return split_rope(*args, **kwargs)

    thd = SluiceCoreAttention._thd

    def counting_thd(self, *args):
        calls["thd_attention"] += 1
        return thd(self, *args)

    rope_utils._apply_rotary_pos_emb_thd, SluiceCoreAttention._thd = counting, counting_thd
    batch = spread_batch([row_tokens // 4 - 3] * 4)  # four samples filling one row
    census = TensorCensus()
    with census:
        worker.train_step(batch)
    rope_utils._apply_rotary_pos_emb_thd, SluiceCoreAttention._thd = split_rope, thd
    stop_worker(worker)
    return dict(largest_elements=census.largest_elements, **calls)


def test_a_packed_step_allocates_no_tensor_of_t_squared_elements_and_never_splits_rope_per_sample(tmp_path):
    from glue.embedded_engine.tiny_model import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "qwen3"), family="qwen3", seed=2)
    row = 512  # longer than the model's widest activation (fc1: 2 x 128), so only attention could reach T^2
    out = run_in_trainer_process(_census_scenario, model_dir, row)
    assert out["thd_attention"] > 0, "the packed step must reach the core attention as THD"
    assert out["thd_rope"] == 0, "megatron's per-sample THD RoPE (a host read per sample) ran"
    assert 0 < out["largest_elements"] < row * row, f"a tensor of {out['largest_elements']} elements >= T^2"


def test_a_packed_row_on_cuda_runs_varlen_then_flex_then_sdpa_by_what_torch_has(monkeypatch):
    from types import SimpleNamespace

    from glue.trainer import attention

    bf16_cuda = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    monkeypatch.setattr(attention, "_varlen_kwargs", lambda: {"is_causal": True})
    monkeypatch.setattr(attention, "_has_flex_attention", lambda: True)
    assert attention.thd_kernel(bf16_cuda) == "varlen_attn"
    assert attention.thd_kernel(SimpleNamespace(is_cuda=True, dtype=torch.float32)) == "flex_attention"
    assert attention.thd_kernel(SimpleNamespace(is_cuda=False, dtype=torch.bfloat16)) == "sdpa_samples_as_batch"
    monkeypatch.setattr(attention, "_varlen_kwargs", lambda: None)
    assert attention.thd_kernel(bf16_cuda) == "flex_attention"
    monkeypatch.setattr(attention, "_has_flex_attention", lambda: False)
    assert attention.thd_kernel(bf16_cuda) == "sdpa_samples_as_batch"
