"""Tiny random HF causal LMs on disk: the model every CPU run (trainer, engines, demo, tests) starts from.

Built from a config with no download; saved with `save_pretrained` (config.json + model.safetensors).
"""
from __future__ import annotations

import os

from weight_sync.families import FAMILIES, MoeFamily


def tiny_config(
    *,
    family: str = "qwen2",
    vocab_size: int = 32,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 4,
    moe_top_k: int = 2,
    bos_token_id: int = 0,
    eos_token_id: int = 1,
    pad_token_id: int | None = None,
):
    """The HF config of a tiny `family` model (no weights): what `save_tiny_model` builds, and what a dry run plans
    from; the family (weight_sync.families) adds its own fields. `num_experts` and `moe_top_k` shape MoE families
    only."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"tiny model: family must be one of {sorted(FAMILIES)}, got {family!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"tiny model: hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) and num_heads "
            f"by num_kv_heads ({num_kv_heads})"
        )
    if isinstance(FAMILIES[family], MoeFamily) and not 1 <= moe_top_k <= num_experts:
        raise ValueError(f"tiny model: moe_top_k must be in [1, num_experts={num_experts}], got {moe_top_k}")
    fields = FAMILIES[family].tiny_fields(hidden_size=hidden_size, num_heads=num_heads,
                                          intermediate_size=intermediate_size, num_experts=num_experts,
                                          moe_top_k=moe_top_k)
    shared = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
                  max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=bos_token_id,
                  eos_token_id=eos_token_id, pad_token_id=pad_token_id, torch_dtype="float32")
    # the family's fields win (multi-latent attention has as many key heads as query heads)
    return getattr(transformers, FAMILIES[family].tiny_classes[0])(**{**shared, **fields})


def save_tiny_model(
    path: str | os.PathLike,
    *,
    family: str = "qwen2",
    vocab_size: int = 32,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 4,
    moe_top_k: int = 2,
    seed: int = 0,
    bos_token_id: int = 0,
    eos_token_id: int = 1,
    pad_token_id: int | None = None,
) -> str:
    """Write a random float32 `family` model with untied embeddings to `path` and return the path as a string.
    The special token ids default to the toy tasks' (bos 0, eos 1); a model with a real tokenizer passes its ids."""
    import torch
    import transformers

    config = tiny_config(family=family, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                         num_experts=num_experts, moe_top_k=moe_top_k, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = getattr(transformers, FAMILIES[family].tiny_classes[1])(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return str(path)
