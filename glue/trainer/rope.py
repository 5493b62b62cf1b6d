"""RoPE as the trainer applies it: megatron's unfused rotation with cos/sin computed once per forward (not per layer
and per q/k), and packed THD rows rotated by each token's own position in one pass. megatron's own THD path splits
the row per sample with a host read each (`_apply_rotary_pos_emb_thd`); `rope_at_positions` (glue.trainer.model)
hands it one angle row per token instead, which this rotation applies directly.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from glue.trainer.norm import compile_elementwise

_installed = False
_compiled = False  # trainer.compile: the rotation runs under torch.compile (one fused kernel each way)
_cache: dict[str, Any] = {}  # the last angle table (key: table, dtype, layout) and its cos/signed sin


def install(compiled: bool = False) -> None:
    """Route megatron's attention through `apply_rotary_pos_emb` below (idempotent), the rotation compiled by
    torch.compile when `compiled` (trainer.compile). Cases it does not cover (fused RoPE, YaRN scaling, MLA, context
    parallelism) go to megatron's function unchanged; partial rotary turns the first dims only, interleaved pairs
    (GLM-4) turn uncompiled."""
    global _installed, _compiled
    _compiled = compiled
    if _installed:
        return
    from megatron.core.transformer import attention

    megatron_rope = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config: Any, cu_seqlens: Any = None,
                             mscale: float = 1.0, cp_group: Any = None) -> torch.Tensor:
        if not _is_plain(config, freqs, t, mscale, cp_group):
            return megatron_rope(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        if cu_seqlens is not None and freqs.shape[0] != t.shape[0]:
            # a position table, not one row per token: megatron's per-sample path
            return megatron_rope(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        turned, packed = freqs.shape[-1], cu_seqlens is not None
        # THD [T, heads, d] takes one angle row per token [T, 1, 1, d]
        rotation = rotate_interleaved if config.rotary_interleaved else rotate
        if turned < t.shape[-1]:  # partial rotary (GLM-4 / 4.5): the first dims of each head turn, the rest pass
            return torch.cat((rotation(t[..., :turned], freqs, packed=packed), t[..., turned:]), dim=-1)
        return rotation(t, freqs, packed=packed)

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _installed = True


def _is_plain(config: Any, freqs: torch.Tensor, t: torch.Tensor, mscale: float, cp_group: Any) -> bool:
    """True when the rotation is megatron's unfused rotation (halves, or interleaved pairs) over the whole head (the
    Llama/Qwen case) or over its first dims (partial rotary)."""
    return (not config.apply_rope_fusion and not config.multi_latent_attention and mscale == 1.0 and freqs.shape[-1] <= t.shape[-1] and (cp_group is None or cp_group.size() == 1))


def rotate(t: torch.Tensor, freqs: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """t * cos + rotate_half(t) * sin, [S, B, heads, d] by angles broadcasting to it ([S, 1 or B, 1, d]), or
    `packed` THD [T, heads, d] by one angle row per token [T, 1, 1, d]. rotate_half(t) = cat(-t2, t1) is computed
    as roll(t, d/2) times a sin whose first half is negated: three ops forward, four backward, no cat. The cos/sin
    of one forward's angle table are reused by every layer (and by q and k)."""
    key = (freqs, t.dtype, packed)
    if _cache.get("key") is None or any(a is not b for a, b in zip(_cache["key"], key)):
        angles = freqs[:, 0] if packed else freqs
        half = angles.shape[-1] // 2
        sin = angles.sin()
        _cache.update(key=key, cos=angles.cos().to(t.dtype),
                      sin=torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(t.dtype))
    if not _compiled:
        return _rotation(t, _cache["cos"], _cache["sin"])
    for tensor in (t, _cache["cos"], _cache["sin"]):  # the sequence dimension changes every micro-batch
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return _compiled_rotation()(t, _cache["cos"], _cache["sin"])


def rotate_interleaved(t: torch.Tensor, freqs: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3) ... (GLM-4), whose angle table repeats each angle twice in place
    ([a0, a0, a1, a1, ...]): t * cos + rot(t) * sin with rot(t) = (-x1, x0, -x3, x2, ...). Shapes as `rotate`."""
    angles = freqs[:, 0] if packed else freqs
    x1, x2 = t[..., 0::2], t[..., 1::2]
    turned = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return t * angles.cos().to(t.dtype) + turned * angles.sin().to(t.dtype)


def _rotation(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(t * cos, t.roll(t.shape[-1] // 2, dims=-1), signed_sin)


@functools.cache
def _compiled_rotation() -> Any:
    return compile_elementwise(_rotation)
