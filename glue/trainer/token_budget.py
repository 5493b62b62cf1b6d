"""`trainer.max_tokens_per_micro_batch: auto`: on CUDA, packed rows as wide as the device memory left after the model
and optimizer holds (so each forward is large enough to keep the GPU busy, not 1-2 k tokens); on CPU, padded rows
as before. Every rank plans micro-batches alone, so the ranks agree on the smallest budget any of them can hold.
"""
from __future__ import annotations

from typing import Any

import torch

ACTIVATION_SHARE = 0.5  # of the free device memory one micro-batch's activations may take (the rest: allocator slack, logprob chunks, NCCL)
SMALLEST, LARGEST, STEP = 16, 65536, 256  # the budget's bounds and rounding (to SMALLEST under STEP), in tokens


def activation_bytes_per_token(config: Any, vocab_size: int, num_layers: int) -> int:
    """Bytes one token's activations hold for backward on this rank, bf16, no recompute, flash attention (no score
    tensor): per layer about 10 hidden-wide and 5 FFN-wide tensors of 2 bytes (norm and projection inputs, q/k/v,
    attention output, the gated MLP's inputs and outputs), split over TP; plus the logits and their gradient (2 + 2
    bytes per vocab entry of this rank's shard). An estimate: `make gpu-bench` shows what a budget really peaks at."""
    tp = config.tensor_model_parallel_size
    ffn = config.ffn_hidden_size
    if config.num_moe_experts:
        ffn = config.moe_ffn_hidden_size * config.moe_router_topk
    per_layer = 2 * (10 * config.hidden_size + 5 * ffn) // tp
    return num_layers * per_layer + 4 * vocab_size // tp


def budget_from_memory(free_bytes: int, bytes_per_token: int) -> int:
    """The token budget `free_bytes` holds at ACTIVATION_SHARE, rounded down to STEP (to SMALLEST under STEP), within
    [SMALLEST, LARGEST]. A big model on a full GPU may get a few hundred tokens: a sample longer than the budget still
    gets a row of its own, so whether the longest sample fits at all is launch.plan.memory_lines' check at start."""
    tokens = int(free_bytes * ACTIVATION_SHARE) // max(bytes_per_token, 1)
    step = STEP if tokens >= STEP else SMALLEST
    return max(SMALLEST, min(LARGEST, tokens // step * step))


def resolve_token_budget(setting: int | str | None, model: torch.nn.Module, vocab_size: int,
                         device: torch.device) -> int | None:
    """trainer.max_tokens_per_micro_batch as this run uses it: an integer stays, 0 / null mean padded rows (None),
    auto is sized from CUDA memory after the model and optimizer are built (all ranks take the smallest) and means
    padded rows on CPU."""
    if setting != "auto":
        return setting or None
    if device.type != "cuda":
        return None
    config = model.config
    layers = len(model.decoder.layers) if getattr(model, "decoder", None) is not None else 0
    free_bytes, _ = torch.cuda.mem_get_info(device)
    budget = torch.tensor([budget_from_memory(free_bytes, activation_bytes_per_token(config, vocab_size, layers))],
                          device=device)
    torch.distributed.all_reduce(budget, op=torch.distributed.ReduceOp.MIN)
    return int(budget.item())
