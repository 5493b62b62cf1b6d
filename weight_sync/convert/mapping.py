"""HF <-> megatron-core state dicts, for one rank or for every rank of a parallel layout: fuse / split q-k-v and
gate-up, shard / gather over TP, place layers on pipeline stages and experts on EP ranks, pad / unpad the vocab.

Driven entirely by the family name tables (weight_sync.families). The trainer loads HF checkpoints through
`hf_to_megatron_local`; the weight bridge turns trainer tensors back into what SGLang loads with `megatron_to_hf`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from weight_sync.convert.layout import ParallelLayout, gather, pad_vocab, shard
from weight_sync.convert.te_names import from_te_names
from weight_sync.families import family_of, is_tied, kind_by_suffix, num_experts, rules
from weight_sync.families.table import (EMBEDDING, EXPERT_GLU, EXPERT_T, FINAL_NORM, GATE_UP, OUTPUT, QKV, REPLICATED,
                                        ROW, VOCAB, Rule, cfg)

KIND_BY_SUFFIX = kind_by_suffix()
# HF tensors a checkpoint may carry that no megatron tensor needs.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def attention_shape(hf_config: Any) -> tuple[int, int, int]:
    """(num query heads, num query groups = kv heads, head dim) of an HF config (head_dim may differ from
    hidden_size / heads, as in Qwen3)."""
    nq = int(cfg(hf_config, "num_attention_heads"))
    ng = int(cfg(hf_config, "num_key_value_heads", nq))
    head_dim = int(cfg(hf_config, "head_dim", int(cfg(hf_config, "hidden_size")) // nq))
    if nq % ng:
        raise ValueError(f"num_attention_heads={nq} is not a multiple of num_key_value_heads={ng}")
    return nq, ng, head_dim


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


def hf_to_megatron_local(hf_state: dict[str, torch.Tensor], hf_config: Any,
                         layout: ParallelLayout = ParallelLayout()) -> dict[str, torch.Tensor]:
    """Full HF state dict (checkpoint names) -> the megatron state dict of the rank at `layout`: only its stage's
    layers (stage-local numbering), its experts (EP-local numbering), its TP shard, the vocab padded.
    Replicated tensors may share storage with `hf_state`."""
    table = rules(hf_config)
    _check_known_hf_names(hf_state, table, hf_config)
    _check_tp_divides_groups(hf_config, layout)
    shape = attention_shape(hf_config)
    n_experts = num_experts(hf_config)
    out: dict[str, torch.Tensor] = {}
    for rule in table:
        name = local_name(rule, layout, n_experts)
        if name is None:
            continue
        parts = [_take(hf_state, h) for h in rule.hf]
        if rule.is_expert_slice:  # one expert's slice of the HF tensor, as megatron lays it out
            parts = expert_views(rule, parts[0][rule.expert])
        full = _fuse(rule, parts, shape)
        if rule.is_expert_slice and len(parts) == 1:  # a view into the HF tensor of every expert: own it
            full = full.clone(memory_format=torch.contiguous_format)
        out[name] = _shard_rule(rule, name, full, layout)
    if _has_output_copy_of_embedding(hf_config, layout):
        tied = Rule(OUTPUT.megatron, EMBEDDING.hf, VOCAB)
        out[OUTPUT.megatron] = _shard_rule(tied, OUTPUT.megatron, _take(hf_state, EMBEDDING.hf[0]), layout)
    return out


def hf_to_megatron(hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full megatron-core GPTModel state dict (one rank, no `_extra_state` entries)."""
    return hf_to_megatron_local(hf_state, hf_config, ParallelLayout())


