"""sluice's RMSNorm (glue.trainer.norm) and RoPE rotation (glue.trainer.rope): the same values and gradients as
torch's `rms_norm` and megatron's rotate-half, in fewer ops; and their torch.compile forms (trainer.compile) equal to
them."""
from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glue.trainer import norm, rope
from glue.trainer.norm import rms_norm
from glue.trainer.rope import rotate


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _norm_and_grads(fn, x, weight, grad, counted: bool = True):
    """fn's output and input gradients, and the aten ops it ran (not `counted`: 0, for compiled code, which a
    dispatch mode would turn off)."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    counter = OpCount()
    with counter if counted else contextlib.nullcontext():
        out = fn(x, weight)
        out.backward(grad)
    return out.detach(), x.grad, weight.grad, sum(counter.ops.values())


def _inputs(shape, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations, a norm weight and an output gradient of `shape`."""
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(*shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
    return x, weight, torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("shape", [(6, 3, 32), (5, 2, 4, 16)])
def test_rms_norm_equals_torch_in_fp32_with_gradients_in_fewer_ops(shape):
    x, weight, grad = _inputs(shape, 0)
    ours = _norm_and_grads(lambda a, w: rms_norm(a, w, 1e-6), x, weight, grad)
    torchs = _norm_and_grads(lambda a, w: torch.nn.functional.rms_norm(a, (shape[-1],), w, 1e-6), x, weight, grad)
    for mine, theirs in zip(ours[:3], torchs[:3]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert ours[3] < torchs[3], f"{ours[3]} ops vs torch's {torchs[3]}"


def test_rms_norm_in_bf16_is_torchs_forward_exactly_and_its_gradients_within_bf16():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    weight = torch.randn(48, generator=gen).to(torch.bfloat16)
    grad = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    ours = _norm_and_grads(lambda a, w: rms_norm(a, w, 1e-6), x, weight, grad)
    torchs = _norm_and_grads(lambda a, w: torch.nn.functional.rms_norm(a, (48,), w, 1e-6), x, weight, grad)
    assert ours[0].dtype == torch.bfloat16 and torch.equal(ours[0], torchs[0])
    torch.testing.assert_close(ours[1], torchs[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours[2].float(), torchs[2].float(), rtol=2e-2, atol=5e-2)


def _rotate_half_reference(t, freqs):
    first, second = t.chunk(2, dim=-1)
    return t * freqs.cos() + torch.cat((-second, first), dim=-1) * freqs.sin()


@pytest.mark.parametrize("packed", [False, True])
def test_rope_rotation_by_roll_equals_megatrons_rotate_half_with_gradients(packed):
    gen = torch.Generator().manual_seed(2)
    freqs = torch.rand(7, 1, 1, 16, generator=gen) * 50
    t = torch.randn(*((7, 3, 16) if packed else (7, 2, 3, 16)), generator=gen)
    grad = torch.randn(t.shape, generator=gen)
    outs = []
    for fn in (lambda a: rotate(a, freqs, packed=packed),
               lambda a: _rotate_half_reference(a[:, None] if packed else a, freqs)[:, 0] if packed
               else _rotate_half_reference(a, freqs)):
        a = t.clone().requires_grad_()
        out = fn(a)
        out.backward(grad)
        outs.append((out.detach(), a.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_partial_rotary_turns_the_first_dims_of_each_head_and_passes_the_rest(packed):
    """GLM-4.5's half-rotary heads through the rotation megatron's attention calls: on a packed row each token by
    its own angle row (megatron's per-sample THD path would restart the angle table at every sample)."""
    from types import SimpleNamespace

    from megatron.core.transformer import attention

    rope.install()
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    gen = torch.Generator().manual_seed(5)
    freqs = torch.rand(7, 1, 1, 8, generator=gen) * 50  # the first 8 dims of a 16-dim head turn
    t = torch.randn(*((7, 3, 16) if packed else (7, 2, 3, 16)), generator=gen)
    cu_seqlens = torch.tensor([0, 3, 7], dtype=torch.int32) if packed else None
    out = attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens)
    heads = t[:, None] if packed else t
    turned = _rotate_half_reference(heads[..., :8], freqs)
    expected = torch.cat((turned[:, 0] if packed else turned, t[..., 8:]), dim=-1)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(6, 3, 32), (5, 2, 4, 16)])
def test_the_compiled_rms_norm_equals_sluices_function_with_gradients(shape):
    x, weight, grad = _inputs(shape, 3)
    eager = _norm_and_grads(lambda a, w: rms_norm(a, w, 1e-6), x, weight, grad, counted=False)
    compiled = _norm_and_grads(lambda a, w: norm.compiled_rms_norm(a, w, 1e-6), x, weight, grad, counted=False)
    for mine, theirs in zip(compiled[:3], eager[:3]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_the_compiled_rope_rotation_equals_the_eager_one_with_gradients(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    freqs = torch.rand(9, 1, 1, 16, generator=gen) * 50
    t = torch.randn(9, 3, 16, generator=gen)
    grad = torch.randn(t.shape, generator=gen)
    outs = []
    for compiled in (False, True):
        monkeypatch.setattr(rope, "_compiled", compiled)
        a = t.clone().requires_grad_()
        out = rotate(a, freqs, packed=True)
        out.backward(grad)
        outs.append((out.detach(), a.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-6, atol=1e-6)


def test_the_norm_runs_torchs_function_where_torch_fuses_it_and_sluices_elsewhere(monkeypatch):
    config = type("Config", (), {"normalization": "RMSNorm", "params_dtype": torch.float32,
                                 "sequence_parallel": False})()
    fused = {"cpu": False, "cuda": True}
    monkeypatch.setattr(norm, "torch_fuses_rms_norm", lambda device_type: fused[device_type])
    assert norm.RMSNorm(config, 8).kernel("cpu") == "sluice"
    assert norm.RMSNorm(config, 8).kernel("cuda") == "torch_fused"  # one fused kernel each way beats 14 launches
    assert norm.CompiledRMSNorm(config, 8).kernel("cuda") == "compiled"
    assert norm.ReferenceRMSNorm(config, 8).kernel("cuda") == "reference"


def test_torchs_fused_norm_is_taken_only_with_the_arguments_sluice_passes():
    schema = torch.ops.aten._fused_rms_norm.default._schema
    assert [arg.name for arg in schema.arguments] == norm.FUSED_RMS_NORM_ARGS  # this torch's op, as called
    assert norm.torch_fuses_rms_norm("cpu") is False  # CPU builds decompose it: sluice's function runs there
