"""Attention sinks and sliding windows (gpt-oss) for sluice's core attention (glue.trainer.attention): a learnable
logit per query head that joins every query's softmax and carries no value, and a window of `window + 1` keys
(the query's own and the `window` before it) on the layers megatron's `window_size` / `window_attn_skip_freq` mark.

Both run on SDPA under an explicit mask, never megatron's fused softmax (which swaps a packed row's block mask for
the window mask, so samples leak into each other). The sink rides as one extra key in front: each query gets `g`
extra dims holding a one-hot of its place in its query group (g query heads share a key head), the sink key holds
its group's g sink logits / scale there and zeros elsewhere, every real key zeros there, and its value is zero; so
query . sink key x scale is the query head's own sink logit, and the softmax's denominator gets exp(sink)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def window_of(config: Any, layer_number: int) -> int | None:
    """The keys before its own a query sees in this layer (megatron's left window), or None for full attention."""
    from megatron.core.transformer.utils import is_layer_window_attention

    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    return int(config.window_size[0])


def learnable_sinks(config: Any, num_heads: int) -> torch.nn.Parameter | None:
    """This TP rank's sink logits (megatron's `softmax_offset`, split over TP with the heads) for softmax_type
    learnable, else None."""
    if config.softmax_type != "learnable":
        return None
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    sinks = torch.nn.Parameter(torch.zeros(num_heads, dtype=config.params_dtype))  # the checkpoint's are loaded
    set_tensor_model_parallel_attributes(sinks, is_parallel=True, dim=0, stride=1)
    return sinks


def sharded_sinks(module: torch.nn.Module, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> Any:
    """The module's sinks in a distributed checkpoint: split over TP along the heads, as megatron's
    DotProductAttention shards its `softmax_offset`."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    return make_sharded_tensors_for_checkpoint(
        {"softmax_offset": module.softmax_offset}, prefix, {"softmax_offset": 0}, sharded_offsets,
        tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=(metadata or {}).get("dp_cp_group"))


def allowed_keys(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[S, S] bool, True where query i sees key j: j <= i, and i - j <= window when the layer has one."""
    offsets = torch.arange(seq_len, device=device)[:, None] - torch.arange(seq_len, device=device)[None, :]
    allowed = offsets >= 0
    return allowed if window is None else allowed & (offsets <= window)


def attend_with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                      window: int | None, sinks: torch.Tensor | None, reference: bool = False) -> torch.Tensor:
    """Attention on [..., heads, S, hn] (keys and values [..., groups, S, hn]) with the window's mask and the sink
    logits [heads]; `reference`: unfused with the softmax in fp32, the sink as a score column."""
    allowed = allowed_keys(query.shape[-2], window, query.device)
    if reference:
        return _reference(query, key, value, scale, allowed, sinks)
    gqa = query.shape[-3] != key.shape[-3]
    if sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    query, key, value = _with_sink_key(query, key, value, sinks.to(query.dtype), scale)
    allowed = torch.cat([allowed.new_ones(allowed.shape[0], 1), allowed], dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def _with_sink_key(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query + one-hot dims of its place in its group; a sink key in front of the keys, a zero value in front of
    the values (see the module docstring)."""
    heads, groups, head_dim = query.shape[-3], key.shape[-3], query.shape[-1]
    per_group = heads // groups
    one_hot = torch.eye(per_group, dtype=query.dtype, device=query.device).repeat(groups, 1)  # [heads, g]
    query = torch.cat([query, one_hot[:, None, :].expand(*query.shape[:-1], per_group)], dim=-1)
    key = torch.cat([key, key.new_zeros(*key.shape[:-1], per_group)], dim=-1)
    sink_key = torch.cat([key.new_zeros(groups, 1, head_dim), (sinks / scale).reshape(groups, 1, per_group)], dim=-1)
    key = torch.cat([sink_key.expand(*key.shape[:-2], 1, head_dim + per_group), key], dim=-2)
    value = torch.cat([value.new_zeros(*value.shape[:-2], 1, value.shape[-1]), value], dim=-2)
    return query, key, value


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, allowed: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor:
    groups = query.shape[-3] // key.shape[-3]
    key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    scores = ((query @ key.transpose(-1, -2)).float() * scale).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.float()[:, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(-1)[..., : allowed.shape[-1]].to(value.dtype)
    return probs @ value