def megatron_to_hf(states: dict[str, torch.Tensor] | Sequence[dict[str, torch.Tensor]], hf_config: Any,
                   layouts: Sequence[ParallelLayout] | None = None) -> dict[str, torch.Tensor]:
    """Megatron state dicts -> the full HF state dict (checkpoint names, HF module order).

    Either one full state dict (`layouts=None`), or one local state dict per rank with that rank's layout: TP
    shards are gathered, stages concatenated, EP-local experts renumbered to global ids, vocab padding dropped.
    Ranks holding the same shard (data-parallel or expert-data-parallel copies) are read once. Every tensor of
    every given state must be used, so a state dict and table that disagree fail loudly. States may be in the local
    spec's names or in Transformer Engine's (fused norms, `_extra_state` entries: `te_names`).
    """
    if layouts is None:
        states, layouts = [states], [ParallelLayout()]
    states = [from_te_names(state) for state in states]
    if len(states) != len(layouts):
        raise ValueError(f"megatron_to_hf: {len(states)} state dicts but {len(layouts)} layouts; give one per rank")
    n_experts = num_experts(hf_config)
    used: set[tuple[int, str]] = set()
    out: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[int, torch.Tensor]] = {}  # HF tensors of every expert, by expert, stacked at the end
    for rule in rules(hf_config):
        tensors = rule_to_hf(rule, _shards_of(rule, states, layouts, n_experts, used), hf_config)
        if rule.is_expert_slice:
            for name, piece in tensors.items():
                out.setdefault(name, None)
                slices.setdefault(name, {})[rule.expert] = piece
        else:
            out.update(tensors)
    for name, by_expert in slices.items():
        out[name] = torch.stack([by_expert[e] for e in range(n_experts)])
    for i, layout in enumerate(layouts):
        if _has_output_copy_of_embedding(hf_config, layout):
            used.add((i, OUTPUT.megatron))
    _check_all_used(states, used)
    return out


def rule_to_hf(rule: Rule, shards: list[torch.Tensor], hf_config: Any, copy: bool = True
               ) -> dict[str, torch.Tensor]:
    """One megatron tensor, from its TP shards in TP-rank order, as the HF tensors it holds: gathered, its vocab
    padding dropped, q/k/v or gate/up split apart. `copy=False`: the vocab padding is cut off as a view, not a copy
    (for a reader that copies the tensor right away, like a streaming sync). For a rule of one expert's slice of an
    HF tensor of every expert, the slice (`[expert]` of the HF tensor) under the HF tensor's name."""
    full = gather(rule.kind, shards)
    if rule.is_expert_slice:
        return {rule.hf[0]: _expert_slice_of(rule, full)}
    vocab = int(cfg(hf_config, "vocab_size"))
    if rule.kind == VOCAB and full.shape[0] != vocab:
        full = full[:vocab].clone() if copy else full[:vocab]
    return dict(zip(rule.hf, _split(rule, full, attention_shape(hf_config))))


def shard_into_hf(rule: Rule, shard_: torch.Tensor, rank: int, size: int, hf: Sequence[torch.Tensor],
                  hf_config: Any) -> None:
    """Copy TP rank `rank`'s shard (of `size`) of `rule`'s tensor into its places in the rule's HF tensors `hf`
    (whole, in `rule.hf` order): once every rank's shard is in, `hf` holds what `rule_to_hf` gives. A gatherer
    that takes the shards one at a time so holds the HF tensors and one shard, never all the shards, their
    concatenation and the split copies side by side. An expert-slice rule's `hf` is the HF tensor of every expert."""
    if rule.is_expert_slice:
        hf = expert_views(rule, hf[0][rule.expert])
    if rule.kind == REPLICATED:
        hf[0].copy_(shard_)
    elif rule.kind == ROW:
        cols = shard_.shape[1]
        hf[0][:, rank * cols: (rank + 1) * cols].copy_(shard_)
    elif rule.kind == GATE_UP:
        rows = shard_.shape[0] // 2
        halves = hf if len(hf) == 2 else hf[0].chunk(2, dim=0)  # one fused [gate; up] tensor: its two halves
        for out, half in zip(halves, shard_.chunk(2, dim=0)):
            out[rank * rows: (rank + 1) * rows].copy_(half)
    elif rule.kind == QKV:  # group-major: TP rank r holds query groups [r * g, (r + 1) * g)
        nq, ng, head_dim = attention_shape(hf_config)
        per_group, groups, rest = nq // ng, ng // size, tuple(shard_.shape[1:])
        x = shard_.reshape(groups, per_group + 2, head_dim, *rest)
        q, k, v = (t.view(ng, -1, head_dim, *rest) for t in hf)
        at = slice(rank * groups, (rank + 1) * groups)
        q[at].copy_(x[:, :per_group])
        k[at].copy_(x[:, -2:-1])
        v[at].copy_(x[:, -1:])
    else:  # column-parallel rows; a vocab shard's rows past the vocab are padding
        start = rank * shard_.shape[0]
        stop = min(start + shard_.shape[0], hf[0].shape[0])
        if stop > start:
            hf[0][start:stop].copy_(shard_[: stop - start])


