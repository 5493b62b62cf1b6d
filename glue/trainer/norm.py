"""The trainer's RMSNorm. Without apex, megatron's local spec builds `torch.nn.RMSNorm`, which refuses
`--sequence-parallel` (required for MoE with TP and EP > 1) and, on CPU and wherever torch has no fused kernel, runs
as ~24 elementwise ops forward + backward. `RMSNorm` here takes sequence parallelism and, on the fast spec, runs
`rms_norm` below: the same arithmetic as `torch.nn.functional.rms_norm` (fp32 inside, one cast out) with a backward
of its own, 14 ops in all, that saves the input and the per-row scale only (no fp32 copy of the activations).
Which function a norm runs (`RMSNorm.kernel`): torch's own on the unfused reference spec (`--attention-backend
local`: megatron's path as it was) and on devices where torch has a fused RMSNorm kernel (CUDA: one kernel each way);
with `trainer.compile`, the plain arithmetic compiled by torch.compile (inductor fuses forward and backward into a
kernel or two each); else the hand-written function.
"""
from __future__ import annotations

import functools
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


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same arithmetic in plain ops, for torch.compile to differentiate and fuse (`trainer.compile`)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def compile_elementwise(fn: Any) -> Any:
    """`fn` (plain tensor arithmetic) under torch.compile (trainer.compile), one whole graph. Dynamo keeps one graph
    per width, layout, dtype, grad mode and requires_grad (the policy's and the frozen reference's norms, the hidden
    and the per-head ones): more than its default 8 per function, so the limit is raised."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, fullgraph=True)


@functools.cache
def _compiled_plain_rms_norm() -> Any:
    return compile_elementwise(plain_rms_norm)


def compiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`plain_rms_norm` under torch.compile, the sequence dimension (x's first) dynamic: a packed row's length
    changes every micro-batch."""
    torch._dynamo.maybe_mark_dynamic(x, 0)
    return _compiled_plain_rms_norm()(x, weight, eps)


FUSED_RMS_NORM_ARGS = ["input", "normalized_shape", "weight", "eps"]  # the private op's schema this module calls


@functools.cache
def torch_fuses_rms_norm(device_type: str) -> bool:
    """True when torch has a fused RMSNorm kernel for this device type (`aten::_fused_rms_norm`: CUDA builds) with
    the arguments `RMSNorm` passes it; on CPU the op decomposes into elementwise ops."""
    try:
        schema = torch.ops.aten._fused_rms_norm.default._schema
        fused = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", device_type.upper())
    except (AttributeError, RuntimeError):  # a torch without the op
        return False
    return fused and [arg.name for arg in schema.arguments] == FUSED_RMS_NORM_ARGS


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with a learnt scale named `weight` (the name the converter knows). Under
    sequence parallelism each TP rank normalises its own slice of the sequence, so the scale's gradient is partial:
    the `sequence_parallel` mark makes the trainer sum it over TP, as megatron does for its own norms."""

    reference = False  # True in `ReferenceRMSNorm`: torch's own function
    compiled = False  # True in `CompiledRMSNorm` (trainer.compile)

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"sluice's local layer spec builds RMSNorm models only, got normalization="
                             f"{config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel(x.device.type)
        if kernel == "reference":
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if kernel == "torch_fused":  # called by name: rms_norm itself may still decompose
            return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], self.weight, self.eps)[0]
        if kernel == "compiled":
            return compiled_rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def kernel(self, device_type: str) -> str:
        """reference (torch's rms_norm, the unfused spec), compiled (trainer.compile), torch_fused (torch's fused
        kernel, on a device that has one) or sluice (the hand-written function)."""
        if self.reference:
            return "reference"
        if self.compiled:
            return "compiled"
        return "torch_fused" if torch_fuses_rms_norm(device_type) else "sluice"


class ReferenceRMSNorm(RMSNorm):
    """`RMSNorm` on torch's `rms_norm` (the unfused reference spec)."""

    reference = True


class CompiledRMSNorm(RMSNorm):
    """`RMSNorm` on `plain_rms_norm` under torch.compile (trainer.compile)."""

    compiled = True
