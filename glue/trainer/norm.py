"""The trainer's RMSNorm. Without apex, megatron's local spec builds `torch.nn.RMSNorm`, which refuses
`--sequence-parallel` (required for MoE with TP and EP > 1) and, on CPU and wherever torch has no fused kernel, runs
as ~24 elementwise ops forward + backward. `RMSNorm` here takes sequence parallelism and, on the fast spec, runs
`rms_norm` below: the same arithmetic as `torch.nn.functional.rms_norm` (fp32 inside, one cast out) with a backward
of its own, 14 ops in all, that saves the input and the per-row scale only (no fp32 copy of the activations).
`reference=True` keeps torch's function: the unfused reference spec (`--attention-backend local`) is megatron's path
as it was.
"""
from __future__ import annotations

from typing import Any

import torch


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last dimension, computed in fp32, returned in x's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        return (x32 * scale * weight).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, scale = ctx.saved_tensors
        normed = x.float() * scale
        grad32 = grad.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad32 * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = grad32 * weight
            # d/dx of x * s(x) with s = rsqrt(mean(x^2) + eps): s * (g - normed * mean(g * normed))
            along = (grad_normed * normed).mean(-1, keepdim=True)
            grad_x = (torch.addcmul(grad_normed, normed, along, value=-1) * scale).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension by `weight`, with the hand-written backward above."""
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with a learnt scale named `weight` (the name the converter knows). Under
    sequence parallelism each TP rank normalises its own slice of the sequence, so the scale's gradient is partial:
    the `sequence_parallel` mark makes the trainer sum it over TP, as megatron does for its own norms."""

    reference = False  # True in `ReferenceRMSNorm`: torch's own function

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"sluice's local layer spec builds RMSNorm models only, got normalization="
                             f"{config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class ReferenceRMSNorm(RMSNorm):
    """`RMSNorm` on torch's `rms_norm` (the unfused reference spec)."""

    reference = True