def expert_views(rule: Rule, hf_slice: torch.Tensor) -> list[torch.Tensor]:
    """One expert's slice of an HF tensor of every expert, as views in megatron's layout, in fusion order: the slice
    itself, its transpose, or (gate / up interleaved along the last dim) its gate and up halves, each transposed
    when it is a weight. Writing into a view writes into the HF tensor."""
    if rule.hf_form == EXPERT_GLU:
        halves = [hf_slice[..., 0::2], hf_slice[..., 1::2]]
        return [h.mT for h in halves] if hf_slice.dim() == 2 else halves
    return [hf_slice.mT] if rule.hf_form == EXPERT_T else [hf_slice]


def _expert_slice_of(rule: Rule, full: torch.Tensor) -> torch.Tensor:
    """Inverse of `expert_views`: the HF slice of one expert from its full megatron tensor."""
    shape = full.shape[::-1] if rule.hf_form in (EXPERT_T, EXPERT_GLU) and full.dim() == 2 else full.shape
    piece = full.new_empty(shape)
    views = expert_views(rule, piece)
    for view, part in zip(views, full.chunk(len(views), dim=0)):
        view.copy_(part)
    return piece


def _shards_of(rule: Rule, states: Sequence[dict], layouts: Sequence[ParallelLayout], n_experts: int,
               used: set[tuple[int, str]]) -> list[torch.Tensor]:
    """One shard per TP rank of `rule`'s tensor, in TP-rank order, from whichever ranks hold it."""
    by_tp: dict[int, torch.Tensor] = {}
    tp_size = None
    for i, (state, layout) in enumerate(zip(states, layouts)):
        name = local_name(rule, layout, n_experts)
        if name is None:
            continue
        if name not in state:
            raise KeyError(f"rank {i} ({layout}) should hold {name!r} (HF {rule.hf[0]}) but its state dict does not; "
                           "do the layouts match the ranks the states came from?")
        used.add((i, name))
        tp_rank, tp_size = shard_rank(rule, layout)
        by_tp.setdefault(tp_rank, state[name])
    if tp_size is None or len(by_tp) != tp_size:
        raise KeyError(f"{rule.hf[0]}: TP shards {sorted(by_tp)} of {tp_size} found in the given ranks; "
                       "pass the state dict of every tensor-, pipeline- and expert-parallel rank")
    return [by_tp[r] for r in range(tp_size)]


def local_name(rule: Rule, layout: ParallelLayout, n_experts: int) -> str | None:
    """`rule`'s megatron name on the rank at `layout`, or None when another stage or EP rank holds it."""
    if rule.megatron == EMBEDDING.megatron and not layout.is_first_stage:
        return None
    if rule.megatron in (FINAL_NORM.megatron, OUTPUT.megatron) and not layout.is_last_stage:
        return None
    local_layer = local_expert = None
    if rule.layer is not None:
        if not layout.holds_layer(rule.layer):
            return None
        local_layer = rule.layer - layout.first_layer
    if rule.expert is not None:
        if not layout.holds_expert(rule.expert, n_experts):
            return None
        local_expert = rule.expert - layout.ep_rank * layout.local_experts(n_experts)
    return rule.megatron_name(local_layer, local_expert)


