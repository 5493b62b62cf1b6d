"""sluice's core attention for the local layer spec (megatron's `CoreAttention` protocol: query, key, value in,
context out) on fused kernels: packed rows arrive as THD with cu_seqlens, so no [T, T] mask or score tensor is ever
built; padded rows run SDPA's causal kernel. Megatron's unfused `DotProductAttention` stays the reference
(`--attention-backend local`). Also the per-token RoPE that THD rows need without a host sync per sample.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from glue.trainer.sinks import attend_with_sinks, learnable_sinks as _learnable_sinks, sharded_sinks
from glue.trainer.sinks import window_of as _window_of

# --attention-backend (megatron's AttnBackend names) -> which core attention the local spec builds
FAST_BACKENDS = ("auto", "flash", "fused")
REFERENCE_BACKENDS = ("local", "unfused")
_reference_depth = 0  # > 0 inside `reference_attention()`


@functools.cache
def _varlen_kwargs() -> dict[str, Any] | None:
    """Keyword arguments that make torch's `varlen_attn` causal (and GQA-capable) in the installed torch, or None
    when it has none: its signature moved between releases (`is_causal` vs `window_size`, `enable_gqa`)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        kwargs: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        return None
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


@functools.cache
def _has_flex_attention() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def thd_kernel(query: torch.Tensor) -> str:
    """The kernel a packed (THD) forward runs for `query`'s device and dtype: on CUDA, FlashAttention's varlen
    kernel in bf16/fp16 where torch has it, else compiled flex_attention with a document-causal block mask where
    torch has that; else (CPU, a torch with neither) causal SDPA over the row's samples laid out as a batch."""
    if _reference_depth:
        return "reference"
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_kwargs() is not None:
        return "varlen_attn"
    if query.is_cuda and _has_flex_attention():
        return "flex_attention"
    return "sdpa_samples_as_batch"


