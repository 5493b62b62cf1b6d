"""HF <-> megatron-core GPTModel (local layer spec) names and layouts for the Llama / Qwen2 family.

The trainer loads HF checkpoints through `hf_to_megatron` + `shard_for_tp`; the weight bridge turns trainer
parameters back into what SGLang loads through `gather_from_tp` + `megatron_to_hf`. Full tensors unless noted.
"""
from __future__ import annotations

from typing import Any

import torch

# Whole-model tensors that map one to one: megatron name -> HF name.
GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# Per-layer tensors that map one to one (under decoder.layers.{i}. / model.layers.{i}.).
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# Per-layer fused megatron tensors and the HF tensors they are made of, in fusion order.
LAYER_FUSED = {
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
# How each megatron tensor is split across tensor-parallel ranks (by name suffix); anything else is replicated.
TP_SPLIT = {
    "embedding.word_embeddings.weight": "rows",  # vocab-parallel embedding
    "output_layer.weight": "rows",  # column-parallel over the vocab
    "linear_qkv.weight": "rows",  # column-parallel; the group-major layout makes a plain row chunk = whole groups
    "linear_qkv.bias": "rows",
    "linear_fc1.weight": "gate_up",  # column-parallel; each rank holds [gate chunk; up chunk]
    "linear_proj.weight": "cols",  # row-parallel
    "linear_fc2.weight": "cols",  # row-parallel
}


def _cfg(hf_config: Any, name: str, default: Any = None) -> Any:
    value = hf_config.get(name, default) if isinstance(hf_config, dict) else getattr(hf_config, name, default)
    return default if value is None else value


def attention_shape(hf_config: Any) -> tuple[int, int, int]:
    """(num query heads, num query groups = kv heads, head dim) of an HF Llama/Qwen2 config."""
    nq = int(_cfg(hf_config, "num_attention_heads"))
    ng = int(_cfg(hf_config, "num_key_value_heads", nq))
    head_dim = int(_cfg(hf_config, "head_dim", int(_cfg(hf_config, "hidden_size")) // nq))
    if nq % ng:
        raise ValueError(f"num_attention_heads={nq} is not a multiple of num_key_value_heads={ng}")
    return nq, ng, head_dim


def is_tied(hf_config: Any) -> bool:
    """True when the output layer shares the embedding (then neither side carries lm_head/output_layer)."""
    return bool(_cfg(hf_config, "tie_word_embeddings", False))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ng: int, head_dim: int) -> torch.Tensor:
    """HF q/k/v ([heads*d, H] or [heads*d]) -> megatron's group-major [q_heads_of_group..., k, v] per group."""
    rest = tuple(q.shape[1:])
    q = q.reshape(ng, -1, head_dim, *rest)
    k = k.reshape(ng, 1, head_dim, *rest)
    v = v.reshape(ng, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, nq: int, ng: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    rest = tuple(qkv.shape[1:])
    x = qkv.reshape(ng, nq // ng + 2, head_dim, *rest)
    q = x[:, : nq // ng].reshape(-1, *rest).contiguous()
    k = x[:, -2].reshape(-1, *rest).contiguous()
    v = x[:, -1].reshape(-1, *rest).contiguous()
    return q, k, v


def hf_to_megatron(hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full megatron-core GPTModel state dict (no `_extra_state` entries)."""
    nq, ng, head_dim = attention_shape(hf_config)
    out: dict[str, torch.Tensor] = {}
    for mname, hname in GLOBAL_NAMES.items():
        if mname == "output_layer.weight" and is_tied(hf_config):
            continue
        out[mname] = _take(hf_state, hname)
    for i in range(int(_cfg(hf_config, "num_hidden_layers"))):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for msuf, hsuf in LAYER_NAMES.items():
            out[mp + msuf] = _take(hf_state, hp + hsuf)
        for msuf, hsufs in LAYER_FUSED.items():
            if msuf.endswith("bias") and hp + hsufs[0] not in hf_state:
                continue  # Llama without attention bias
            parts = [_take(hf_state, hp + h) for h in hsufs]
            out[mp + msuf] = fuse_qkv(*parts, ng, head_dim) if "qkv" in msuf else torch.cat(parts, dim=0)
    return out


def megatron_to_hf(mcore_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Full megatron-core GPTModel state dict -> full HF state dict, in HF module order."""
    nq, ng, head_dim = attention_shape(hf_config)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _take(mcore_state, "embedding.word_embeddings.weight")}
    for i in range(int(_cfg(hf_config, "num_hidden_layers"))):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for msuf, hsufs in LAYER_FUSED.items():
            if msuf.endswith("bias") and mp + msuf not in mcore_state:
                continue
            fused = _take(mcore_state, mp + msuf)
            parts = split_qkv(fused, nq, ng, head_dim) if "qkv" in msuf else fused.chunk(2, dim=0)
            out.update({hp + h: p.contiguous() for h, p in zip(hsufs, parts)})
        for msuf, hsuf in LAYER_NAMES.items():
            out[hp + hsuf] = _take(mcore_state, mp + msuf)
    out["model.norm.weight"] = _take(mcore_state, "decoder.final_layernorm.weight")
    if not is_tied(hf_config):
        out["lm_head.weight"] = _take(mcore_state, "output_layer.weight")
    return out


def _take(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise KeyError(f"weight {name!r} is missing (have {len(state)} tensors, e.g. {sorted(state)[:3]}); "
                       "is this a Llama/Qwen2-family checkpoint with the config it was saved with?")
    return state[name]


def tp_split_kind(name: str) -> str:
    """'rows', 'cols', 'gate_up' or 'replicated' for a megatron parameter name."""
    for suffix, kind in TP_SPLIT.items():
        if name.endswith(suffix):
            return kind
    return "replicated"


def shard_for_tp(name: str, full_tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of a full megatron tensor that tensor-parallel rank `tp_rank` of `tp_size` holds."""
    kind = tp_split_kind(name)
    if kind == "replicated" or tp_size == 1:
        return full_tensor.clone()
    if kind == "gate_up":
        gate, up = full_tensor.chunk(2, dim=0)
        return torch.cat([_chunk(name, gate, 0, tp_rank, tp_size), _chunk(name, up, 0, tp_rank, tp_size)], dim=0)
    return _chunk(name, full_tensor, 0 if kind == "rows" else 1, tp_rank, tp_size)


def _chunk(name: str, t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of size {t.shape[dim]} does not split over tensor_model_parallel_size={size}; "
                         "choose a TP size that divides it")
    return t.chunk(size, dim=dim)[rank].contiguous()


def gather_from_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard_for_tp`: the full tensor from every TP rank's shard, in rank order."""
    kind = tp_split_kind(name)
    if kind == "replicated" or len(shards) == 1:
        return shards[0].clone()
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0 if kind == "rows" else 1)