def shard_rank(rule: Rule, layout: ParallelLayout) -> tuple[int, int]:
    """(rank, size) of the tensor parallelism that splits `rule`'s tensor on the rank at `layout`: expert TP for
    routed experts, dense TP for the rest."""
    return layout.expert_tp if rule.expert is not None else (layout.tp_rank, layout.tp_size)


def _shard_rule(rule: Rule, name: str, full: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    if rule.kind == VOCAB:
        full = pad_vocab(full, layout.padded_vocab_size)
    return shard(rule.kind, name, full, *shard_rank(rule, layout))


def _fuse(rule: Rule, parts: list[torch.Tensor], shape: tuple[int, int, int]) -> torch.Tensor:
    if rule.kind == QKV:
        return fuse_qkv(*parts, shape[1], shape[2])
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def _split(rule: Rule, full: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
    if rule.kind == QKV:
        return split_qkv(full, *shape)
    if rule.kind == GATE_UP and len(rule.hf) == 2:  # GLM-4's checkpoint keeps [gate; up] as one tensor
        return tuple(p.contiguous() for p in full.chunk(2, dim=0))
    return (full,)


def _has_output_copy_of_embedding(hf_config: Any, layout: ParallelLayout) -> bool:
    # With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding as the output layer.
    return is_tied(hf_config) and layout.pp_size > 1 and layout.is_last_stage


def _check_known_hf_names(hf_state: dict[str, torch.Tensor], table: list[Rule], hf_config: Any) -> None:
    known = {h for rule in table for h in rule.hf}
    if is_tied(hf_config):
        known.add(OUTPUT.hf[0])  # some tied checkpoints still save lm_head
    family = family_of(hf_config)  # its frozen layers (MTP) are kept beside the model, not in it
    unknown = sorted(n for n in hf_state if n not in known and not n.endswith(IGNORED_HF_SUFFIXES)
                     and not family.is_frozen(hf_config, n))
    if unknown:
        raise ValueError(f"{len(unknown)} checkpoint tensors are not in the {family.name} name table, e.g. "
                         f"{unknown[:4]}; does config.json match the checkpoint (attention_bias, num_experts, "
                         "mlp_only_layers, tie_word_embeddings)?")


def _check_tp_divides_groups(hf_config: Any, layout: ParallelLayout) -> None:
    _, ng, _ = attention_shape(hf_config)
    if ng % layout.tp_size:
        raise ValueError(f"tensor_model_parallel_size={layout.tp_size} must divide num_key_value_heads={ng} (each TP "
                         "rank holds whole query groups); choose a TP size that divides it")


def _check_all_used(states: Sequence[dict[str, torch.Tensor]], used: set[tuple[int, str]]) -> None:
    extra = [(i, n) for i, s in enumerate(states) for n in s if (i, n) not in used and not n.endswith("_extra_state")]
    if extra:
        raise ValueError(f"megatron tensors not in the name table: {extra[:4]} (rank, name); the layer spec builds "
                         "tensors the converter does not know, or a layout does not match its rank")


def _take(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise KeyError(f"weight {name!r} is missing (have {len(state)} tensors, e.g. {sorted(state)[:3]}); "
                       "is this checkpoint of the family its config.json names, saved with that config?")
    return state[name]


def tp_split_kind(name: str) -> str:
    """The layout kind of a megatron parameter, from its name alone (any family's table)."""
    return KIND_BY_SUFFIX.get(".".join(name.split(".")[-2:]), REPLICATED)


def shard_for_tp(name: str, full_tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of a full megatron tensor that tensor-parallel rank `tp_rank` of `tp_size` holds (a new tensor)."""
    kind = tp_split_kind(name)
    part = shard(kind, name, full_tensor, tp_rank, tp_size)
    return part.clone() if part is full_tensor or kind == REPLICATED else part


def gather_from_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard_for_tp`: the full tensor from every TP rank's shard, in rank order."""
    kind = tp_split_kind(name)
    full = gather(kind, shards)
    return full.clone() if full is shards[0] else full