class SluiceCoreAttention(MegatronModule):
    """Causal softmax attention over this TP rank's heads. Packed rows (`packed_seq_params.qkv_format == "thd"`):
    query [T, np, hn], key/value [T, ng, hn], one sequence per cu_seqlens span, output [T, np * hn]. Padded rows:
    [S, B, np, hn] -> [S, B, np * hn], causal within each row (the attention mask is not read: right padding
    never reaches a real token). Grouped-query heads are shared by the kernels, never repeated in memory."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {"context_parallel_size > 1": config.context_parallel_size > 1,
                       "window_size with a right side": config.window_size is not None and config.window_size[1],
                       "softmax_type off-by-one": config.softmax_type == "off-by-one",
                       "attention_dropout > 0": dropout > 0}
        if any(unsupported.values()):
            raise ValueError(f"sluice's core attention does not run {[k for k, v in unsupported.items() if v]}; "
                             "set --attention-backend local for megatron's unfused attention")
        tp_size = config.tensor_model_parallel_size
        self.num_heads = config.num_attention_heads // tp_size
        self.num_groups = self.num_heads if k_channels else config.num_query_groups // tp_size
        # multi-latent attention: as many key heads as query heads, keys of k_channels and values of v_channels dims
        self.head_dim = k_channels or config.kv_channels
        # megatron's query-key layer scaling divides the scale by the layer number and multiplies it back in the
        # softmax: the product is this plain scale
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.window = _window_of(config, layer_number)
        self.softmax_offset = _learnable_sinks(config, self.num_heads)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None
                ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("sluice's core attention takes no attention bias; set --attention-backend local")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed rows must arrive as THD, got qkv_format={packed_seq_params.qkv_format!r}")
            out = self._thd(query, key, value, packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q)
            return out.reshape(out.shape[0], -1)
        seq_len, batch = query.shape[:2]
        out = self._sdpa(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3))
        return out.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """Distributed checkpoints hold the sinks whole, each TP rank its heads' (glue.trainer.sinks)."""
        if self.softmax_offset is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return sharded_sinks(self, prefix, sharded_offsets, metadata)

    @property
    def is_plain_causal(self) -> bool:
        """False where the layer has sinks or a sliding window (gpt-oss), which the causal kernels cannot take."""
        return self.softmax_offset is None and self.window is None

    def _sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Causal SDPA on [..., heads, S, hn] (FlashAttention / memory-efficient kernels on CUDA); with sinks or a
        window, SDPA under their mask (glue.trainer.sinks)."""
        if not self.is_plain_causal:
            return attend_with_sinks(query, key, value, self.scale, self.window, self.softmax_offset,
                                     reference=bool(_reference_depth))
        if _reference_depth:
            return _reference_attention(query, key, value, self.scale)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.scale,
                                              enable_gqa=self.num_groups != self.num_heads)

    def _thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
             max_seqlen: int) -> torch.Tensor:
        """[T, heads, hn] attention within each cu_seqlens span (spans as a batch where the layer has sinks or a
        window: its mask is per span)."""
        if not self.is_plain_causal:
            return self._thd_as_batch(query, key, value, _batch_layout(cu_seqlens))
        if thd_kernel(query) == "varlen_attn":
            from torch.nn.attention.varlen import varlen_attn

            return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=self.scale,
                               **_varlen_kwargs())
        if thd_kernel(query) == "flex_attention":
            return self._thd_flex(query, key, value, cu_seqlens)
        return self._thd_as_batch(query, key, value, _batch_layout(cu_seqlens))

    def _thd_flex(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor
                  ) -> torch.Tensor:
        """THD attention by compiled flex_attention over the whole row as one sequence of [heads, T, hn], a block
        mask keeping each token to its own span's earlier tokens (blocks wholly outside a span are skipped)."""
        out = _compiled_flex_attention()(*(x.transpose(0, 1)[None] for x in (query, key, value)),
                                         block_mask=_document_block_mask(cu_seqlens, query.shape[0]),
                                         scale=self.scale, enable_gqa=self.num_groups != self.num_heads)
        return out[0].transpose(0, 1)

    def _thd_as_batch(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Layout
                      ) -> torch.Tensor:
        """THD attention as one causal SDPA call over the spans laid out as rows [N, heads, L, hn] (L the longest):
        each span's padding sits after its last token, so causality keeps every real query off it, and padded
        queries are dropped (their outputs get no gradient, so neither do the slots they read). Rows of very
        unequal spans would pad more than the row holds: those go span by span instead (`index` None)."""
        bounds, index, real = layout
        if index is None:
            spans = [self._sdpa(*(x[start:end].transpose(0, 1)[None] for x in (query, key, value)))[0].transpose(0, 1)
                     for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
            return torch.cat(spans)
        out = self._sdpa(*(x[index].transpose(1, 2) for x in (query, key, value)))  # [N, heads, L, hn]
        return out.transpose(1, 2)[real]  # [T, heads, hn]: integer indices, so no host sync (a mask would have one)


# a packed row's span bounds, the gather index [N, L] of its spans laid out as rows, and the (row, column) of each
# of its T tokens in that layout; None for both when the layout would pad more than the row holds
Layout = tuple[list[int], torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]
_row_cache: dict[str, tuple[torch.Tensor, Any]] = {}  # what -> (the last packed row's cu_seqlens, what was built)


def _per_row(what: str, cu_seqlens: torch.Tensor, build: Any) -> Any:
    """`build()` once per packed row (its cu_seqlens tensor): every layer of the micro-batch reuses it."""
    cached = _row_cache.get(what)
    if cached is None or cached[0] is not cu_seqlens:
        _row_cache[what] = (cu_seqlens, build())
    return _row_cache[what][1]


def _batch_layout(cu_seqlens: torch.Tensor) -> Layout:
    """The `Layout` of a packed row, built with one host read per micro-batch, not per layer."""
    return _per_row("layout", cu_seqlens, lambda: _build_layout(cu_seqlens))


def _build_layout(cu_seqlens: torch.Tensor) -> Layout:
    bounds = cu_seqlens.tolist()
    spans = [(start, end) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    longest = max(end - start for start, end in spans)
    index = real = None
    if len(spans) * longest <= 2 * bounds[-1]:
        device = cu_seqlens.device
        starts = torch.tensor([start for start, _ in spans], device=device)
        lengths = torch.tensor([end - start for start, end in spans], device=device)
        offsets = torch.arange(longest, device=device)
        index = torch.where(offsets[None, :] < lengths[:, None], starts[:, None] + offsets[None, :], 0)  # [N, L]
        rows = torch.arange(len(spans), device=device).repeat_interleave(lengths, output_size=bounds[-1])
        real = (rows, torch.arange(bounds[-1], device=device) - starts[rows])
    return bounds, index, real


@functools.cache
def _compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)  # flex runs as the kernel it compiles to, never eagerly


def _document_block_mask(cu_seqlens: torch.Tensor, tokens: int) -> Any:
    """flex_attention's BlockMask for a packed row: token q sees token kv when both lie in the same cu_seqlens
    span and kv <= q. Built by compiled code, which never materialises the [T, T] mask; once per row."""
    return _per_row("block_mask", cu_seqlens, lambda: _build_block_mask(cu_seqlens, tokens))


def _build_block_mask(cu_seqlens: torch.Tensor, tokens: int) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    positions = torch.arange(tokens, device=cu_seqlens.device)
    span = torch.searchsorted(cu_seqlens[1:], positions, right=True)  # each token's span

    def document_causal(batch: Any, head: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (span[q] == span[kv]) & (q >= kv)

    return create_block_mask(document_causal, None, None, tokens, tokens, device=cu_seqlens.device, _compile=True)


def _reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Unfused causal attention with the softmax in fp32, as megatron's DotProductAttention computes it (scores
    materialised): the yardstick `reference_attention()` swaps in."""
    groups = query.shape[-3] // key.shape[-3]
    key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    scores = (query @ key.transpose(-1, -2)).float() * scale
    blocked = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
    probs = scores.masked_fill(blocked, float("-inf")).softmax(-1).to(value.dtype)
    return probs @ value


@contextlib.contextmanager
def reference_attention() -> Iterator[None]:
    """Inside, every SluiceCoreAttention computes unfused fp32-softmax attention sample by sample (the logprob gap
    of the fast kernels is measured against it; `make gpu-bench`)."""
    global _reference_depth
    _reference_depth += 1
    try:
        yield
    finally:
        _reference_depth -= 1


def core_attention_class(attention_backend: Any) -> type:
    """The core attention the local spec builds for megatron's `attention_backend` (an AttnBackend or its name):
    sluice's fused one for auto / flash / fused, megatron's unfused DotProductAttention for local / unfused."""
    name = getattr(attention_backend, "name", attention_backend)
    if name in REFERENCE_BACKENDS:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention
    if name in FAST_BACKENDS:
        return SluiceCoreAttention
    raise ValueError(f"--attention-backend {name!r} is not known; use one of {FAST_BACKENDS + REFERENCE_BACKENDS}")


def attention_kernel(model: torch.nn.Module, *, packed: bool) -> str:
    """What the model's core attention runs for packed or padded rows on its parameters' device and dtype."""
    core = _first_core_attention(model)
    if core is None:
        return "none (no transformer layer on this stage)"
    kind = type(core).__name__
    if kind != "SluiceCoreAttention":
        return {"DotProductAttention": "megatron DotProductAttention (unfused, [T, T] scores and mask)",
                "TEDotProductAttention": "transformer-engine DotProductAttention"}.get(kind, kind)
    weight = next(model.parameters())
    if not packed:
        return "sdpa causal"
    return thd_kernel(torch.empty(0, device=weight.device, dtype=weight.dtype))


def is_mask_free(model: torch.nn.Module) -> bool:
    """True when the model's core attention takes packed rows as THD and padded rows without a mask (sluice's or
    transformer-engine's); False for megatron's DotProductAttention, which needs the [T, T] mask."""
    core = _first_core_attention(model)
    if core is None:  # a stage without layers never reads the mask
        return True
    return type(core).__name__ in ("SluiceCoreAttention", "TEDotProductAttention")


def _first_core_attention(model: torch.nn.Module) -> torch.nn.Module | None:
    """The core attention of the model's first transformer layer on this stage (every layer builds the same kind),
    or None for a stage without layers."""
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    return layers[0].self_attention.core_attention if layers else None
