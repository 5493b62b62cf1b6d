"""Routed experts as one grouped matrix product for gate/up and one for down per MoE layer, over the tokens
megatron's token dispatcher has already permuted by expert: megatron's experts interface, built by the local layer
spec for `--moe-grouped-gemm` (where Transformer Engine's grouped experts are not built).

The experts keep SequentialMLP's parameters (one MLP per local expert: the same names, state dict and distributed
checkpoint shards, so the converter, checkpoints and weight sync see no difference). Each forward stacks them into
[experts, out, in] (one copy per projection); the backward writes the stacked weight gradient into megatron DDP's
gradient buffer in one add where the experts' buffers are evenly spaced in it (megatron lays them out so), so the
launches per layer do not grow with the number of experts.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

GROUPED_MM = "torch._grouped_mm"
PADDED_BMM = "padded bmm"


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """True when torch's grouped matrix product runs forward and backward for this device type and dtype (CPU: fp32
    and bf16 in torch 2.13; CUDA: bf16 on Hopper and newer). Probed once on a tiny product; a torch without it, or a
    kernel missing for the dtype or device, is the answer False (the padded product serves)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    x = torch.ones(4, 16, device=device_type, dtype=dtype, requires_grad=True)
    w = torch.ones(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
    offs = torch.tensor([1, 4], device=device_type, dtype=torch.int32)
    try:
        torch._grouped_mm(x, w, offs=offs).backward(torch.ones(4, 16, device=device_type, dtype=dtype))
    except (RuntimeError, NotImplementedError):  # no kernel for this dtype / device / GPU generation
        return False
    return True


def experts_kernel(device_type: str, dtype: torch.dtype, widths: tuple[int, ...] = (16,)) -> str:
    """The grouped product the experts run for this device, dtype and the projections' `widths` (hidden and expert
    FFN sizes): torch._grouped_mm where it runs and every row is 16-byte aligned (its stride rule), else a batched
    product over the experts padded to the largest expert's token count."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    aligned = all(width * itemsize % 16 == 0 for width in widths)
    return GROUPED_MM if aligned and grouped_mm_runs(device_type, dtype) else PADDED_BMM


class _StackedExperts(torch.autograd.Function):
    """The experts' tensors stacked as [experts, ...]. Backward: where every one of them has megatron DDP's
    `main_grad`, the stacked gradient is added there (one add where the buffers are evenly spaced) and marked added,
    as megatron's fused-accumulation linears do, so DDP's hook adds nothing more; else ordinary gradients."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.tensors = tensors
        return torch.stack(tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensors = ctx.tensors
        if all(hasattr(t, "main_grad") for t in tensors):
            add_into_main_grads([t.main_grad for t in tensors], grad)
            for t in tensors:
                t.grad_added_to_main_grad = True
        return grad.unbind(0)


def add_into_main_grads(main_grads: list[torch.Tensor], grad: torch.Tensor) -> None:
    """main_grads[i] += grad[i] (grad [experts, ...]): one add through a strided view where the buffers lie evenly
    spaced in one storage (either way round), one per expert otherwise."""
    run = evenly_spaced(main_grads)
    if run is None:
        for main_grad, part in zip(main_grads, grad.unbind(0)):
            main_grad.add_(part)
        return
    view, descending = run
    view.add_(grad.flip(0) if descending else grad)


def evenly_spaced(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool] | None:
    """([n, ...] view of one storage whose i-th entry is the i-th tensor, or the (n-1-i)-th when `descending`) where
    the tensors are contiguous, alike in shape and dtype, and evenly spaced in that storage; else None."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype
               and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in tensors):
        return None
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else first.numel()
    if abs(step) < first.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    base = min(offsets)
    view = first.as_strided((len(tensors), *first.shape), (abs(step), *first.stride()), base)
    return view, step < 0


class ExpertGroups:
    """Where each expert's tokens lie in the permuted rows: cumulative ends for torch._grouped_mm, and for the
    padded product each row's slot in an [experts x widest] layout (built on first use, one host read)."""

    def __init__(self, tokens_per_expert: torch.Tensor, rows: int, device: torch.device):
        self.counts = tokens_per_expert.to(device=device, dtype=torch.int64)
        self.ends = self.counts.cumsum(0).to(torch.int32)
        self.rows = rows
        self.expert_of_row = torch.repeat_interleave(torch.arange(len(self.counts), device=device), self.counts,
                                                     output_size=rows)

    @functools.cached_property
    def padded(self) -> tuple[int, torch.Tensor]:
        """(widest expert's token count, each row's index in the flattened [experts, widest] layout)."""
        width = int(self.counts.max()) if len(self.counts) else 0
        starts = self.ends.to(torch.int64) - self.counts
        slot = torch.arange(self.rows, device=self.counts.device) - starts[self.expert_of_row]
        return width, self.expert_of_row * width + slot

    def product(self, x: torch.Tensor, weight: torch.Tensor, kernel: str) -> torch.Tensor:
        """Each row of x [rows, in] times its expert's weight^T (weight [experts, out, in]) -> [rows, out]."""
        if kernel == GROUPED_MM:
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=self.ends)
        width, index = self.padded
        experts, out_width, in_width = weight.shape
        padded = x.new_zeros(experts * width, in_width).index_copy(0, index, x)
        out = torch.bmm(padded.view(experts, width, in_width), weight.transpose(1, 2))
        return out.view(experts * width, out_width).index_select(0, index)


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts (same parameters, state dict, sharded state dict) run as two grouped products per
    forward. FP8 / FP4 padding stays SequentialMLP's loop."""

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        config = self.config
        if config.fp8 or config.fp4:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = permuted_local_hidden_states, permuted_probs
        if config.moe_apply_probs_on_input:  # as SequentialMLP: top-1 only, probs applied once, on the input
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        groups = ExpertGroups(tokens_per_expert, x.shape[0], x.device)
        fc1 = [expert.linear_fc1 for expert in self.local_experts]
        fc2 = [expert.linear_fc2 for expert in self.local_experts]
        kernel = self.kernel(x.dtype, x.device.type)
        hidden = groups.product(x.contiguous(), _StackedExperts.apply(*[m.weight for m in fc1]), kernel)
        if fc1[0].bias is not None:
            hidden = hidden + _StackedExperts.apply(*[m.bias for m in fc1])[groups.expert_of_row]
        hidden = self._activation(hidden, probs)
        out = groups.product(hidden, _StackedExperts.apply(*[m.weight for m in fc2]), kernel)
        if fc2[0].bias is not None:  # as megatron's expert MLP: the bias weighted by the token's probability
            bias = _StackedExperts.apply(*[m.bias for m in fc2])[groups.expert_of_row]
            out = (out + bias * probs.unsqueeze(-1)).to(out.dtype)
        return out, None

    def kernel(self, dtype: torch.dtype, device_type: str) -> str:
        """The grouped product this module runs for inputs of `dtype` on `device_type`."""
        weight = self.local_experts[0].linear_fc2.weight  # [hidden, expert FFN / ETP]
        return experts_kernel(device_type, dtype, tuple(weight.shape))

    def _activation(self, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """megatron's expert MLP activation on every row at once (it is row-wise): the gated unit (clamped where
        the config clamps, gpt-oss), then each row weighted by its token's probability; its fused functions where
        `bias_activation_fusion` (trainer.compile)."""
        config = self.config
        if config.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            scale = probs.unsqueeze(-1)
            if config.activation_func is torch.nn.functional.silu and config.gated_linear_unit:
                return weighted_bias_swiglu_impl(hidden, None, scale, config.activation_func_fp8_input_store)
            if config.activation_func is quick_gelu and config.gated_linear_unit:
                return weighted_bias_quick_geglu_impl(hidden, None, scale, config.activation_func_fp8_input_store,
                                                      config.glu_linear_offset, config.activation_func_clamp_value)
            raise ValueError("grouped experts fuse only swiglu and quick_gelu with bias_activation_fusion")
        if config.gated_linear_unit:
            gate, linear = torch.chunk(hidden, 2, dim=-1)
            clamp = config.activation_func_clamp_value
            if clamp is not None:
                gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
            hidden = config.activation_func(gate) * (linear + config.glu_linear_offset)
        else:
            hidden = config.activation_func(hidden)
        return (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
