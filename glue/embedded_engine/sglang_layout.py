"""SGLang's view of the engine's weights, for `/weights_checker` under --sglang-strict: SGLang's own parameter names
(fused `qkv_proj`, `gate_up_proj`, MoE `experts.w13_weight` / `w2_weight`) and each TP rank's shard of them, hashed
as SGLang's CPU `tensor_hash` does (on a GPU SGLang hashes with a kernel: there only names and shapes compare)."""
from __future__ import annotations

import hashlib
import re
from typing import Any

import torch

from glue.embedded_engine.checkpoint_names import checkpoint_tensors, family_of_model

VOCAB_PADDING = 64  # sglang/srt/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QKV = re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(.*\.mlp)\.(gate|up)_proj\.weight$")
_ROW_PARALLEL = (".self_attn.o_proj.weight", ".mlp.down_proj.weight")  # sharded along the input dimension
_VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


def shard(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """tp_rank's equal slice of `t` along `dim` (SGLang's Column/RowParallelLinear split)."""
    size = t.shape[dim] // tp_size
    return t.narrow(dim, tp_rank * size, size)


def head_shard(t: torch.Tensor, num_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """tp_rank's attention heads of a q/k/v projection: an equal share, or, with fewer heads than ranks, the one
    head its rank replicates (SGLang's QKVParallelLinear `num_kv_head_replicas`)."""
    count = max(1, num_heads // tp_size)
    start = tp_rank * num_heads // tp_size if num_heads < tp_size else tp_rank * count
    return t.narrow(0, start * head_dim, count * head_dim)


def vocab_shard(t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """tp_rank's rows of a vocab-parallel embedding, the vocabulary padded to a multiple of 64 first (padded rows
    are zeros here; SGLang leaves them as allocated)."""
    padded = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
    full = torch.cat([t, t.new_zeros((padded - t.shape[0], *t.shape[1:]))]) if padded > t.shape[0] else t
    return shard(full, 0, tp_rank, tp_size)


def rank_tensors(model: Any, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """SGLang parameter name -> tp_rank's shard, built from the HF model's checkpoint tensors."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    gate_up: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    family = family_of_model(model)
    for name, t in checkpoint_tensors(model, with_tied_copies=False).items():
        t = t.detach()
        if m := _EXPERT.match(family.loaded_name(name) if family else name):  # which projection of which expert
            experts.setdefault(name[:name.index(".experts.")] + ".experts", {})[(m[3], int(m[2]))] = t
        elif m := _QKV.match(name):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = t
        elif m := _GATE_UP.match(name):
            gate_up.setdefault(m[1], {})[m[2]] = t
        elif name.endswith(_ROW_PARALLEL):
            out[name] = shard(t, 1, tp_rank, tp_size)
        elif name.endswith(_VOCAB_PARALLEL):
            out[name] = vocab_shard(t, tp_rank, tp_size)
        else:  # norms, the MoE router (`mlp.gate`): replicated on every rank
            out[name] = t
    for (prefix, kind), parts in qkv.items():
        out[f"{prefix}.qkv_proj.{kind}"] = torch.cat([
            head_shard(parts["q"], heads, head_dim, tp_rank, tp_size),
            head_shard(parts["k"], kv_heads, head_dim, tp_rank, tp_size),
            head_shard(parts["v"], kv_heads, head_dim, tp_rank, tp_size)])
    for prefix, parts in gate_up.items():
        out[f"{prefix}.gate_up_proj.weight"] = torch.cat([shard(parts[p], 0, tp_rank, tp_size) for p in ("gate", "up")])
    for prefix, parts in experts.items():
        count = 1 + max(e for _, e in parts)
        out[f"{prefix}.w13_weight"] = torch.stack([
            torch.cat([shard(parts[("gate_proj", e)], 0, tp_rank, tp_size),
                       shard(parts[("up_proj", e)], 0, tp_rank, tp_size)]) for e in range(count)])
        out[f"{prefix}.w2_weight"] = torch.stack([shard(parts[("down_proj", e)], 1, tp_rank, tp_size)
                                                  for e in range(count)])
    return out


def tensor_hash(t: torch.Tensor) -> str:
    """SGLang's weight-checker hash on CPU (`mm_utils.tensor_hash`): the first 8 bytes of the SHA-256 of the
    tensor's bytes, as 16 hex digits."""
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()[:16]


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's `per_gpu_checksum` (utils/weight_checker.py overall_checksum): SHA-256 over sorted name + hash."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def checker_ranks(model: Any, tp_size: int) -> list[dict[str, Any]]:
    """The `ranks` of SGLang's `/weights_checker` checksum answer: one ChecksumInfo per TP rank (call it with the
    model lock held)."""
    ranks = []
    for tp_rank in range(tp_size):
        sums = {name: tensor_hash(t) for name, t in rank_tensors(model, tp_rank, tp_size).items()}
        placement = {"role": "target", "tp_rank": tp_rank, "tp_size": tp_size, "dp_rank": 0, "dp_size": 1,
                     "pp_rank": 0, "pp_size": 1, "rank": tp_rank, "size": tp_size}
        ranks.append({"checksums": sums, "per_gpu_checksum": overall_checksum(sums), "parallelism_info": [placement]})
    return ranks


def per_engine_checksum(ranks: list[dict[str, Any]]) -> str:
    """SGLang's `per_engine_checksum` (tokenizer_control_mixin.check_weights): SHA-256 over the ranks' checksums."""
    h = hashlib.sha256()
    for info in ranks:
        h.update(info["per_gpu_checksum"].encode())
    return h.hexdigest()
